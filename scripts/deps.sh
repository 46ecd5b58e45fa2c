# Sourced by scripts/demo.sh and scripts/test.sh: makes sure the PostgreSQL
# server binaries, redis-server, nats-server, rabbitmq-server and (for the
# lab report test) chromium exist. As
# root on Debian it installs the missing packages; otherwise it prints the
# exact command and exits 1.

find_initdb() {
    if [ -n "${OUTBOX_PG_BIN:-}" ] && [ -x "$OUTBOX_PG_BIN/initdb" ]; then return 0; fi
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && return 0
    command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ] && return 0
    command -v initdb >/dev/null 2>&1
}

# ensure_deps [brokers]: PostgreSQL and redis-server always (the demo needs
# no more); with `brokers`, nats-server and rabbitmq-server too (the tests).
ensure_deps() {
    local missing=()
    find_initdb || missing+=(postgresql)
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    if [ "${1:-}" = brokers ]; then
        # Debian puts both in /usr/sbin, which a normal user's PATH lacks.
        command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
        command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] || missing+=(rabbitmq-server)
        # The lab's report test opens the HTML report in a real headless browser.
        command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    fi
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

# The RabbitMQ tests that need no private node use the machine's broker on
# 127.0.0.1:5672 (guest/guest, vhost /); start it if nothing listens there.
rabbitmq_listening() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }

ensure_rabbitmq() {
    rabbitmq_listening && return 0
    local server=rabbitmq-server
    command -v rabbitmq-server >/dev/null 2>&1 || server=/usr/sbin/rabbitmq-server
    echo "starting rabbitmq-server (the tests use the broker on 127.0.0.1:5672)" >&2
    "$server" -detached
    # RabbitMQ opens its AMQP listener as the last boot step; a first boot
    # (creating its database) can take a minute on a small machine.
    for _ in $(seq 1 600); do
        rabbitmq_listening && return 0
        sleep 0.2
    done
    echo "rabbitmq-server did not listen on 127.0.0.1:5672 within 120 s; see /var/log/rabbitmq/" >&2
    exit 1
}
