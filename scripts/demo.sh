#!/usr/bin/env bash
# Quick start, command 1: the outbox end to end. Without DATABASE_URL it starts
# a throwaway PostgreSQL and redis-server; with DATABASE_URL (and optionally
# OUTBOX_SINK=redis://…) it uses those. Extra arguments go to `outbox-lab demo`.
# The demo is outbox-lab's (it uses the testkit, which the production binary
# `outbox` does not link) and runs the relay in its own process, through the
# library, so it needs no `outbox` binary.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
ensure_deps
exec cargo run --quiet --release -p outbox-lab -- demo "$@"
