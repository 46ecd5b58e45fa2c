# Sourced by scripts/demo.sh and scripts/test.sh: makes sure the PostgreSQL
# server binaries and redis-server exist. As root on Debian it installs the
# missing packages; otherwise it prints the exact command and exits 1.

find_initdb() {
    if [ -n "${OUTBOX_PG_BIN:-}" ] && [ -x "$OUTBOX_PG_BIN/initdb" ]; then return 0; fi
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && return 0
    command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ] && return 0
    command -v initdb >/dev/null 2>&1
}

ensure_deps() {
    local missing=()
    find_initdb || missing+=(postgresql)
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    command -v cargo >/dev/null 2>&1 || {
        echo "cargo not found: install Rust from your distribution or rustup, then re-run" >&2
        exit 1
    }
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing ${missing[*]} with apt-get" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "missing: ${missing[*]}" >&2
        echo "install them with:  sudo apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
}
