#!/usr/bin/env bash
# Start the five services in the foreground with readable, prefixed logs.
# Ctrl-C (or SIGTERM, or the terminal closing) stops them all gracefully:
# each service runs in a session of its own (setsid), so the terminal's
# SIGINT reaches this script alone, which sends each service one SIGTERM (a
# second signal would make a service exit at once, dropping its in-flight
# work). Expects `make up` and a build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/infra-env.sh
. scripts/service-env.sh
export LOG_FORMAT="${LOG_FORMAT:-text}" RUST_LOG="${RUST_LOG:-info,lapin=error,actix_server=warn,tokio_postgres=warn}"
BIN="${BIN:-target/debug}"
# The consumers first: each declares its exchange, partition queues and
# binding to order-events when it connects, and only then answers /readyz
# as ready. A relay publishing before that would see its first events
# returned (no queue bound; retried) or, worse, routed to the consumers
# already bound only (a later one would miss them).
SERVICES=(inventory-consumer ledger-consumer loyalty-consumer outbox-relay order-api)
# Each service's HTTP port (scripts/service-env.sh: its own setting when
# given, `<PREFIX>__HTTP__PORT`, which the service reads too, else its default).
PORTS=("$INVENTORY_PORT" "$LEDGER_PORT" "$LOYALTY_PORT" "$RELAY_PORT" "$ORDER_API_PORT")
CONSUMERS=3
mkdir -p .run

# Local demo credentials (git-ignored): an API key of tenant `demo` for
# order-api, and the bearer token of the consumers' internal read endpoints.
CREDENTIALS=.run/credentials.env
# Whether the file's key is still the database's: after the cluster was
# purged (scripts/infra-down.sh --purge) or the database made again, it is
# unknown there and every request with it would be 401. Made again then.
key_known() {
    local prefix
    prefix=$(sed -n 's/^ORDER_API_KEY=\(oek_[0-9a-f]\{6\}\).*/\1/p' "$CREDENTIALS")
    [ -n "$prefix" ] && [ "$("$PG_BIN/psql" -X -q -At "$ORDER_API__DATABASE__URL" -c \
        "SELECT 1 FROM api_keys WHERE tenant_id = 'demo' AND key_prefix = '$prefix' AND revoked_at IS NULL LIMIT 1" \
        2>/dev/null)" = 1 ]
}
if [ ! -s "$CREDENTIALS" ] || ! key_known; then
    api_key=$("$BIN/order-api" api-key create --tenant demo)
    token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
    printf 'TENANT=demo\nORDER_API_KEY=%s\nSERVICE_TOKEN=%s\n' "$api_key" "$token" > "$CREDENTIALS"
    chmod 600 "$CREDENTIALS"
fi
set -a; . "$CREDENTIALS"; set +a

pids=()
# The running services (pid, binary), for `make test` to refuse to run
# beside them (scripts/no-stray-services.sh), also after a kill -9 of this
# script left them running.
PIDS_FILE=.run/services.pids
# Services a killed `make run` left behind hold the ports and would answer
# the readiness probes in place of these: refuse, naming them.
scripts/no-stray-services.sh
: >"$PIDS_FILE"
# stop [exit status]
stop() {
    trap - INT TERM HUP
    # Nothing here may end the script early: after a hangup the terminal is
    # gone and a write to it fails (set -e would exit before the TERMs, and
    # the services, in sessions of their own, would keep running).
    set +e
    trap '' PIPE
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    echo "==> stopping services" 2>/dev/null
    wait
    rm -f "$PIDS_FILE"
    exit "${1:-0}"
}
trap stop INT TERM HUP
command -v curl >/dev/null || { echo "ERROR: make run needs curl (apt-get install curl)" >&2; exit 1; }

start() {
    local svc=$1
    # Each service's output, prefixed with its name; $! is the service itself
    # (a background job of this script leads no process group, so setsid
    # makes the new session in place, no fork). The prefixing sed has a
    # session of its own too: it outlives a Ctrl-C to log the shutdown.
    setsid "$BIN/$svc" > >(exec setsid sed -u "s/^/[$svc] /") 2>&1 &
    pids+=($!)
    echo "$! $svc" >>"$PIDS_FILE"
}

# Wait for a service's probe (`readyz`: its database and broker are there).
await() {
    local i=$1 probe=$2 url
    url="http://127.0.0.1:${PORTS[$i]}/$probe"
    for _ in $(seq 1 300); do
        curl -fsS "$url" >/dev/null 2>&1 && break
        sleep 0.2
    done
    if curl -fsS "$url" >/dev/null 2>&1; then
        echo "==> ${SERVICES[$i]} is up: $url"
    else
        # The relay must not start before every consumer's queues are bound
        # (its events would miss them), nor a half-started system look up.
        echo "==> ${SERVICES[$i]} did not answer $url: stopping" >&2
        stop 1
    fi
}

for ((i = 0; i < CONSUMERS; i++)); do start "${SERVICES[$i]}"; done
for ((i = 0; i < CONSUMERS; i++)); do await "$i" readyz; done
for ((i = CONSUMERS; i < ${#SERVICES[@]}; i++)); do start "${SERVICES[$i]}"; done
for ((i = CONSUMERS; i < ${#SERVICES[@]}; i++)); do await "$i" healthz; done
echo "==> all services started"
if [ "${RUN_DEMO:-1}" = 1 ]; then
    echo "==> running the seed 003 story (make demo runs it again)"
    # The services' URLs for the demo alone (a subshell: nothing started
    # later sees them), as `make demo` sets them (scripts/service-env.sh).
    (demo_urls && ORDER_API_BIN="$BIN/order-api" exec "$BIN/demo") \
        || echo "==> the story did not complete (see above)" >&2
fi
echo "==> order-api http://127.0.0.1:${PORTS[4]} (GET /openapi.json), inventory :${PORTS[0]}, ledger :${PORTS[1]}, loyalty :${PORTS[2]}, relay metrics :${PORTS[3]}/metrics"
echo "==> demo tenant: $TENANT   API key: $ORDER_API_KEY   service token: $SERVICE_TOKEN  (in $CREDENTIALS)"
echo "    (README.md, section API, has curl examples: source $CREDENTIALS first)"
echo "==> Ctrl-C stops the five services (PostgreSQL and RabbitMQ keep running: make down stops them)"
wait
