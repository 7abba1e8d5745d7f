#!/usr/bin/env bash
# Start the five services in the foreground with readable, prefixed logs.
# Ctrl-C (or SIGTERM) stops them all gracefully. Expects `make up` and a build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/infra-env.sh
export LOG_FORMAT="${LOG_FORMAT:-text}" RUST_LOG="${RUST_LOG:-info,lapin=warn,actix_server=warn}"
BIN="${BIN:-target/debug}"
SERVICES=(order-api outbox-relay inventory-consumer ledger-consumer loyalty-consumer)
PORTS=(8080 9100 8081 8082 8083)
mkdir -p .run

pids=()
stop() {
    trap - INT TERM
    echo "==> stopping services"
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait || true
    exit 0
}
trap stop INT TERM

for i in "${!SERVICES[@]}"; do
    svc=${SERVICES[$i]}
    # Each service's output, prefixed with its name; $! is the service itself.
    "$BIN/$svc" > >(sed -u "s/^/[$svc] /") 2>&1 &
    pids+=($!)
done

for i in "${!SERVICES[@]}"; do
    url="http://127.0.0.1:${PORTS[$i]}/healthz"
    for _ in $(seq 1 300); do
        curl -fsS "$url" >/dev/null 2>&1 && break
        sleep 0.2
    done
    if curl -fsS "$url" >/dev/null 2>&1; then
        echo "==> ${SERVICES[$i]} is up: $url"
    else
        echo "==> ${SERVICES[$i]} did not answer $url" >&2
    fi
done
echo "==> all services started; Ctrl-C stops them"
wait
