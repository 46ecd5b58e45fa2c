# Sourced by scripts/demo.sh and scripts/test.sh: makes sure the PostgreSQL
# server binaries, redis-server, a C toolchain (for the bundled librdkafka),
# nats-server, rabbitmq-server, pgbouncer, (for the lab report and admin console
# tests) chromium and chromium-driver, and (for the metrics tests'
# `promtool check`) prometheus exist.
# As root on Debian it installs the missing packages; otherwise it prints the
# exact command and exits 1. ensure_tansu builds the Kafka-protocol
# broker the Kafka tests run, once, with cargo; `ensure_deps brokers` also
# installs moto (the SQS and SNS tests' AWS emulator) with pip, once.

find_initdb() {
    if [ -n "${OUTBOX_PG_BIN:-}" ] && [ -x "$OUTBOX_PG_BIN/initdb" ]; then return 0; fi
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && return 0
    command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ] && return 0
    command -v initdb >/dev/null 2>&1
}

# ensure_deps [brokers]: PostgreSQL, redis-server and make + cc always (the
# demo needs no more; the `outbox` binary builds librdkafka for its Kafka
# sink); with `brokers`, nats-server, rabbitmq-server and pgbouncer too (the
# tests).
ensure_deps() {
    local missing=()
    find_initdb || missing+=(postgresql)
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    # rdkafka-sys builds its bundled librdkafka with ./configure && make, whose
    # configure fails without a C++ compiler.
    { command -v make && command -v cc && command -v c++; } >/dev/null 2>&1 || missing+=(build-essential)
    if [ "${1:-}" = brokers ]; then
        # Debian puts both in /usr/sbin, which a normal user's PATH lacks.
        command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
        command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] || missing+=(rabbitmq-server)
        # The pooler tests put PgBouncer (Debian's, in /usr/sbin) in front of PostgreSQL.
        command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
        # The lab's report test opens the HTML report in a real headless browser;
        # the admin console's test drives one through chromedriver (WebDriver).
        command -v chromium >/dev/null 2>&1 || missing+=(chromium)
        # promtool checks the scraped /metrics and deploy/prometheus/; the
        # package installs in seconds (its service is not started).
        command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
        command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
    fi
    command -v cargo >/dev/null 2>&1 || {
        echo "cargo not found: install Rust from your distribution or rustup, then re-run" >&2
        exit 1
    }
    if [ "${1:-}" = brokers ]; then ensure_moto; fi
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

# The SQS and SNS tests run moto, an AWS emulator (a Python package), from a
# virtual environment in ~/.cache/outbox-tools/moto (OUTBOX_TOOLS to put it
# elsewhere, OUTBOX_MOTO_SERVER to use a moto_server you have), installed once
# with pip: Debian's pip refuses to install into the system's Python. Sets
# OUTBOX_MOTO_SERVER, where the testkit looks first. AWS's Python SQS
# extended client goes beside it: the claim-check tests read with it.
MOTO_VERSION=5.2.5
EXTENDED_CLIENT_VERSION=1.0.1

ensure_moto() {
    if [ -n "${OUTBOX_MOTO_SERVER:-}" ]; then
        [ -x "$OUTBOX_MOTO_SERVER" ] && return 0
        echo "OUTBOX_MOTO_SERVER=$OUTBOX_MOTO_SERVER is not an executable file" >&2
        exit 1
    fi
    local venv="${OUTBOX_TOOLS:-$HOME/.cache/outbox-tools}/moto"
    export OUTBOX_MOTO_SERVER="$venv/bin/moto_server"
    if [ -x "$OUTBOX_MOTO_SERVER" ] &&
        "$venv/bin/python3" -c "import importlib.metadata as m, sys; sys.exit(m.version('moto') != '$MOTO_VERSION' or m.version('amazon-sqs-extended-client') != '$EXTENDED_CLIENT_VERSION')" 2>/dev/null; then
        return 0
    fi
    # `python3 -m venv` needs Debian's python3-venv (ensurepip).
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
        if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "installing python3-venv with apt-get (for moto)" >&2
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        else
            echo "missing: python3-venv (for moto, the SQS and SNS tests' AWS emulator)" >&2
            echo "install it with:  sudo apt-get install -y python3-venv" >&2
            exit 1
        fi
    fi
    echo "installing moto $MOTO_VERSION (the SQS and SNS tests' AWS emulator) and AWS's SQS extended client $EXTENDED_CLIENT_VERSION into $venv; this happens once" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" &&
        "$venv/bin/pip" install --quiet "moto[server]==$MOTO_VERSION" "amazon-sqs-extended-client==$EXTENDED_CLIENT_VERSION" || {
        echo "installing moto failed; the SQS and SNS tests need it (or set OUTBOX_MOTO_SERVER)" >&2
        exit 1
    }
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

# The Kafka tests run tansu, a single-binary Kafka-protocol broker built with
# cargo: Apache Kafka itself needs jars from Maven Central, which these
# machines cannot reach. It is built once into ~/.cache/outbox-tools (set
# OUTBOX_TOOLS to build elsewhere, or OUTBOX_TANSU to use a tansu you have)
# and found there by the testkit. The build is ~420 crates; at opt-level 1
# without debug info it is much cheaper than cargo's release default, and a
# test broker needs no more speed than that.
TANSU_VERSION=0.6.0

# tansu_wanted: is a build needed? Sets OUTBOX_TANSU either way.
tansu_wanted() {
    if [ -n "${OUTBOX_TANSU:-}" ]; then
        [ -x "$OUTBOX_TANSU" ] && return 1
        echo "OUTBOX_TANSU=$OUTBOX_TANSU is not an executable file" >&2
        exit 1
    fi
    TANSU_ROOT="${OUTBOX_TOOLS:-$HOME/.cache/outbox-tools}"
    export OUTBOX_TANSU="$TANSU_ROOT/bin/tansu"
    # .crates.toml is cargo's record of what it installed under the root.
    ! { [ -x "$OUTBOX_TANSU" ] && grep -q "^\"tansu $TANSU_VERSION " "$TANSU_ROOT/.crates.toml" 2>/dev/null; }
}

build_tansu() {
    echo "building tansu $TANSU_VERSION (the Kafka tests' broker) into $TANSU_ROOT; this happens once" >&2
    # The sqlite storage engine (libsql feature) keeps records across a
    # broker restart; tansu's default builds only a discarding one.
    # Without CARGO_TARGET_DIR cargo builds in a temporary directory it
    # removes, instead of filling the project's with tansu's release build.
    env -u CARGO_TARGET_DIR \
        CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=0 \
        CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
        cargo install --quiet --locked --root "$TANSU_ROOT" "tansu@$TANSU_VERSION" --features libsql
}

# ensure_tansu: builds tansu now if it is missing.
ensure_tansu() {
    if tansu_wanted; then build_tansu; fi
}

# start_tansu_build / wait_tansu_build: the same, in the background, so the
# build overlaps the project's own (whose serial steps leave a core idle).
start_tansu_build() {
    TANSU_BUILD_PID=
    if tansu_wanted; then
        build_tansu &
        TANSU_BUILD_PID=$!
    fi
}

wait_tansu_build() {
    [ -z "${TANSU_BUILD_PID:-}" ] && return 0
    wait "$TANSU_BUILD_PID" || {
        echo "building tansu failed; the Kafka tests need it (or set OUTBOX_TANSU)" >&2
        exit 1
    }
}
