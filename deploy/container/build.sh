#!/bin/sh
# Builds the outbox image from source (deploy/container/Containerfile: a
# builder stage compiles the binary, the image is FROM scratch around it).
# Needs podman (or buildah: BUILD="buildah bud").
#
#   deploy/container/build.sh [tag] [extra build flags…]
#
# Default tag: localhost/outbox:latest. RUST_IMAGE picks the builder image
# (default docker.io/library/rust:1.89-bookworm; any image with cargo 1.89+,
# make, and C and C++ compilers).
set -eu

tag=${1:-localhost/outbox:latest}
[ $# -gt 0 ] && shift
build=${BUILD:-podman build}
root=$(cd "$(dirname "$0")/../.." && pwd)
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)

set -- --build-arg "OUTBOX_BUILD_COMMIT=$commit" "$@"
[ -n "${RUST_IMAGE:-}" ] && set -- --build-arg "RUST_IMAGE=$RUST_IMAGE" "$@"
$build -f "$root/deploy/container/Containerfile" -t "$tag" "$@" "$root"
