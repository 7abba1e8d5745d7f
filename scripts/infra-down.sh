#!/usr/bin/env bash
# Stop the local PostgreSQL + RabbitMQ started by infra-up.sh (idempotent).
#   scripts/infra-down.sh           stop both, keep data
#   scripts/infra-down.sh --purge   stop both and delete their data (.run/pg, .run/rabbitmq, the demo credentials)
set -euo pipefail
# shellcheck source=scripts/infra-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/infra-env.sh"

log() { printf '==> %s\n' "$*"; }
purge=0
for a in "$@"; do
    case "$a" in
        --purge) purge=1 ;;
        -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
        *) echo "unknown argument: $a" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "ERROR: run as root" >&2; exit 1; }
cd /

# PostgreSQL: only our cluster in $PG_DATA_DIR
if [ -x "$PG_BIN/pg_ctl" ] && [ -s "$PG_DATA_DIR/PG_VERSION" ] \
    && pg_as_postgres "$PG_BIN/pg_ctl" -D "$PG_DATA_DIR" status >/dev/null 2>&1; then
    log "stopping PostgreSQL ($PG_DATA_DIR)"
    pg_as_postgres "$PG_BIN/pg_ctl" -D "$PG_DATA_DIR" -m fast -w -t 60 stop >/dev/null
else
    log "PostgreSQL ($PG_DATA_DIR) is not running"
fi

# RabbitMQ: only the node whose data lives under $RABBITMQ_MNESIA_BASE
if command -v rabbitmqctl >/dev/null; then
    node_dir=$(rabbitmqctl -q eval 'rabbit_mnesia:dir().' 2>/dev/null | tr -d '"' || true)
    if [[ -n "$node_dir" && "$node_dir" == "$RABBITMQ_MNESIA_BASE"/* ]]; then
        log "stopping RabbitMQ node $RABBITMQ_NODENAME"
        rabbitmqctl -q stop "$RABBITMQ_PID_FILE" >/dev/null
    elif [ -n "$node_dir" ]; then
        log "RabbitMQ node $RABBITMQ_NODENAME is running but is not ours (data: $node_dir): left alone"
    else
        log "RabbitMQ node $RABBITMQ_NODENAME is not running"
    fi
fi

if [ "$purge" = 1 ]; then
    for d in "$PG_DATA_DIR" "$RABBITMQ_DIR" "$PG_SOCKET_DIR"; do
        case "$d" in ''|/|"$REPO"|"$RUN_DIR"|"$INFRA_DATA_DIR") echo "refusing to delete '$d'" >&2; exit 1 ;; esac
        log "purging $d"
        rm -rf -- "$d"
    done
    # The demo credentials name an API key of the purged database.
    rm -f -- "$PG_LOG" "$RUN_DIR/infra.env" "$RUN_DIR/initdb.log" "$RUN_DIR/credentials.env"
    # The data's own directory in /var/lib/outbox-infra, when .run was out of reach.
    [ "$INFRA_DATA_DIR" = "$RUN_DIR" ] || rmdir -- "$INFRA_DATA_DIR" 2>/dev/null || true
fi
