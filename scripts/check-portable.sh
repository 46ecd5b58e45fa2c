#!/usr/bin/env bash
# `outbox` (crates/outbox, what applications add) must build wherever Rust
# does; its one OS-specific piece, the systemd notify sender, is gated by cfg
# (crates/outbox/src/notify.rs). This script proves it as far as a Linux
# machine can, cheapest check first:
#
# 1. A scan of crates/outbox/src: every `std::os::<platform>` path (unix, fd,
#    linux, windows, ...) is inside an item gated for that platform:
#    `#[cfg(unix)]`, `#[cfg(all(test, unix))]`, `#[cfg(target_os = "linux")]`
#    (which is unix too), or a file that opens with `#![cfg(...)]`. The scanner
#    is line-based: braces count outside strings and `//` comments, and a
#    gate with `not(` never counts. It first checks itself on a sample it
#    must reject.
# 2. `cargo check -p outbox --no-default-features` here.
# 3. For each cross target rustup has installed (x86_64-pc-windows-msvc: no
#    unix at all; x86_64-unknown-freebsd: unix without Linux), `cargo check`
#    of `outbox` with its default features. `check` needs only
#    the target's std, no linker. A missing target is skipped, with the
#    command that adds it.
#
# Usage: scripts/check-portable.sh [--scan-only]
set -euo pipefail
cd "$(dirname "$0")/.."

# scan FILE...: prints `file:line: path needs cfg(platform)` for every
# ungated use, and fails if there was one.
scan() {
    awk -f scripts/portable-scan.awk "$@"
}

# The scanner must reject an ungated use, or it proves nothing.
sample=$(mktemp --suffix=.rs)
trap 'rm -f "$sample"' EXIT
cat >"$sample" <<'RUST'
#[cfg(unix)]
mod unix {
    use std::os::unix::net::UnixDatagram;
    #[cfg(target_os = "linux")]
    fn linux() { use std::os::linux::net::SocketAddrExt; }
}
#[cfg(not(unix))]
use std::os::unix::ffi::OsStrExt;
fn nowhere() { let s = "}"; use std::os::linux::net::SocketAddrExt; }
RUST
if found=$(scan "$sample"); then
    echo "check-portable: the scanner passed a sample with ungated std::os paths" >&2
    exit 1
fi
if [ "$(grep -c . <<<"$found")" -ne 2 ]; then
    echo "check-portable: the scanner should have found exactly lines 8 and 9 of its sample:" >&2
    echo "$found" >&2
    exit 1
fi

mapfile -t sources < <(find crates/outbox/src -name '*.rs' | sort)
scan "${sources[@]}" || {
    echo "check-portable: gate these with #[cfg(unix)] / #[cfg(target_os = \"linux\")] (see crates/outbox/src/notify.rs)" >&2
    exit 1
}
echo "check-portable: every std::os path in crates/outbox/src (${#sources[@]} files) is under its cfg" >&2
[ "${1:-}" = --scan-only ] && exit 0

echo "check-portable: cargo check -p outbox --no-default-features" >&2
cargo check --quiet -p outbox --no-default-features

installed=$(rustup target list --installed 2>/dev/null || true)
missing=()
for target in x86_64-pc-windows-msvc x86_64-unknown-freebsd; do
    if ! grep -qx "$target" <<<"$installed"; then
        missing+=("$target")
        continue
    fi
    # Default features only: the platform paths are gated by cfg, not by
    # features, and the build without features is checked above on the host.
    echo "check-portable: cargo check -p outbox --target $target" >&2
    cargo check --quiet -p outbox --target "$target"
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "check-portable: skipped the cross checks for ${missing[*]} (no std for them here);" >&2
    echo "  add them with:  rustup target add ${missing[*]}" >&2
fi
