# Sourced by scripts/setup.sh: which build of torch and torchvision to install (HVDTRAIN_TORCH,
# `make setup TORCH=...`).
#
#   cuda (the default)  the registry's torch and torchvision, built with CUDA: they run on GPU nodes
#                       and on nodes without a GPU alike, and bring NVIDIA's CUDA libraries
#                       (nvidia-* packages, about 2.8 GB installed) and triton (about 0.7 GB).
#   cpu                 PyTorch's CPU-only build of the same versions, from PyTorch's own index
#                       (HVDTRAIN_TORCH_INDEX, default https://download.pytorch.org/whl/cpu; a site's
#                       mirror of it works too): no CUDA libraries and no triton. For sites whose nodes
#                       have no GPU; such an install cannot use one.
#
# A venv set up with one build and then asked for the other has torch, torchvision, triton and the
# nvidia-* packages uninstalled first: pip would take the installed build for the pinned version.

torch_cpu_index=${HVDTRAIN_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

# torch_pip_args BUILD PIN...: sets torch_args, pip install's arguments for the pinned torch and
# torchvision of BUILD (cuda or cpu); returns 1 with torch_problem (one line) for any other BUILD.
torch_pip_args() {
    local build=$1
    shift
    case $build in
        cuda) torch_args=("$@") ;;
        cpu) torch_args=(--index-url "$torch_cpu_index" "$@") ;;
        *)
            torch_problem="HVDTRAIN_TORCH must be cuda (the default: runs with or without a GPU) or cpu (no CUDA libraries, for nodes without a GPU), not '$build'"
            return 1 ;;
    esac
}

# torch_build PYTHON: the build of the torch PYTHON imports (cuda, rocm or cpu), or nothing when it
# has none.
torch_build() {
    "$1" -c 'import torch; print("cuda" if torch.version.cuda else "rocm" if getattr(torch.version, "hip", None) else "cpu")' \
        2>/dev/null || true
}

# What to uninstall before changing the build, from `pip list --format=freeze` on stdin: torch,
# torchvision, triton and NVIDIA's CUDA libraries (nvidia-*), one name a line.
torch_build_packages() {
    sed -n -E 's/^(torch|torchvision|triton|pytorch-triton[A-Za-z0-9_.-]*|nvidia-[A-Za-z0-9_.-]+)(==| @ ).*/\1/p'
}
