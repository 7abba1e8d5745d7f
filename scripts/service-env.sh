# Sourced after scripts/infra-env.sh by `make run`, `make migrate` and `make
# demo`: point the services (which read their own settings,
# <PREFIX>__DATABASE__URL and <PREFIX>__AMQP__URL) at the PostgreSQL and
# RabbitMQ that `make up` started, also when PGPORT or AMQP_PORT moved them
# off the defaults. A value already set wins. (The tests and `make bench`
# start services on the default ports, or pass them their own URLs: they
# expect PostgreSQL and RabbitMQ on 5432 and 5672.)
export ORDER_API__DATABASE__URL="${ORDER_API__DATABASE__URL:-$PG_URL_ORDERS}"
export OUTBOX_RELAY__DATABASE__URL="${OUTBOX_RELAY__DATABASE__URL:-$PG_URL_ORDERS}"
export OUTBOX_RELAY__AMQP__URL="${OUTBOX_RELAY__AMQP__URL:-$AMQP_URL}"
export INVENTORY_CONSUMER__DATABASE__URL="${INVENTORY_CONSUMER__DATABASE__URL:-$PG_URL_INVENTORY}"
export INVENTORY_CONSUMER__AMQP__URL="${INVENTORY_CONSUMER__AMQP__URL:-$AMQP_URL}"
export LEDGER_CONSUMER__DATABASE__URL="${LEDGER_CONSUMER__DATABASE__URL:-$PG_URL_LEDGER}"
export LEDGER_CONSUMER__AMQP__URL="${LEDGER_CONSUMER__AMQP__URL:-$AMQP_URL}"
export LOYALTY_CONSUMER__DATABASE__URL="${LOYALTY_CONSUMER__DATABASE__URL:-$PG_URL_LOYALTY}"
export LOYALTY_CONSUMER__AMQP__URL="${LOYALTY_CONSUMER__AMQP__URL:-$AMQP_URL}"

# Each service's HTTP port: its own setting when given (`<PREFIX>__HTTP__PORT`,
# which the service reads too), else its default. Shell variables, not
# exported (no service reads them): make run probes the services there, and
# demo_urls points the demo at them.
ORDER_API_PORT="${ORDER_API__HTTP__PORT:-8080}"
INVENTORY_PORT="${INVENTORY_CONSUMER__HTTP__PORT:-8081}"
LEDGER_PORT="${LEDGER_CONSUMER__HTTP__PORT:-8082}"
LOYALTY_PORT="${LOYALTY_CONSUMER__HTTP__PORT:-8083}"
RELAY_PORT="${OUTBOX_RELAY__HTTP__PORT:-9100}"
# demo_urls: export the services' URLs the demo reads (crates/ops/src/bin/demo.rs),
# at those ports; a URL already set wins. `make run` (for its one run of the
# story) and `make demo` both call it, so a port moved for `make run` is the
# port `make demo` reaches.
demo_urls() {
    export ORDER_API_URL="${ORDER_API_URL:-http://127.0.0.1:$ORDER_API_PORT}"
    export INVENTORY_URL="${INVENTORY_URL:-http://127.0.0.1:$INVENTORY_PORT}"
    export LEDGER_URL="${LEDGER_URL:-http://127.0.0.1:$LEDGER_PORT}"
    export LOYALTY_URL="${LOYALTY_URL:-http://127.0.0.1:$LOYALTY_PORT}"
}
