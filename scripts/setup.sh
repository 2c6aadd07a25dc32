#!/usr/bin/env bash
# Idempotent installer for hvdtrain: Debian packages, a virtual environment with pinned
# torch/torchvision, and Horovod 0.28.1 built from its sdist with the patches in third_party/horovod/
# (applied in the order of its series file by scripts/horovod-patches.sh; docs/horovod-patch.md).
#
# A second run compares a stamp (hash of this script, the patch series and the pins) and only
# re-checks `horovodrun --check-build`, so it takes seconds.
#
# Environment knobs (all optional):
#   HVDTRAIN_ENGINE=horovod|torch
#                              horovod (default): all of the above. torch: no Horovod at all (no
#                              download, patches, compile or --check-build, no MPI, compilers or
#                              mpi4py), for dist.engine=torch under torchrun, srun or mpirun
#                              (docs/launching.md#two-engines); the check is that torch, torchvision and
#                              hvdtrain's torch engine import. `make setup ENGINE=torch` passes it; a
#                              later run without it adds Horovod to the same venv
#   HVDTRAIN_VENV=DIR          where the virtual environment lives (default: <repo>/.venv; `make setup
#                              VENV=DIR` passes it). A venv outside the checkout is a shared install
#                              (docs/launching.md#a-shared-install): hvdtrain is copied into it, not
#                              linked (pip install ., not -e), every file is readable by all users, the
#                              Slurm scripts go to DIR/share/hvdtrain/slurm, and the Python must be one
#                              that other users can read (scripts/shared-install.sh; setup stops with
#                              one line otherwise)
#   PYTHON=FILE                the Python the venv is made from (default: python3 on the PATH), e.g.
#                              /usr/bin/python3 or a module's: a venv links to it and uses its library
#   HVDTRAIN_EDITABLE=1|0      1: hvdtrain installed editable (pip -e, the checkout's files; the default
#                              for a venv inside the checkout); 0: a copy (the default elsewhere)
#   HVDTRAIN_GPU_OPS=auto|nccl|none
#                              auto (default) builds NCCL ops when a GPU driver (libcuda.so.1), a CUDA
#                              toolkit and NCCL are all found; a toolkit alone is not enough, because
#                              GPU ops on a host without a driver hang hvd.join under Gloo and fail it
#                              under MPI. nccl builds them regardless (images built for GPU hosts)
#   HVDTRAIN_TORCH=cuda|cpu    which build of torch and torchvision (scripts/torch-wheels.sh; `make setup
#                              TORCH=cpu` passes it). cuda (default): the registry's, which runs with or
#                              without a GPU and brings about 3.5 GB of CUDA libraries and triton. cpu:
#                              PyTorch's CPU-only wheels (HVDTRAIN_TORCH_INDEX=URL, default
#                              https://download.pytorch.org/whl/cpu, or a mirror of it), for sites whose
#                              nodes have no GPU. Asking a venv for the other build replaces the one
#                              it has (torch, torchvision, triton, nvidia-*)
#   HVDTRAIN_SYSTEM_TORCH=1    reuse a torch already installed in the base Python (GPU images that
#                              ship their own torch); the venv then sees system site-packages
#   HVDTRAIN_KEEP_PIP_CONFIG=1 keep this machine's pip configuration (default: ignore it, so that the
#                              registry's CUDA build of torch is installed, not a local CPU-only wheel)
#   HVDTRAIN_SKIP_APT=1        never call apt-get (the packages must already be there)
#   HOROVOD_SDIST=FILE         a local horovod-0.28.1.tar.gz (machines without a registry); it must be a
#                              file only you or root can write, and what is checked and unpacked is a copy
#                              (scripts/sdist-check.sh)
#   HVDTRAIN_CACHE=DIR         setup's cache, where the sdist is kept and Horovod is built (default
#                              <repo>/.cache/setup); setup stops with one line when others can write it
#   HVDTRAIN_WHEELHOUSE=DIR    the wheels directory of an earlier setup (its .cache/setup/wheels): a
#                              Horovod wheel there built from the same sdist, patches, torch, Python, OS
#                              and GPU ops is installed instead of compiling again (setup keeps every
#                              wheel it builds under .cache/setup/wheels; make test-image hands the
#                              host's to the image build this way). Only a wheel that nobody else can
#                              have swapped: see HVDTRAIN_WHEELHOUSE_SHA256
#   HVDTRAIN_WHEELHOUSE_SHA256=SUM[,SUM...]
#                              the SHA-256 sums a wheel from HVDTRAIN_WHEELHOUSE may have; without them,
#                              the wheel and the folders from DIR down to it must be writable by you
#                              (or root) alone. Setup stops with one line otherwise. The same rule,
#                              without sums, holds for the wheels in setup's own cache, which must also
#                              match the SHA256SUMS written when they were built (scripts/wheel-check.sh
#                              says why a sum beside the wheel alone would not do)
#   EXTRAS=a,b                 optional integrations to install too (pyproject.toml's
#                              optional-dependencies, pinned), e.g. EXTRAS=ray,mlflow; `make setup
#                              EXTRAS=...` passes it through
#   HVDTRAIN_EXTRA_CA=FILE     a PEM bundle that apt and pip trust besides their own (a TLS-intercepting
#                              proxy's CA); ignored when FILE does not exist (docker/Dockerfile passes
#                              its optional build secret this way)
#   HVDTRAIN_NO_COMPILE=1      install Horovod from a wheel only (HVDTRAIN_WHEELHOUSE or setup's cache):
#                              no compilers, headers or CUDA toolkit are installed or needed, and setup
#                              stops with one line when no wheel matches (the image's runtime stage, which
#                              takes the wheel its builder stage made)
#   HVDTRAIN_WHEEL_OUT=DIR     leave a copy of the Horovod wheel setup installed (built or reused) in
#                              DIR/<key>/ with its SHA256SUMS, a wheelhouse for HVDTRAIN_WHEELHOUSE (the
#                              image's builder stage hands it to the runtime stage this way)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVDTRAIN_VENV:-$repo/.venv}
[[ $venv = /* ]] || venv=$PWD/$venv
python=${PYTHON:-python3}
gpu_ops=${HVDTRAIN_GPU_OPS:-auto}
engine=${HVDTRAIN_ENGINE:-horovod}
horovod_version=0.28.1
horovod_sha256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
cache=${HVDTRAIN_CACHE:-$repo/.cache/setup}
jobs=$(nproc 2>/dev/null || echo 2)

# Pins. torch/torchvision: the registry's CUDA build (it runs on machines without a GPU too), or with
# HVDTRAIN_TORCH=cpu PyTorch's CPU-only build of the same versions (scripts/torch-wheels.sh).
torch_pins=(torch==2.13.0 torchvision==0.28.0)
torch_build_wanted=${HVDTRAIN_TORCH:-cuda}
# pyproject.toml pins the same versions (tests/unit/test_supply_chain.py keeps the two in step).
python_pins=(mpi4py==4.1.2 tensorboardX==2.6.5 pyyaml==6.0.3 tqdm==4.70.1 numpy==2.4.6 pillow==13.0.0 simplejpeg==1.9.0
             matplotlib==3.11.2 pytest==9.2.0 cloudpickle==3.1.3 psutil==7.2.2 packaging==26.4 cffi==2.1.1
             setuptools==84.2.1 wheel==0.48.0)

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

case $engine in
    horovod) ;;
    torch)
        [[ -z ${HVDTRAIN_WHEEL_OUT:-}${HVDTRAIN_NO_COMPILE:-} ]] ||
            die "HVDTRAIN_WHEEL_OUT and HVDTRAIN_NO_COMPILE are about Horovod's wheel, which HVDTRAIN_ENGINE=torch does not install"
        # mpi4py compiles against an MPI; the torch engine uses none of it (its extra: EXTRAS=mpi)
        pins=()
        for pin in "${python_pins[@]}"; do [[ $pin == mpi4py==* ]] || pins+=("$pin"); done
        python_pins=("${pins[@]}") ;;
    *) die "HVDTRAIN_ENGINE must be horovod or torch, not '$engine'" ;;
esac
# torch_pip_args, torch_build, torch_build_packages: which build of torch to install
source "$repo/scripts/torch-wheels.sh"
torch_pip_args "$torch_build_wanted" "${torch_pins[@]}" || die "$torch_problem"
[[ -z ${HVDTRAIN_SYSTEM_TORCH:-} || -z ${HVDTRAIN_TORCH:-} ]] ||
    die "HVDTRAIN_SYSTEM_TORCH keeps the base Python's torch, and HVDTRAIN_TORCH=$HVDTRAIN_TORCH asks for another: set one of them"
[[ $torch_build_wanted != cpu || $gpu_ops != nccl ]] ||
    die "HVDTRAIN_GPU_OPS=nccl needs torch's CUDA build, and HVDTRAIN_TORCH=cpu asks for the CPU-only one: set one of them"

# load_horovod_series, horovod_series_id, apply_horovod_series: the patches to Horovod
source "$repo/scripts/horovod-patches.sh"
load_horovod_series || die "$horovod_patches_problem"

stamp_file=$venv/.hvdtrain-setup.stamp
extras=${EXTRAS:-}
stamp=$(cat "$0" "$repo/scripts/wheel-check.sh" "$repo/scripts/sdist-check.sh" "$repo/scripts/owner-check.sh" "$repo/scripts/shared-install.sh" \
            "$repo/scripts/horovod-patches.sh" "$repo/scripts/torch-wheels.sh" "$horovod_patches/series" "${horovod_patch_files[@]}" \
            "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1)-$gpu_ops-${HVDTRAIN_SYSTEM_TORCH:-0}-$extras-$engine-$torch_build_wanted
# verified_wheel: may a wheel built earlier be installed (a wheelhouse others can write to is refused)
source "$repo/scripts/wheel-check.sh"
# private_cache, checked_sdist: the cache setup builds in, and the sdist it builds, checked and copied
source "$repo/scripts/sdist-check.sh"
# python_problem, install_hvdtrain, hvdtrain_sources_hash: a shared install
source "$repo/scripts/shared-install.sh"

# A venv inside the checkout is a developer's: hvdtrain editable. One elsewhere (make setup
# VENV=/opt/hvdtrain) is a shared install: a copy, readable by everyone, from a Python they can read.
case ${HVDTRAIN_EDITABLE:-} in
    1) install_mode=editable ;;
    0) install_mode=copy ;;
    "") if [[ $venv == "$repo"/* ]]; then install_mode=editable; else install_mode=copy; fi ;;
    *) die "HVDTRAIN_EDITABLE must be 1 or 0, not '$HVDTRAIN_EDITABLE'" ;;
esac
if [[ $install_mode == copy ]]; then
    umask 022  # files others can read, whatever the installing user's umask
    # A copy is refreshed when the checkout's files change (make setup after git pull).
    stamp=$stamp-copy-$(hvdtrain_sources_hash)
    venv_python=$python
    [[ -x $venv/bin/python ]] && venv_python=$venv/bin/python
    problem=$(python_problem "$venv_python")
    [[ -z $problem ]] || die "$problem"
fi

# Extra CA certificates: one temporary bundle (the system's, if any, plus FILE; pip's own certifi
# bundle is added once the venv exists), removed on exit so that an image layer never keeps it.
ca_bundle=""
apt_ca=()
if [[ -n ${HVDTRAIN_EXTRA_CA:-} ]]; then
    if [[ -s $HVDTRAIN_EXTRA_CA ]]; then
        ca_bundle=$(mktemp)
        trap 'rm -f "$ca_bundle"' EXIT
        cat /etc/ssl/certs/ca-certificates.crt "$HVDTRAIN_EXTRA_CA" >"$ca_bundle" 2>/dev/null || cat "$HVDTRAIN_EXTRA_CA" >"$ca_bundle"
        apt_ca=(-o "Acquire::https::CAInfo=$ca_bundle")
        log "trusting the extra CA certificates in $HVDTRAIN_EXTRA_CA"
    else
        log "no extra CA bundle at $HVDTRAIN_EXTRA_CA: using the default trust stores"
    fi
fi

apt_install() {
    local missing=() pkg sudo=""
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    if [[ -n ${HVDTRAIN_SKIP_APT:-} ]]; then
        die "missing Debian packages: ${missing[*]} (HVDTRAIN_SKIP_APT is set; install them first)"
    fi
    [[ $(id -u) -eq 0 ]] || sudo="sudo"
    log "installing Debian packages: ${missing[*]}"
    $sudo apt-get "${apt_ca[@]}" update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get "${apt_ca[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# A GPU driver is there when the kernel module answers or the dynamic loader knows libcuda.so.1
# (containers get the library mounted by the NVIDIA runtime; /proc/driver/nvidia may be hidden).
gpu_driver_present() {
    [[ -e /proc/driver/nvidia/version ]] && return 0
    ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 ' && return 0
    return 1
}

# The torch engine's install check: what a dist.engine=torch rank imports first.
check_torch() {
    "$venv/bin/python" -c 'import torch, torchvision, hvdtrain.comm.torch_engine; print(f"torch {torch.__version__}, torchvision {torchvision.__version__}")' 2>&1
}

check_build() {
    local out
    [[ $engine == horovod ]] || { check_torch; return; }
    out=$("$venv/bin/horovodrun" --check-build 2>&1) || { echo "$out"; return 1; }
    for needed in PyTorch MPI Gloo; do
        grep -q "\[X\] $needed" <<<"$out" || { echo "$out"; echo "missing: $needed"; return 1; }
    done
    echo "$out"
}

if [[ -f $stamp_file && $(cat "$stamp_file") == "$stamp" ]] && ready=$(check_build 2>&1); then
    if [[ $engine == torch ]]; then
        log "already set up ($venv) for the torch engine; $ready"
    else
        log "already set up ($venv); horovodrun --check-build shows PyTorch, MPI and Gloo"
    fi
    exit 0
fi

# --- Debian packages --------------------------------------------------------------------------
# Run time: what a built venv needs to train and to be reached over ssh; with HVDTRAIN_NO_COMPILE
# that and the venv module are all (the image's runtime stage has no compilers).
runtime_packages=(openmpi-bin openssh-client openssh-server procps iproute2 python3)
no_compile=${HVDTRAIN_NO_COMPILE:-}
wheel_out=${HVDTRAIN_WHEEL_OUT:-}
if [[ $engine == torch ]]; then
    apt_install procps iproute2 python3 python3-venv
elif [[ -n $no_compile ]]; then
    apt_install "${runtime_packages[@]}" python3-venv
else
    apt_install "${runtime_packages[@]}" libopenmpi-dev cmake g++ make patch python3-venv python3-dev
fi
[[ $engine == torch ]] || command -v mpirun >/dev/null || die "mpirun not found after installing openmpi-bin"

# --- virtual environment ---------------------------------------------------------------------
if [[ ! -x $venv/bin/python ]]; then
    log "creating virtual environment $venv"
    venv_args=()
    [[ -n ${HVDTRAIN_SYSTEM_TORCH:-} ]] && venv_args+=(--system-site-packages)
    "$python" -m venv "${venv_args[@]}" "$venv"
fi
vpy=$venv/bin/python
if [[ -z ${HVDTRAIN_KEEP_PIP_CONFIG:-} ]]; then
    export PIP_CONFIG_FILE=/dev/null
    unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ -n $ca_bundle ]]; then
    "$vpy" -c 'import pip._vendor.certifi as c; print(open(c.where()).read())' >>"$ca_bundle"
    export PIP_CERT=$ca_bundle
fi
pip_install() { "$vpy" -m pip install -q "$@"; }

if [[ -n ${HVDTRAIN_SYSTEM_TORCH:-} ]]; then
    "$vpy" -c 'import torch, torchvision' 2>/dev/null || die "HVDTRAIN_SYSTEM_TORCH is set but torch/torchvision do not import"
    pip_install "${python_pins[@]}"
else
    # The build this venv was set up with (a venv from before the choice: the registry's, cuda).
    build_marker=$venv/.hvdtrain-torch-build
    previous_build=$(cat "$build_marker" 2>/dev/null || echo cuda)
    if [[ $previous_build != "$torch_build_wanted" && -n $(torch_build "$vpy") ]]; then
        mapfile -t replaced < <("$vpy" -m pip list --format=freeze 2>/dev/null | torch_build_packages)
        log "replacing torch's $previous_build build with its $torch_build_wanted build: uninstalling ${replaced[*]}"
        ((${#replaced[@]} == 0)) || "$vpy" -m pip uninstall -q -y "${replaced[@]}"
    fi
    from=""
    [[ $torch_build_wanted != cpu ]] || from=" from $torch_cpu_index"
    log "installing ${torch_pins[*]} (its $torch_build_wanted build$from) and Python packages"
    pip_install "${torch_args[@]}"  # alone: PyTorch's index serves torch, not the other pins
    pip_install "${python_pins[@]}"
    installed_build=$(torch_build "$vpy")
    [[ $torch_build_wanted != cpu || $installed_build == cpu ]] ||
        die "asked for torch's CPU-only build, but $venv has its ${installed_build:-missing} build (pip install ${torch_args[*]})"
    echo "$torch_build_wanted" >"$build_marker"
fi
[[ -z $extras ]] || log "installing extras: $extras"
install_hvdtrain "$vpy" "$install_mode" "$extras"

if [[ $engine == torch ]]; then
    out=$(check_torch) || { echo "$out" >&2; die "torch, torchvision or hvdtrain's torch engine does not import in $venv"; }
    echo "$stamp" >"$stamp_file"
    log "done: $venv for the torch engine ($out; no Horovod): launch with torchrun and dist.engine=torch"
    exit 0
fi

# --- Horovod -----------------------------------------------------------------------------------
installed_horovod=$("$vpy" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true)
# The venv records the patch series its Horovod was built with: a changed, added or removed patch
# means a rebuild, even though the version and --check-build still look right.
patch_id=$(horovod_series_id)
patch_marker=$venv/horovod-patch
if [[ $installed_horovod != "$horovod_version" || $(cat "$patch_marker" 2>/dev/null) != "$patch_id" ]] ||
        ! check_build >/dev/null 2>&1; then
    build_env=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
               HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS=-j$jobs)
    # NCCL ops need the CUDA toolkit headers and NCCL; torch's CUDA wheels bring NCCL along.
    cuda_home=${CUDA_HOME:-}
    [[ -z $cuda_home && -x /usr/local/cuda/bin/nvcc ]] && cuda_home=/usr/local/cuda
    torch_cuda=$("$vpy" -c 'import torch; print(torch.version.cuda or "")')
    nccl_home=${HOROVOD_NCCL_HOME:-}
    if [[ -z $nccl_home ]]; then
        nccl_home=$("$vpy" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia.nccl")
if spec and spec.submodule_search_locations:
    print(pathlib.Path(list(spec.submodule_search_locations)[0]))
EOF
)
    fi
    want_nccl=0
    case $gpu_ops in
        nccl) want_nccl=1 ;;
        auto)
            if [[ -n $cuda_home && -n $torch_cuda && -n $nccl_home ]]; then
                if gpu_driver_present; then
                    want_nccl=1
                else
                    log "a CUDA toolkit but no GPU driver (libcuda.so.1): building CPU ops (HVDTRAIN_GPU_OPS=nccl forces NCCL ops)"
                fi
            fi ;;
        none) ;;
        *) die "HVDTRAIN_GPU_OPS must be auto, nccl or none, not '$gpu_ops'" ;;
    esac
    if ((want_nccl)); then
        [[ -n $no_compile || ( -n $cuda_home && -n $nccl_home ) ]] ||
            die "HVDTRAIN_GPU_OPS=nccl needs CUDA_HOME and NCCL (HOROVOD_NCCL_HOME)"
        # The wheel ships only libnccl.so.2; CMake's FindNCCL looks for libnccl.so.
        [[ -z $nccl_home || -e $nccl_home/lib/libnccl.so || ! -e $nccl_home/lib/libnccl.so.2 ]] || ln -s libnccl.so.2 "$nccl_home/lib/libnccl.so"
        build_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME=$nccl_home HOROVOD_NCCL_LINK=SHARED
                    CUDA_HOME=$cuda_home CUDAToolkit_ROOT=$cuda_home HOROVOD_CUDA_HOME=$cuda_home
                    PATH=$cuda_home/bin:$PATH)
        ops="NCCL ops (CUDA $torch_cuda, $cuda_home, NCCL $nccl_home)"
        ops_id=nccl-cuda$torch_cuda
    else
        # Keep CMake from picking up a stray toolkit: a CPU build must not need one. With nvcc on the
        # PATH, PyTorch's CUDA_HOME would still make the torch extension ask for it
        # (third_party/horovod/0005-cpu-build-where-nvcc-is-on-the-path.patch).
        build_env+=(HOROVOD_WITHOUT_GLOO_CUDA=1 HOROVOD_GPU_OPERATIONS= CUDAToolkit_ROOT=/nonexistent
                    HOROVOD_TORCH_WITHOUT_CUDA=1)
        ops="CPU (Gloo + MPI; no CUDA toolkit/NCCL, or HVDTRAIN_GPU_OPS=none)"
        ops_id=cpu
    fi

    # The wheel is kept under a name that says what it was built from (sdist, patches, torch, Python,
    # machine, OS, GPU ops), so that another setup with the same inputs (the image's builder stage,
    # a second venv) installs it instead of compiling Horovod again.
    wheel_key=horovod-$horovod_version-$patch_id-$("$vpy" -c \
        'import platform, sys, torch; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}-{platform.machine()}")')
    wheel_key=$wheel_key-$(. /etc/os-release 2>/dev/null && echo "${ID:-linux}${VERSION_ID:-}")-$ops_id
    wheel_dir=$cache/wheels/$wheel_key
    wheel=""
    # A wheel found there is checked (scripts/wheel-check.sh) and its checked copy installed; one
    # that might have been swapped stops setup rather than being compiled over in a shared folder.
    checked_dir=$(mktemp -d)
    for root in ${HVDTRAIN_WHEELHOUSE:+"$HVDTRAIN_WHEELHOUSE"} "$cache/wheels"; do
        hashes=""
        [[ $root == "${HVDTRAIN_WHEELHOUSE:-}" ]] && hashes=${HVDTRAIN_WHEELHOUSE_SHA256:-}
        for candidate in "$root/$wheel_key"/horovod-"$horovod_version"-*.whl; do
            [[ -f $candidate ]] || continue
            verified_wheel "$candidate" "$root" "$checked_dir" "$hashes" || { rm -rf "$checked_dir"; die "$wheel_problem"; }
            wheel=$checked_wheel
            log "installing horovod $horovod_version built earlier for $ops: $candidate"
            break 2
        done
    done
    install_wheel() { "$vpy" -m pip uninstall -q -y horovod 2>/dev/null || true; pip_install --no-deps "$1"; }
    if [[ -n $wheel ]]; then
        install_wheel "$wheel"
        if ! check_build >/dev/null 2>&1; then
            [[ -z $no_compile ]] || die "the Horovod wheel $candidate does not pass horovodrun --check-build here (HVDTRAIN_NO_COMPILE is set: unset it to compile Horovod)"
            log "that wheel does not pass horovodrun --check-build here: compiling instead"
            wheel=""
        fi
    fi
    if [[ -z $wheel && -n $no_compile ]]; then
        rm -rf "$checked_dir"
        die "no Horovod wheel for $wheel_key in ${HVDTRAIN_WHEELHOUSE:-(no HVDTRAIN_WHEELHOUSE)} or $cache/wheels, and HVDTRAIN_NO_COMPILE is set: build one with plain setup (HVDTRAIN_WHEEL_OUT=DIR keeps it), or unset HVDTRAIN_NO_COMPILE"
    fi
    if [[ -z $wheel ]]; then
        # The cache (made if missing) must be one nobody else can write; the sdist is copied once into
        # $checked_dir (mode 700), and that copy is checked and unpacked (scripts/sdist-check.sh).
        private_cache "$cache" || { rm -rf "$checked_dir"; die "$sdist_problem"; }
        sdist=${HOROVOD_SDIST:-$cache/horovod-$horovod_version.tar.gz}
        if [[ ! -f $sdist ]]; then
            log "downloading the horovod $horovod_version sdist"
            "$vpy" -m pip download -q --no-deps --no-binary :all: "horovod==$horovod_version" -d "$cache"
        fi
        checked_sdist "$sdist" "$horovod_sha256" "$checked_dir" || { rm -rf "$checked_dir"; die "$sdist_problem"; }
        src=$cache/src
        rm -rf "$src" && mkdir -p "$src"
        tar -xzf "$checked_sdist" -C "$src"
        src=$src/horovod-$horovod_version
        log "applying the ${#horovod_patch_files[@]} patches of third_party/horovod/series"
        apply_horovod_series "$src" >/dev/null || die "$horovod_patches_problem"
        log "building horovod $horovod_version for $ops"
        # Built into a side directory and moved into place once complete: an interrupted build
        # never leaves a wheel that a later run would take for a finished one.
        rm -rf "$wheel_dir.partial" && mkdir -p "$wheel_dir.partial"
        env "${build_env[@]}" "$vpy" -m pip wheel -q --no-build-isolation --no-deps --no-cache-dir -w "$wheel_dir.partial" "$src" \
            >"$cache/horovod-build.log" 2>&1 || { tail -40 "$cache/horovod-build.log"; die "horovod build failed (full log: $cache/horovod-build.log)"; }
        # The record verified_wheel checks a wheel of this cache against (a damaged copy).
        (cd "$wheel_dir.partial" && sha256sum horovod-"$horovod_version"-*.whl >SHA256SUMS)
        rm -rf "$src" "$wheel_dir" && mv "$wheel_dir.partial" "$wheel_dir"
        wheel=$(ls "$wheel_dir"/horovod-"$horovod_version"-*.whl)
        install_wheel "$wheel"
    fi
    if [[ -n $wheel_out ]]; then
        mkdir -p "$wheel_out/$wheel_key"
        cp -- "$wheel" "$wheel_out/$wheel_key/"
        (cd "$wheel_out/$wheel_key" && sha256sum -- "$(basename -- "$wheel")" >SHA256SUMS)
        log "kept the Horovod wheel in $wheel_out/$wheel_key"
    fi
    rm -rf "$checked_dir"
elif [[ -n $wheel_out ]]; then
    die "HVDTRAIN_WHEEL_OUT is set but Horovod was already installed in $venv: use a new HVDTRAIN_VENV"
fi

if ! out=$(check_build); then
    echo "$out" >&2
    die "horovodrun --check-build does not show PyTorch, MPI and Gloo"
fi
echo "$out" | sed 's/^/[setup]   /'
echo "$patch_id" >"$patch_marker"
echo "$stamp" >"$stamp_file"
log "done: $venv"
if [[ $install_mode == copy ]]; then
    log "shared install: any user runs $venv/bin/python -P -m hvdtrain (or $venv/bin/hvdtrain, $venv/bin/horovodrun); Slurm: sbatch $venv/share/hvdtrain/slurm/train.sbatch from their own folder"
fi
