from setuptools import find_packages, setup

setup(
    name="hvdtrain",
    version="0.1.0",
    description="Horovod-based distributed ImageNet trainer for PyTorch",
    license="Apache-2.0",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    package_data={"hvdtrain": ["configs/*.yaml", "configs/*.json"]},
    python_requires=">=3.9",
    # horovod is built from source by scripts/setup.sh (0.28.1 + the patches in third_party/horovod/),
    # so it is not listed.
    # The versions scripts/setup.sh pins (tests/unit/test_supply_chain.py keeps the two in step).
    # torch and torchvision have no version here: setup.sh pins them, except with
    # HVDTRAIN_SYSTEM_TORCH=1, where an image's own torch is used and must not be replaced.
    install_requires=["torch", "torchvision", "pyyaml==6.0.3", "tensorboardX==2.6.5", "tqdm==4.70.1",
                      "numpy==2.4.6", "pillow==13.0.0", "simplejpeg==1.9.0", "psutil==7.2.2"],
    extras_require={"mpi": ["mpi4py==4.1.2"], "report": ["matplotlib==3.11.2"],
                    # What only the tests need: the integrations they exercise for real (a real
                    # `mlflow server`, W&B offline, a two-node Ray cluster, a moto S3 server, shards read
                    # back by webdataset), the digits dataset (scikit-learn), timm's models and
                    # TensorBoard's own event reader (the curves hvdtrain writes, read as TensorBoard reads them).
                    "test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "mlflow==3.17.2", "wandb==0.31.0", "ray[default]==2.60.0", "tensorboard==2.21.0",
                             "scikit-learn==1.9.1", "timm==1.0.31", "webdataset==1.0.2", "moto[server]==5.2.5",
                             "fsspec==2026.9.0", "s3fs==2026.9.0", "aiobotocore==3.10.0",
                             # data.decoder=nvimgcodec through nvImageCodec's CPU backend (no GPU in CI)
                             "nvidia-nvimgcodec-cu13==0.9.0.20", "nvidia-nvjpeg==13.3.2.43"],
                    # data.dir=s3://bucket/prefix (and other fsspec URLs) for shards
                    "s3": ["fsspec==2026.9.0", "s3fs==2026.9.0", "aiobotocore==3.10.0"],
                    # data.decoder=nvimgcodec: JPEGs decoded on the GPU (its hardware JPEG decoder on
                    # A100/H100-class GPUs, nvJPEG otherwise), docs/data.md
                    "gpudecode": ["nvidia-nvimgcodec-cu13==0.9.0.20", "nvidia-nvjpeg==13.3.2.43"],
                    # GPU utilization, memory and power per rank in metrics.jsonl (NVML)
                    "gpu": ["nvidia-ml-py==13.615.71"],
                    # timm's models (model.arch=timm/<name>)
                    "timm": ["timm==1.0.31"],
                    # experiment tracking (docs/tracking.md): tracking.wandb.*, tracking.mlflow.*
                    "wandb": ["wandb==0.31.0"], "mlflow": ["mlflow==3.17.2"],
                    # hvdtrain ray (docs/ray.md); [default] brings the dashboard's state API and job server
                    "ray": ["ray[default]==2.60.0"]},
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.__main__:main"]},
)
