#!/usr/bin/env bash
# Test-only Debian packages, installed by `make test` before pytest (idempotent; a second run only
# asks dpkg and takes well under a second):
#   slurm-wlm, munge    a one-machine Slurm cluster that tests the sbatch/srun scripts for real
#                       (tests/multinode/test_slurm.py)
#   openssh-server      the two "machines" node0/node1 (tests/multinode/conftest.py); setup.sh
#                       installs it too, it is repeated here so the tests never depend on that
#   iproute2, util-linux  node0/node1 in network namespaces over a tbf-limited veth link (ip, tc;
#                       unshare, nsenter, taskset: tests/multinode/netns.py)
#
#   podman, debootstrap only with the argument `image` (make test-image): build the docker image
#                       without Docker or a registry (docker/build-local.sh) and run it via chroot
#
#   .[test] extra       the Python packages only the tests need (pyproject.toml: pytest, ruff and
#                       the pinned optional integrations the tests exercise for real), into $VENV
#
# HVDTRAIN_SKIP_APT=1 never calls apt-get: the tests that need a missing package skip and say why.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$repo/.venv}
[[ $venv = /* ]] || venv=$repo/$venv
# Python test requirements: reinstalled only when pyproject.toml changed since the last time.
stamp_file=$venv/.hvdtrain-test-deps.stamp
stamp=$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)
if [[ ! -f $stamp_file || $(cat "$stamp_file") != "$stamp" ]]; then
    echo "[test-deps] installing the .[test] extra"
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$venv/bin/python" -m pip install -q --no-build-isolation -e "$repo[test]"
    echo "$stamp" >"$stamp_file"
fi

packages=(slurm-wlm munge openssh-server openssh-client iproute2 util-linux)
[[ ${1:-} != image ]] || packages=(podman debootstrap)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
((${#missing[@]})) || exit 0
if [[ -n ${HVDTRAIN_SKIP_APT:-} ]]; then
    echo "[test-deps] not installing ${missing[*]} (HVDTRAIN_SKIP_APT is set): those tests will skip"
    exit 0
fi
sudo=""
if [[ $(id -u) -ne 0 ]]; then
    if ! sudo -n true 2>/dev/null; then
        echo "[test-deps] not root and no passwordless sudo: not installing ${missing[*]}; those tests will skip"
        exit 0
    fi
    sudo="sudo -n"
fi
echo "[test-deps] installing ${missing[*]}"
$sudo apt-get update -qq
# The packages' own services must not start: the tests start slurmctld, slurmd and munged themselves
# with their own configuration. policy-rc.d (exit 101) is the Debian way to say so during install.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    created_policy=1
fi
trap '((created_policy)) && $sudo rm -f "$policy"' EXIT
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "[test-deps] done"
