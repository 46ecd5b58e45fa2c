#!/bin/sh
# Builds the outbox image FROM scratch around a binary built on this host:
# the binary, every shared library ldd names for it, and the host's CA bundle
# (for sslrootcert=system). Needs podman (or buildah: BUILD="buildah bud").
#
#   cargo build --release -p outbox-cli
#   deploy/container/build.sh [binary] [tag]
#
# Defaults: target/release/outbox, localhost/outbox:latest.
set -eu

bin=${1:-target/release/outbox}
tag=${2:-localhost/outbox:latest}
build=${BUILD:-podman build}
here=$(cd "$(dirname "$0")" && pwd)

[ -x "$bin" ] || { echo "error: no binary at $bin (run: cargo build --release -p outbox-cli)" >&2; exit 2; }
[ -r /etc/ssl/certs/ca-certificates.crt ] || { echo "error: no /etc/ssl/certs/ca-certificates.crt (apt-get install ca-certificates)" >&2; exit 2; }

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
root=$ctx/rootfs
mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs"
cp "$bin" "$root/usr/local/bin/outbox"
# ldd prints "name => /path (addr)" and "/lib64/ld-linux-x86-64.so.2 (addr)":
# every absolute path is a file the binary loads.
for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done
cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
cp "$here/Containerfile" "$ctx/Containerfile"
$build -t "$tag" "$ctx"
