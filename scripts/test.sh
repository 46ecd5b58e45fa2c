#!/usr/bin/env bash
# Quick start, command 2: the whole test suite against real PostgreSQL, Redis,
# NATS, RabbitMQ and HTTP receivers that the tests start themselves (and the
# machine's RabbitMQ, started here if it is not running), and tansu, the
# Kafka-protocol broker, built once with cargo (see deps.sh). `.ci/run` runs
# this.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
ensure_deps brokers
ensure_rabbitmq
start_tansu_build
# Doc examples first (they compile every public example), then every test.
cargo test --workspace --doc --quiet
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-run
    wait_tansu_build
    cargo nextest run --workspace --no-fail-fast "$@"
else
    echo "cargo-nextest not found (cargo install cargo-nextest); using cargo test" >&2
    wait_tansu_build
    cargo test --workspace --no-fail-fast "$@" -- --test-threads 4
fi
