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
