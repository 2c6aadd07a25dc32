#!/usr/bin/env bash
# hvdtrain's patches to Horovod 0.28.1: third_party/horovod/, one patch per change, applied in the
# order its `series` file lists them (quilt's convention: one file name a line; blank lines and
# lines starting with # are skipped). docs/horovod-patch.md says what each one does and what
# leaving it out costs. scripts/setup.sh and benchmarks/gpu/setup_device.sh source this file; the
# tests run it directly:
#
#   bash scripts/horovod-patches.sh list      -> the patch files, in series order, one path a line
#   bash scripts/horovod-patches.sh id        -> 12 hex digits that change with the series file or
#                                                any patch (setup's rebuild marker and wheel key)
#   bash scripts/horovod-patches.sh apply SRC -> applies the series to SRC (an extracted sdist,
#                                                horovod-0.28.1/), printing patch's lines prefixed
#                                                with each patch's name; on failure one line naming
#                                                the patch, patch's output, exit 1
#
# patch runs with --fuzz=0 (a hunk applies where its context matches exactly, or not at all: a
# series that needs fuzz is stale and must be refreshed) and --forward (a patch applied twice
# fails instead of being reversed).

horovod_patches=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/third_party/horovod

# Set by the functions below: the series' patch files in order (load_horovod_series), and when one
# fails, the reason.
horovod_patch_files=()
horovod_patches_problem=""

# Fills horovod_patch_files from the series file; 1 (and horovod_patches_problem) when the series
# is missing, empty, or names a file that is not there.
load_horovod_series() {
    local name
    horovod_patch_files=()
    [[ -f $horovod_patches/series ]] || { horovod_patches_problem="no series file in $horovod_patches"; return 1; }
    while IFS= read -r name || [[ -n $name ]]; do
        [[ -z ${name//[[:space:]]/} || $name == \#* ]] && continue
        [[ -f $horovod_patches/$name ]] || {
            horovod_patches_problem="$horovod_patches/series lists $name, which is not there"
            return 1
        }
        horovod_patch_files+=("$horovod_patches/$name")
    done <"$horovod_patches/series"
    ((${#horovod_patch_files[@]})) || { horovod_patches_problem="$horovod_patches/series lists no patch"; return 1; }
}

# What the series is, in 12 hex digits: a hash over the series file and every patch it lists,
# names included. Prints nothing and returns 1 when the series cannot be read.
horovod_series_id() {
    local file
    load_horovod_series || return 1
    {
        cat "$horovod_patches/series"
        for file in "${horovod_patch_files[@]}"; do
            basename -- "$file"
            cat -- "$file"
        done
    } | sha256sum | cut -c1-12
}

# Applies the series to the source tree SRC, in order.
apply_horovod_series() {
    local src=$1 file name out
    load_horovod_series || return 1
    for file in "${horovod_patch_files[@]}"; do
        name=$(basename -- "$file")
        if ! out=$(patch -d "$src" -p1 --forward --fuzz=0 --no-backup-if-mismatch <"$file" 2>&1); then
            horovod_patches_problem="$name does not apply to $src:"$'\n'"$out"
            return 1
        fi
        printf '%s\n' "$out" | sed "s|^|$name: |"
    done
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    case ${1:-} in
        list)
            load_horovod_series || { echo "horovod-patches: $horovod_patches_problem" >&2; exit 1; }
            printf '%s\n' "${horovod_patch_files[@]}" ;;
        id) horovod_series_id || { echo "horovod-patches: $horovod_patches_problem" >&2; exit 1; } ;;
        apply)
            (($# == 2)) || { echo "usage: $0 apply SRC" >&2; exit 2; }
            apply_horovod_series "$2" || { echo "horovod-patches: $horovod_patches_problem" >&2; exit 1; } ;;
        *) echo "usage: $0 list | id | apply SRC" >&2; exit 2 ;;
    esac
fi
