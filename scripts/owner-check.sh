#!/usr/bin/env bash
# Who may change a file, and the folders above it. scripts/wheel-check.sh and scripts/sdist-check.sh
# source this file, so that a wheel and the setup cache are held to one walk up the tree:
#
#   private_to_owner PATH [folder]    may only this user or root change PATH
#   owned_chain CHECK PATH            does every folder above PATH, up to /, pass CHECK
#
# A folder above a file counts as much as the file itself: whoever can change one can rename the
# file's folder away and put a folder of their own in its place.

# 0 when PATH (a file or folder; /dev/fd/N: an open file) can be changed by this user or root alone;
# $2=folder: a sticky folder may be writable by all (nobody can rename or replace what is not theirs).
private_to_owner() {
    local owner mode
    read -r owner mode < <(stat -L -c '%u %a' -- "$1") || return 1
    [[ $owner == "$(id -u)" || $owner == 0 ]] || return 1
    (( (8#$mode & 8#022) == 0 )) && return 0
    [[ ${2:-} == folder ]] && (( (8#$mode & 8#1000) != 0 ))
}

# Set by owned_chain: the first folder, from PATH upward, that failed CHECK ("" when none did).
owned_chain_failed=""

# 0 when `CHECK FOLDER folder` holds for every folder above PATH (an absolute path, links already
# resolved) up to /: CHECK is private_to_owner, or a stricter or laxer rule of the caller's with the
# same arguments (sdist-check.sh's owner_only). Else 1, with owned_chain_failed naming the folder.
owned_chain() {
    local check=$1 path=$2
    owned_chain_failed=""
    while [[ $path != / ]]; do
        path=$(dirname -- "$path")
        if ! "$check" "$path" folder; then
            owned_chain_failed=$path
            return 1
        fi
    done
}
