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
#   2. no HASHES are given and only this user or root can change the wheel: it and every folder from it
#      up to / are owned by this user or root and not writable by group or others (a folder with the
#      sticky bit, such as /tmp, may be: nobody can rename or replace what is not theirs in it). A
#      folder above ROOT counts as much as ROOT itself: whoever owns one can swap everything below.
#      A SHA256SUMS that setup wrote beside the wheel when it built it must then match too (a copy cut
#      short or damaged).
# The wheel is opened once; its owner and mode are checked on that open file, the folders after it,
# then the name must still lead to the file that was opened, and the copy is made from that same
# descriptor into DEST (a folder of setup's own, mode 700). The copy is what is hashed and installed:
# nothing can be swapped between the check and pip.

# Set by verified_wheel: the checked copy to install, or the reason it may not be installed.
checked_wheel=""
wheel_problem=""

# private_to_owner, owned_chain: who may change the wheel, and every folder above it
source "$(dirname -- "${BASH_SOURCE[0]}")/owner-check.sh"

# The reason PATH ($2: what stat reads, default PATH itself) may not vouch for the wheel $3.
unsafe_reason() {
    local shown=$1 probe=${2:-$1}
    echo "$shown can be written by others than you and root (owner uid $(stat -L -c '%u' -- "$probe"), mode $(stat -L -c '%a' -- "$probe")), so the Horovod wheel $3 could have been swapped: run chmod go-w on it, give the wheel's sha256 in HVDTRAIN_WHEELHOUSE_SHA256 (for HVDTRAIN_WHEELHOUSE), or delete the wheel to compile Horovod"
}

verified_wheel() {
    local wheel=$1 root=$2 dest=$3 hashes=${4:-} real_root real_wheel sum listed fd
    checked_wheel="" wheel_problem=""
    real_root=$(realpath -e -- "$root") && real_wheel=$(realpath -e -- "$wheel") || {
        wheel_problem="cannot resolve $wheel or $root"; return 1; }
    if [[ $real_wheel != "$real_root"/* ]]; then
        wheel_problem="$wheel leads outside $root (to $real_wheel): remove it"
        return 1
    fi
    exec {fd}<"$real_wheel" || { wheel_problem="cannot open $wheel"; return 1; }
    if [[ -z $hashes ]]; then
        if ! private_to_owner "/dev/fd/$fd"; then
            wheel_problem=$(unsafe_reason "$real_wheel" "/dev/fd/$fd" "$wheel")
        elif ! owned_chain private_to_owner "$real_wheel"; then
            wheel_problem=$(unsafe_reason "$owned_chain_failed" "$owned_chain_failed" "$wheel")
        fi
        if [[ -z $wheel_problem && $(stat -L -c '%d:%i' -- "$real_wheel") != $(stat -L -c '%d:%i' "/dev/fd/$fd") ]]; then
            wheel_problem="$wheel was replaced while it was checked: run setup again"
        fi
        if [[ -n $wheel_problem ]]; then
            exec {fd}<&-
            return 1
        fi
    fi
    checked_wheel=$dest/$(basename -- "$real_wheel")
    if ! cat <&"$fd" >"$checked_wheel"; then
        exec {fd}<&-
        rm -f -- "$checked_wheel"
        checked_wheel="" wheel_problem="cannot copy $wheel into $dest"
        return 1
    fi
    exec {fd}<&-
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
