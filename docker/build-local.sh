#!/usr/bin/env bash
# Build the image with podman on a machine without Docker and without an image registry (what
# `make test-image` does): a Debian bookworm base made offline with debootstrap (once; skipped when
# the base image exists), then the CPU image on it, trusting the host's CA bundle as a build secret.
#
#   bash docker/build-local.sh            # -> localhost/hvdtrain:cpu; prints build time and size
#
# Knobs: HVDTRAIN_IMAGE (tag, default localhost/hvdtrain:cpu), HVDTRAIN_BASE_IMAGE (default
# localhost/debian-base:bookworm), HVDTRAIN_CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt;
# empty: no secret), DEBIAN_MIRROR (default http://deb.debian.org/debian), HVDTRAIN_IMAGE_FROM_SOURCE=1
# (compile Horovod in the image even when this checkout's setup already built a matching wheel).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
image=${HVDTRAIN_IMAGE:-localhost/hvdtrain:cpu}
base=${HVDTRAIN_BASE_IMAGE:-localhost/debian-base:bookworm}
ca=${HVDTRAIN_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { printf '[image] %s\n' "$*"; }
die() { printf '[image] error: %s\n' "$*" >&2; exit 1; }

command -v podman >/dev/null || die "podman is not installed (apt-get install podman, or: bash scripts/test-deps.sh)"

if ! podman image exists "$base"; then
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    rootfs=$(mktemp -d /var/tmp/hvdtrain-base.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    log "making the base $base with debootstrap (minbase bookworm from $mirror)"
    start=$SECONDS
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
        || { tail -20 "$rootfs.log"; die "debootstrap failed (log: $rootfs.log)"; }
    # An imported tarball has no ENV at all; give it the PATH that registry images of Debian have.
    tar -C "$rootfs" -c . | podman import -q --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$base" >/dev/null
    rm -f "$rootfs.log"
    log "base ready in $((SECONDS - start)) s"
fi

secret=()
if [[ -n $ca ]]; then
    [[ -s $ca ]] || die "HVDTRAIN_CA_BUNDLE=$ca is not a readable PEM bundle"
    secret=(--secret "id=ca,src=$ca")
fi
# The Horovod wheels this checkout's setup built (.cache/setup/wheels), read-only at /wheelhouse in
# the builder: one built from the same inputs (sdist, patch series, torch, Python, OS, CPU ops) is installed
# instead of compiled. HVDTRAIN_IMAGE_FROM_SOURCE=1 compiles it in the image all the same.
# Their SHA-256 sums go along as a build argument: setup.sh installs a wheel of /wheelhouse only when
# its sum is one of them (scripts/wheel-check.sh).
wheels=$repo/.cache/setup/wheels
volume=()
if [[ -z ${HVDTRAIN_IMAGE_FROM_SOURCE:-} && -d $wheels ]]; then
    sums=$(find "$wheels" -name 'horovod-*.whl' -type f -exec sha256sum {} + | cut -d' ' -f1 | paste -sd, -)
    volume=(-v "$wheels:/wheelhouse:ro" --build-arg "HVDTRAIN_WHEELHOUSE_SHA256=$sums")
    log "the builder may reuse the Horovod wheels in $wheels (HVDTRAIN_IMAGE_FROM_SOURCE=1: compile instead)"
fi
log "building $image on $base (CPU: HVDTRAIN_GPU_OPS=none)"
start=$SECONDS
# --isolation=chroot: no container runtime is needed (none can start containers on these machines);
# --network=host: the build reaches the package registries the way the host does.
podman build --isolation=chroot --network=host "${secret[@]}" "${volume[@]}" \
    --build-arg "BASE_IMAGE=$base" --build-arg "RUNTIME_IMAGE=$base" --build-arg HVDTRAIN_GPU_OPS=none \
    -f "$repo/docker/Dockerfile" -t "$image" "$repo"
size=$(podman image inspect --format '{{.Size}}' "$image")
log "built $image in $((SECONDS - start)) s, $(awk -v b="$size" 'BEGIN { printf "%.2f GB", b / 1e9 }')"
