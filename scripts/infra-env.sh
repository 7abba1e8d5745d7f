# shellcheck shell=sh
# Local infrastructure defaults (PostgreSQL + RabbitMQ). SOURCE this file:
#     . scripts/infra-env.sh
# Every variable is only set when not already set, so callers can override
# anything (e.g. `PGPORT=5433 scripts/infra-up.sh`).
# POSIX sh compatible (Makefile recipes run /bin/sh = dash); no `set -e` here.
# It also defines small helper functions used by infra-up/down/restart:
#     pg_wait_ready [timeout]      pg_restart [immediate|fast|smart]
#     rabbitmq_wait_ready [timeout] rabbitmq_restart [app|full]
#     rabbitmq_memory_alarm on|off

# --- repo root, derived from this file's own path --------------------------
_infra_env_file=
if [ -n "${BASH_VERSION:-}" ]; then
    eval '_infra_env_file=${BASH_SOURCE[0]}'
elif [ -n "${ZSH_VERSION:-}" ]; then
    eval '_infra_env_file=${(%):-%x}'
fi
case "${_infra_env_file:-$0}" in
    *infra-env.sh) _infra_env_file=${_infra_env_file:-$0} ;;
    *) _infra_env_file= ;;
esac
if [ -n "$_infra_env_file" ]; then
    REPO=$(CDPATH='' cd -- "$(dirname -- "$_infra_env_file")/.." && pwd -P)
elif [ -n "${REPO:-}" ] && [ -f "$REPO/scripts/infra-env.sh" ]; then
    :   # dash & co. cannot know the sourced file's path: trust a valid $REPO
else
    # last resort: walk up from the current directory
    _d=$(pwd -P)
    while [ "$_d" != / ] && [ ! -f "$_d/scripts/infra-env.sh" ]; do _d=$(dirname -- "$_d"); done
    if [ -f "$_d/scripts/infra-env.sh" ]; then REPO=$_d; else
        echo "infra-env.sh: cannot locate repo root; set REPO=/path/to/repo" >&2
        unset _d _infra_env_file; return 1 2>/dev/null || exit 1
    fi
    unset _d
fi
unset _infra_env_file
export REPO

# --- general -----------------------------------------------------------------
export RUN_DIR="${RUN_DIR:-$REPO/.run}"
export DEBIAN_FRONTEND="${DEBIAN_FRONTEND:-noninteractive}"

# Where PostgreSQL's and RabbitMQ's data live: $RUN_DIR, unless their OS users
# could not reach it or PostgreSQL's socket path would be too long there. A
# checkout under a 0700 directory (root's home) or a deep path then keeps its
# data in /var/lib/outbox-infra/<checksum of the checkout's path> (root's,
# outside any temporary-file cleaning), which scripts/infra-down.sh --purge
# removes like .run's. A cluster already in one of the two places keeps it
# there; otherwise the parent directories' permission bits decide (group and
# ACL access is not looked at: such a checkout uses /var/lib).
_infra_data_dir_ok() {   # dir: its parents searchable by others, socket path < 108 bytes
    [ "$(printf '%s' "$1/pgsock/.s.PGSQL.${PGPORT:-5432}" | wc -c)" -lt 108 ] || return 1
    _p=$(dirname -- "$1")
    while :; do
        if [ -e "$_p" ]; then
            case $(stat -L -c %A -- "$_p" 2>/dev/null) in ?????????[xt]) ;; *) return 1 ;; esac
        fi
        _up=$(dirname -- "$_p")
        [ "$_up" = "$_p" ] && break
        _p=$_up
    done
}
if [ -z "${INFRA_DATA_DIR:-}" ]; then
    case $RUN_DIR in /*) ;; *) RUN_DIR=$(pwd -P)/$RUN_DIR; export RUN_DIR ;; esac
    _elsewhere=/var/lib/outbox-infra/$(printf '%s' "$REPO" | cksum | cut -d' ' -f1)
    if [ -s "$RUN_DIR/pg/PG_VERSION" ]; then INFRA_DATA_DIR=$RUN_DIR
    elif [ -s "$_elsewhere/pg/PG_VERSION" ]; then INFRA_DATA_DIR=$_elsewhere
    elif _infra_data_dir_ok "$RUN_DIR"; then INFRA_DATA_DIR=$RUN_DIR
    else INFRA_DATA_DIR=$_elsewhere; fi
fi
unset _p _up _elsewhere
export INFRA_DATA_DIR

# --- PostgreSQL ----------------------------------------------------------------
export PGHOST="${PGHOST:-127.0.0.1}"
export PGPORT="${PGPORT:-5432}"
export PGUSER="${PGUSER:-app}"
export PGPASSWORD="${PGPASSWORD:-app}"
export PG_VERSION="${PG_VERSION:-15}"
export PG_BIN="${PG_BIN:-/usr/lib/postgresql/$PG_VERSION/bin}"
export PG_DATA_DIR="${PG_DATA_DIR:-$INFRA_DATA_DIR/pg}"
export PG_SOCKET_DIR="${PG_SOCKET_DIR:-$INFRA_DATA_DIR/pgsock}"
export PG_LOG="${PG_LOG:-$INFRA_DATA_DIR/pg.log}"
export DATABASES="${DATABASES:-orders inventory ledger loyalty}"

# PG_URL_<DB> per database, e.g. PG_URL_ORDERS=postgres://app:app@127.0.0.1:5432/orders
for _db in $DATABASES; do
    _var=PG_URL_$(printf '%s' "$_db" | tr 'a-z-' 'A-Z_')
    eval "export $_var=\"\${$_var:-postgres://$PGUSER:$PGPASSWORD@$PGHOST:$PGPORT/$_db}\""
done
unset _db _var

# --- RabbitMQ ------------------------------------------------------------------
export AMQP_HOST="${AMQP_HOST:-127.0.0.1}"
export AMQP_PORT="${AMQP_PORT:-5672}"
export AMQP_USER="${AMQP_USER:-app}"
export AMQP_PASSWORD="${AMQP_PASSWORD:-app}"
export AMQP_VHOST="${AMQP_VHOST:-/}"
if [ -z "${AMQP_URL:-}" ]; then
    AMQP_URL="amqp://$AMQP_USER:$AMQP_PASSWORD@$AMQP_HOST:$AMQP_PORT/$(printf '%s' "$AMQP_VHOST" | sed -e 's/%/%25/g' -e 's|/|%2f|g')"
fi
export AMQP_URL
export RABBITMQ_MGMT_PORT="${RABBITMQ_MGMT_PORT:-15672}"

# The node is run by Debian's rabbitmq-server (as OS user `rabbitmq`, HOME and
# Erlang cookie in /var/lib/rabbitmq) but keeps its data/logs/config in $INFRA_DATA_DIR.
# Node name and cookie match Debian's defaults, so bare `rabbitmqctl status` works.
# rabbitmqctl/rabbitmq-plugins need the same variables: source this file first.
if [ -z "${RABBITMQ_NODENAME:-}" ]; then
    # rabbit@<host> needs a resolvable short hostname; otherwise use localhost
    _h=$(hostname -s 2>/dev/null || true)
    if [ -n "$_h" ] && getent hosts "$_h" >/dev/null 2>&1; then RABBITMQ_NODENAME="rabbit@$_h"
    else RABBITMQ_NODENAME="rabbit@localhost"; fi
    unset _h
fi
export RABBITMQ_NODENAME
export RABBITMQ_DIR="${RABBITMQ_DIR:-$INFRA_DATA_DIR/rabbitmq}"
export RABBITMQ_MNESIA_BASE="${RABBITMQ_MNESIA_BASE:-$RABBITMQ_DIR/mnesia}"
export RABBITMQ_LOG_BASE="${RABBITMQ_LOG_BASE:-$RABBITMQ_DIR/log}"
export RABBITMQ_PID_FILE="${RABBITMQ_PID_FILE:-$RABBITMQ_DIR/rabbit.pid}"
# Debian's default location on purpose: a bare `rabbitmq-plugins list -e` (without
# this env) reads this file, so keep it there to avoid confusing output.
export RABBITMQ_ENABLED_PLUGINS_FILE="${RABBITMQ_ENABLED_PLUGINS_FILE:-/etc/rabbitmq/enabled_plugins}"
export RABBITMQ_CONFIG_FILE="${RABBITMQ_CONFIG_FILE:-$RABBITMQ_DIR/rabbitmq.conf}"

# --- helpers (POSIX sh; used by infra-*.sh, usable from tests) -----------------
# Run a PostgreSQL binary as the postgres OS user (postgres refuses root).
pg_as_postgres() { (cd / && runuser -u postgres -- "$@"); }

pg_wait_ready() {   # [timeout_seconds]
    _t=${1:-60}; _i=0
    while ! "$PG_BIN/pg_isready" -q -h "$PGHOST" -p "$PGPORT" -d postgres -t 2; do
        _i=$((_i + 1))
        if [ "$_i" -ge "$_t" ]; then
            echo "ERROR: PostgreSQL not ready on $PGHOST:$PGPORT after ${_t}s; tail of $PG_LOG:" >&2
            tail -n 40 "$PG_LOG" >&2 2>/dev/null
            return 1
        fi
        sleep 1
    done
}

# pg_restart immediate  => crash (no checkpoint) + crash recovery on start
pg_restart() {      # [immediate|fast|smart]
    pg_as_postgres "$PG_BIN/pg_ctl" -D "$PG_DATA_DIR" -l "$PG_LOG" -m "${1:-fast}" \
        -w -t 60 restart >/dev/null || { tail -n 40 "$PG_LOG" >&2; return 1; }
    pg_wait_ready 60
}

rabbitmq_wait_ready() {   # [timeout_seconds]
    _t=${1:-120}; _i=0
    while ! rabbitmq-diagnostics -q check_running >/dev/null 2>&1; do
        _i=$((_i + 2))
        if [ "$_i" -ge "$_t" ]; then
            echo "ERROR: RabbitMQ node $RABBITMQ_NODENAME not running after ${_t}s; log tail:" >&2
            tail -n 40 "$RABBITMQ_LOG_BASE"/*.log >&2 2>/dev/null
            return 1
        fi
        sleep 2
    done
    # the AMQP listener must accept connections too
    rabbitmq-diagnostics -q check_port_listener "$AMQP_PORT" >/dev/null
}

# rabbitmq_memory_alarm on  => memory high watermark 0: the broker raises its
#   memory alarm and blocks every connection that publishes (the value it
#   had is kept in $RUN_DIR/rabbitmq-watermark)
# rabbitmq_memory_alarm off => the kept watermark again (0.4 if none kept)
rabbitmq_memory_alarm() {     # on|off
    case "${1:-}" in
        on)
            if [ ! -f "$RUN_DIR/rabbitmq-watermark" ]; then
                rabbitmqctl -q eval 'vm_memory_monitor:get_vm_memory_high_watermark().' \
                    > "$RUN_DIR/rabbitmq-watermark" || return 1
            fi
            # Who raised it (the caller of infra-restart.sh: the test):
            # infra-up clears an alarm only once its owner is gone.
            echo "${ALARM_OWNER:-$PPID}" > "$RUN_DIR/rabbitmq-alarm.owner"
            rabbitmqctl -q set_vm_memory_high_watermark 0 ;;
        off)
            _w=$(cat "$RUN_DIR/rabbitmq-watermark" 2>/dev/null || echo 0.4)
            case "$_w" in 0.*|1.0|1) ;; *) _w=0.4 ;; esac
            rabbitmqctl -q set_vm_memory_high_watermark "$_w" \
                && rm -f "$RUN_DIR/rabbitmq-watermark" "$RUN_DIR/rabbitmq-alarm.owner"
            unset _w ;;
        *) echo "usage: rabbitmq_memory_alarm on|off" >&2; return 2 ;;
    esac
}

# rabbitmq_restart app  => stop_app/start_app (VM stays up, all connections dropped)
# rabbitmq_restart full => stop the whole node and start it again
rabbitmq_restart() {      # [app|full]
    case "${1:-app}" in
        app)  rabbitmqctl -q stop_app && rabbitmqctl -q start_app ;;
        full) rabbitmqctl -q stop "$RABBITMQ_PID_FILE" >/dev/null && rabbitmq-server -detached ;;
        *) echo "usage: rabbitmq_restart [app|full]" >&2; return 2 ;;
    esac || return 1
    rabbitmq_wait_ready 120
}
