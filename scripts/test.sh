#!/usr/bin/env bash
# Quick start, command 2: the house rules, then the whole test suite against
# real PostgreSQL, Redis, NATS, RabbitMQ and HTTP receivers that the tests
# start themselves (and the machine's RabbitMQ, started here if it is not
# running), and tansu, the Kafka-protocol broker, built once with cargo (see
# deps.sh). `.ci/run` runs this.
#
# Cheapest failure first: formatting (seconds), the portability scan and
# the docs' links (instant), then clippy, the binary without default features and the
# `outbox` crate for other platforms (incremental builds), then the doc tests
# and the suite. Each step prints how long it took. Arguments go to
# `cargo nextest run` (or `cargo test`), e.g. a test name filter.
set -euo pipefail
cd "$(dirname "$0")/.."

# step NAME COMMAND...: runs a step and says how long it took.
step() {
    local name=$1 start=$SECONDS
    shift
    echo "==> $name" >&2
    "$@"
    echo "    $name: $((SECONDS - start)) s" >&2
}

# rustfmt and clippy are rustup components (a minimal profile lacks them).
missing=()
cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
if [ ${#missing[@]} -gt 0 ]; then
    echo "missing Rust components: ${missing[*]}" >&2
    echo "install them with:  rustup component add ${missing[*]}" >&2
    command -v rustup >/dev/null 2>&1 ||
        echo "(no rustup: install rustup from https://rustup.rs, or your distribution's rustfmt and clippy for this Rust)" >&2
    exit 1
fi

step "cargo fmt --check" cargo fmt --all --check
step "portability scan of crates/outbox" bash scripts/check-portable.sh --scan-only
step "relative links in the docs" bash scripts/check-links.sh

. scripts/deps.sh
ensure_deps brokers
ensure_rabbitmq
# tansu builds in the background while the project's own builds run.
start_tansu_build

step "cargo clippy" cargo clippy --quiet --workspace --all-targets -- -D warnings
step "outbox-cli without default features" cargo build --quiet -p outbox-cli --no-default-features
step "outbox on other platforms" bash scripts/check-portable.sh
# Doc examples first (they compile every public example), then every test.
step "doc tests" cargo test --workspace --doc --quiet
if cargo nextest --version >/dev/null 2>&1; then
    step "build the tests" cargo nextest run --workspace --no-run
    wait_tansu_build
    step "tests" cargo nextest run --workspace --no-fail-fast "$@"
else
    echo "cargo-nextest not found (cargo install cargo-nextest); using cargo test" >&2
    wait_tansu_build
    step "tests" cargo test --workspace --no-fail-fast "$@" -- --test-threads 4
fi
