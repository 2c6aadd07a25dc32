#!/usr/bin/env bash
# The Horovod sdist setup compiles, and the cache folder it compiles in. scripts/setup.sh sources this
# file and calls private_cache and checked_sdist; the tests run it directly:
#
#   bash scripts/sdist-check.sh cache CACHE
#       -> exit 0 when CACHE may be used; or one line on stderr saying why not, exit 1
#   bash scripts/sdist-check.sh sdist SDIST SHA256 DEST
#       -> copies SDIST into the folder DEST, prints the copy's path, exit 0 when the copy's SHA-256 is
#          SHA256; or one line on stderr saying why not (and no copy left), exit 1
#
# The threat is a file or folder that another user can write: the sdist's setup.py and CMake files
# run as the user who installs (often an administrator, for a shared install). A sum checked on the
# sdist's name and a tar run on that name again leave a moment in which the file can be replaced.
# So the sdist is opened once and copied from that open file into DEST (a folder of setup's own,
# mktemp -d, mode 700); the copy is hashed and the copy is unpacked. What could be swapped is never
# read twice. Setup also unpacks, builds and keeps wheels in the cache (HVDTRAIN_CACHE, default
# <repo>/.cache/setup), so a cache another user can write, or swap, is refused; so is an sdist
# (HOROVOD_SDIST) that another user can write, though its copy is checked anyway.

# private_to_owner, owned_chain: may only this user or root change a file, and the folders above it
source "$(dirname -- "${BASH_SOURCE[0]}")/owner-check.sh"

# Set by private_cache and checked_sdist: the reason the cache or the sdist may not be used; the
# checked copy of the sdist.
sdist_problem=""
checked_sdist=""

# private_to_owner, or writable by a group that is the owner's user private group too (Debian's and Red
# Hat's convention: a group named after the user with no other member, whose users work with umask 002).
owner_only() {
    local owner group mode name members
    private_to_owner "$@" && return 0
    read -r owner group mode < <(stat -L -c '%u %g %a' -- "$1") || return 1
    [[ $owner == "$(id -u)" || $owner == 0 ]] && (( (8#$mode & 8#002) == 0 )) || return 1
    IFS=: read -r name _ _ members < <(getent group "$group") || return 1
    [[ $name == "$(id -un -- "$owner" 2>/dev/null)" && ( -z $members || $members == "$name" ) ]]
}

# Who owns PATH and its mode, for a line.
owner_and_mode() {
    stat -L -c 'owner uid %u, mode %a' -- "$1"
}

# 0 when the folder CACHE (made if missing) is this user's or root's, nobody else can write it (owner_only),
# every folder above it is as much (or sticky, as /tmp is), and no link on the way is another user's.
private_cache() {
    local cache=$1 path="" part parts real owner
    sdist_problem=""
    [[ $cache == /* ]] || cache=$PWD/$cache
    # Links on the way, as the kernel's protected_symlinks would: only the user's and root's.
    IFS=/ read -ra parts <<<"${cache#/}"
    for part in "${parts[@]}"; do
        [[ -n $part ]] || continue
        path=$path/$part
        [[ -L $path ]] || continue
        owner=$(stat -c '%u' -- "$path")
        if [[ $owner != "$(id -u)" && $owner != 0 ]]; then
            sdist_problem="the setup cache $cache is not safe to build in: $path is a link that uid $owner owns; set HVDTRAIN_CACHE to a folder of yours"
            return 1
        fi
    done
    mkdir -p -- "$cache" || { sdist_problem="cannot create the setup cache $cache: set HVDTRAIN_CACHE to a folder of yours"; return 1; }
    real=$(realpath -e -- "$cache") || { sdist_problem="cannot resolve the setup cache $cache"; return 1; }
    if ! owner_only "$real"; then
        sdist_problem="the setup cache $cache can be written by others than you and root ($(owner_and_mode "$real")), so the Horovod it builds could be swapped: run chmod go-w '$real', or set HVDTRAIN_CACHE to a folder of yours"
        return 1
    fi
    if ! owned_chain owner_only "$real"; then
        sdist_problem="the folder $owned_chain_failed above the setup cache $cache can be changed by others than you and root ($(owner_and_mode "$owned_chain_failed"), no sticky bit), so the Horovod it builds could be swapped: set HVDTRAIN_CACHE to a folder of yours"
        return 1
    fi
}

# 0 when SDIST, copied into the folder DEST, has the SHA-256 sum SHA256: checked_sdist is the copy.
checked_sdist() {
    local sdist=$1 sum=$2 dest=$3 fd got
    sdist_problem="" checked_sdist=""
    exec {fd}<"$sdist" || { sdist_problem="cannot open the Horovod sdist $sdist"; return 1; }
    if [[ ! -f /dev/fd/$fd ]] || ! owner_only "/dev/fd/$fd"; then
        sdist_problem="the Horovod sdist $sdist can be written by others than you and root ($(owner_and_mode "/dev/fd/$fd")) or is not a file: copy it into a folder of yours and set HOROVOD_SDIST to the copy, or unset HOROVOD_SDIST to download it"
        exec {fd}<&-
        return 1
    fi
    checked_sdist=$dest/$(basename -- "$sdist")
    if ! cat <&"$fd" >"$checked_sdist"; then
        exec {fd}<&-
        rm -f -- "$checked_sdist"
        checked_sdist="" sdist_problem="cannot copy $sdist into $dest"
        return 1
    fi
    exec {fd}<&-
    got=$(sha256sum -- "$checked_sdist" | cut -d' ' -f1)
    [[ $got == "${sum,,}" ]] && return 0
    sdist_problem="checksum mismatch for $sdist: sha256 $got, not the $sum this setup pins; delete it (setup downloads it again) or set HOROVOD_SDIST to the real horovod sdist"
    rm -f -- "$checked_sdist"
    checked_sdist=""
    return 1
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    case ${1:-} in
        cache) (($# == 2)) && { private_cache "$2" || { echo "sdist-check: $sdist_problem" >&2; exit 1; }; exit 0; } ;;
        sdist) (($# == 4)) && { checked_sdist "$2" "$3" "$4" || { echo "sdist-check: $sdist_problem" >&2; exit 1; }
                                echo "$checked_sdist"; exit 0; } ;;
    esac
    echo "usage: $0 cache CACHE | sdist SDIST SHA256 DEST" >&2
    exit 2
fi
