#!/usr/bin/env bash
# A GPU machine without a package registry, ready for hvdtrain: a venv over the system's torch,
# hvdtrain's other dependencies from a folder of wheels, and Horovod 0.28.1 built from its sdist
# with hvdtrain's patch series (third_party/horovod/series, scripts/horovod-patches.sh) and NCCL ops
# (or installed from a wheel built by an earlier run).
#
#   bash benchmarks/gpu/setup_device.sh WHEELS SDIST [WHEEL_OUT]
#
# WHEELS: cloudpickle, psutil, pyyaml, packaging, cffi, tensorboardX, tqdm, nvidia-ml-py (and a
# horovod-0.28.1-*.whl, if one was built before; nvidia-nvimgcodec-cu13 and nvidia-nvjpeg for
# data.decoder=nvimgcodec, 25 MB and 4 MB). WHEEL_OUT: where to leave the built Horovod wheel, with a
# file horovod-series-id naming the patch series it was built with (scripts/horovod-patches.sh id). A
# wheel in WHEELS is installed unless WHEELS/horovod-series-id names another series (then Horovod is
# compiled); one without that file, from before the record, is installed with a warning.
# GCC 13 and CMake 4 need two flags for the 0.28.1 sources (-include of standard headers; a policy minimum).
# The venv is $HVD_VENV: by default python3's own venv when it runs in one (where the system's torch
# is), else a new /tmp/hvd-venv over the system site-packages. Used for docs/benchmarks.md.
set -euo pipefail
wheels=$(realpath "$1"); sdist=$(realpath "$2"); out=${3:-}
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${HVD_VENV:-$(python3 -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "/tmp/hvd-venv")')}
[[ -x $venv/bin/python ]] || python3 -m venv --system-site-packages "$venv"
py=$venv/bin/python
# load_horovod_series, horovod_series_id, apply_horovod_series
source "$repo/scripts/horovod-patches.sh"
load_horovod_series || { echo "setup_device: $horovod_patches_problem" >&2; exit 1; }
series_id=$(horovod_series_id)
"$py" -m pip install -q --no-index --find-links "$wheels" cloudpickle psutil pyyaml packaging cffi tensorboardX tqdm simplejpeg \
    nvidia-ml-py
# data.decoder=nvimgcodec (the gpudecode extra), when its wheels were carried along.
if ls "$wheels"/nvidia_nvimgcodec_cu13-*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --find-links "$wheels" nvidia-nvimgcodec-cu13 nvidia-nvjpeg
fi
if ! "$py" -c 'import horovod.torch' 2>/dev/null; then
    wheel=$(ls "$wheels"/horovod-0.28.1-*.whl 2>/dev/null | head -1 || true)
    if [[ -n $wheel && -f $wheels/horovod-series-id && $(cat "$wheels/horovod-series-id") != "$series_id" ]]; then
        echo "setup_device: $wheel was built with patch series $(cat "$wheels/horovod-series-id"), not $series_id: compiling"
        wheel=""
    elif [[ -n $wheel && ! -f $wheels/horovod-series-id ]]; then
        echo "setup_device: warning: $wheel has no horovod-series-id beside it: installed, though it may predate patch series $series_id"
    fi
    if [[ -z $wheel ]]; then
        src=$(mktemp -d)
        tar -xzf "$sdist" -C "$src"
        apply_horovod_series "$src/horovod-0.28.1" >/dev/null || { echo "setup_device: $horovod_patches_problem" >&2; exit 1; }
        nccl=$("$py" -c 'import nvidia.nccl, pathlib; print(pathlib.Path(list(nvidia.nccl.__path__)[0]))')
        [[ -e $nccl/lib/libnccl.so ]] || ln -s libnccl.so.2 "$nccl/lib/libnccl.so"
        cuda=${CUDA_HOME:-/usr/local/cuda}
        mkdir -p "${out:-$src/dist}"
        env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
            HOROVOD_WITH_MPI=1 HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$nccl" HOROVOD_NCCL_LINK=SHARED \
            CUDA_HOME="$cuda" CUDAToolkit_ROOT="$cuda" HOROVOD_CUDA_HOME="$cuda" PATH="$cuda/bin:$PATH" \
            CXXFLAGS="-include cstdint -include string -include stdexcept -include limits -include algorithm" CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j"$(nproc)" "$py" -m pip wheel -q --no-deps --no-build-isolation -w "${out:-$src/dist}" \
            "$src/horovod-0.28.1" >"$src/build.log" 2>&1 || { grep -iE -A3 "error|fatal" "$src/build.log" | grep -v "^ *File " | head -60 || true; exit 1; }
        wheel=$(ls "${out:-$src/dist}"/horovod-0.28.1-*.whl)
        echo "$series_id" >"${out:-$src/dist}/horovod-series-id"
    fi
    "$py" -m pip install -q --no-index --no-deps "$wheel"
fi
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e "$repo" 2>/dev/null \
    || echo "setup_device: hvdtrain not installed editable; run from $repo with PYTHONPATH=$repo"
"$venv/bin/horovodrun" --check-build | sed -n '/Available Frameworks/,$p'
"$py" -c 'import torch, horovod; print("torch", torch.__version__, "cuda", torch.version.cuda, "horovod", horovod.__version__, torch.cuda.get_device_name(0))'
