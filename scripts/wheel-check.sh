#!/usr/bin/env bash
# May a Horovod wheel built earlier be installed instead of compiling? scripts/setup.sh sources this
# file and calls verified_wheel; the tests run it directly:
#
#   bash scripts/wheel-check.sh WHEEL ROOT DEST [HASHES]
#       -> copies WHEEL into the folder DEST, prints the copy's path, exit 0; or one line on stderr
#          saying why not, exit 1
#
# The threat is a wheelhouse that others can write to (a shared folder, a cache made group-writable):
# setup picks a wheel there by its file name alone, and whoever can replace that file runs their
# code in every venv that installs it. A hash stored beside the wheel, in the same folder, would be
# replaced along with it: it detects a damaged copy, not a substituted one. So a wheel is installed
# only when
#   1. HASHES (HVDTRAIN_WHEELHOUSE_SHA256 for HVDTRAIN_WHEELHOUSE: SHA-256 sums separated by commas or
#      spaces) are given and the wheel's sum is one of them. The sums come from the user, not from
#      the folder, so who can write to the folder does not matter (docker/build-local.sh passes the
#      sums of the wheels it mounts into the image build); or
#   2. no HASHES are given and only this user or root can change the wheel: it and every folder from
#      ROOT (the wheelhouse, or setup's own cache) down to it are owned by this user or root and not
#      writable by group or others. A SHA256SUMS that setup wrote beside the wheel when it built it
#      must then match too (a copy cut short or damaged).
# The wheel is copied into DEST (a folder of setup's own, mode 700) before its sum is checked, and
# the copy is what gets installed: the file cannot be swapped between the check and pip.

# Set by verified_wheel: the checked copy to install, or the reason it may not be installed.
checked_wheel=""
wheel_problem=""

# 0 when PATH (a file or folder) can be changed by this user or root alone.
private_to_owner() {
    local owner mode
    read -r owner mode < <(stat -c '%u %a' -- "$1") || return 1
    [[ $owner == "$(id -u)" || $owner == 0 ]] || return 1
    (( (8#$mode & 8#022) == 0 ))
}

verified_wheel() {
    local wheel=$1 root=$2 dest=$3 hashes=${4:-} real_root real_wheel path sum listed
    checked_wheel="" wheel_problem=""
    real_root=$(realpath -e -- "$root") && real_wheel=$(realpath -e -- "$wheel") || {
        wheel_problem="cannot resolve $wheel or $root"; return 1; }
    if [[ $real_wheel != "$real_root"/* ]]; then
        wheel_problem="$wheel leads outside $root (to $real_wheel): remove it"
        return 1
    fi
    if [[ -z $hashes ]]; then
        path=$real_wheel
        while :; do
            if ! private_to_owner "$path"; then
                wheel_problem="$path can be written by others than you and root (owner uid $(stat -c '%u' -- "$path"), mode $(stat -c '%a' -- "$path")), so the Horovod wheel $wheel could have been swapped: run chmod go-w on it, give the wheel's sha256 in HVDTRAIN_WHEELHOUSE_SHA256 (for HVDTRAIN_WHEELHOUSE), or delete the wheel to compile Horovod"
                return 1
            fi
            [[ $path == "$real_root" ]] && break
            path=$(dirname -- "$path")
        done
    fi
    cp -- "$real_wheel" "$dest/" || { wheel_problem="cannot copy $wheel into $dest"; return 1; }
    checked_wheel=$dest/$(basename -- "$real_wheel")
    sum=$(sha256sum -- "$checked_wheel" | cut -d' ' -f1)
    if [[ -n $hashes ]]; then
        for listed in ${hashes//,/ }; do
            [[ ${listed,,} == "$sum" ]] && return 0
        done
        wheel_problem="the Horovod wheel $wheel has sha256 $sum, which HVDTRAIN_WHEELHOUSE_SHA256 does not list: a different or tampered wheel; correct the sums or delete the wheel to compile Horovod"
    else
        listed=$(dirname -- "$real_wheel")/SHA256SUMS
        [[ -f $listed ]] || return 0
        awk -v sum="$sum" -v name="$(basename -- "$real_wheel")" '$1 == sum && $2 == name { found = 1 }
            END { exit !found }' "$listed" && return 0
        wheel_problem="the Horovod wheel $wheel has sha256 $sum, not the one in $listed (written when it was built): a damaged copy; delete its folder to compile Horovod again"
    fi
    rm -f -- "$checked_wheel"
    checked_wheel=""
    return 1
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    (($# >= 3)) || { echo "usage: $0 WHEEL ROOT DEST [HASHES]" >&2; exit 2; }
    if verified_wheel "$@"; then
        echo "$checked_wheel"
    else
        echo "wheel-check: $wheel_problem" >&2
        exit 1
    fi
fi
