-- The orders database: owned by order-api (writes orders, lines, idempotency
-- records and outbox rows) and outbox-relay (leases, publishes and cleans outbox
-- rows). Money is integer minor units (bigint); never floats.

CREATE TABLE tenants (
    tenant_id   text PRIMARY KEY CHECK (tenant_id ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- API keys are stored as blake3 hashes only; the key itself is shown once.
CREATE TABLE api_keys (
    key_hash    text PRIMARY KEY,            -- hex blake3 of the full key
    tenant_id   text NOT NULL REFERENCES tenants (tenant_id),
    key_prefix  text NOT NULL,               -- first characters, to recognise a key in listings
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX api_keys_tenant_idx ON api_keys (tenant_id);

CREATE TABLE orders (
    order_id             uuid PRIMARY KEY,
    tenant_id            text NOT NULL REFERENCES tenants (tenant_id),
    customer_id          text NOT NULL,
    checkout_id          text,
    currency             text NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    location             text NOT NULL,
    merchandise_minor    bigint NOT NULL CHECK (merchandise_minor >= 0),
    shipping_minor       bigint NOT NULL CHECK (shipping_minor >= 0),
    tax_minor            bigint NOT NULL CHECK (tax_minor >= 0),
    total_minor          bigint NOT NULL,
    status               text NOT NULL DEFAULT 'placed' CHECK (status IN ('placed', 'paid', 'delivered')),
    -- Per-order event sequence: incremented under this row's lock in the same
    -- transaction that writes the outbox row (the aggregate_sequence).
    last_event_sequence  bigint NOT NULL DEFAULT 0 CHECK (last_event_sequence >= 0),
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    CHECK (total_minor = merchandise_minor + shipping_minor + tax_minor)
);
-- The permanent backstop: one order per checkout, even after idempotency keys expire.
CREATE UNIQUE INDEX orders_tenant_checkout_uq ON orders (tenant_id, checkout_id) WHERE checkout_id IS NOT NULL;
CREATE INDEX orders_tenant_created_idx ON orders (tenant_id, created_at);

CREATE TABLE order_lines (
    order_id          uuid NOT NULL REFERENCES orders (order_id),
    line_no           integer NOT NULL CHECK (line_no >= 1),
    sku               text NOT NULL,
    qty               integer NOT NULL CHECK (qty > 0),
    unit_price_minor  bigint NOT NULL CHECK (unit_price_minor >= 0),
    unit_cost_minor   bigint NOT NULL CHECK (unit_cost_minor >= 0),
    PRIMARY KEY (order_id, line_no)
);

CREATE TABLE payments (
    order_id      uuid NOT NULL REFERENCES orders (order_id),
    payment_id    text NOT NULL,
    tenant_id     text NOT NULL REFERENCES tenants (tenant_id),
    amount_minor  bigint NOT NULL CHECK (amount_minor > 0),
    method        text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, payment_id)
);

CREATE TABLE deliveries (
    order_id      uuid NOT NULL REFERENCES orders (order_id),
    delivery_id   text NOT NULL,
    tenant_id     text NOT NULL REFERENCES tenants (tenant_id),
    delivered_at  timestamptz NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, delivery_id)
);

-- Seed 004's idempotency record. The response body is stored as bytes (not
-- jsonb, which would reorder keys and change whitespace) so a replay returns
-- it byte for byte.
CREATE TABLE idempotency_requests (
    tenant_id            text NOT NULL,
    endpoint             text NOT NULL,
    idempotency_key      text NOT NULL,
    request_fingerprint  text NOT NULL,
    response_status      integer,
    response_body        bytea,
    resource_id          uuid,
    created_at           timestamptz NOT NULL DEFAULT now(),
    expires_at           timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, endpoint, idempotency_key)
);
CREATE INDEX idempotency_requests_expires_idx ON idempotency_requests (expires_at);

-- Seed 000's outbox, plus tenant, trace context and quarantine.
CREATE TABLE outbox_events (
    event_id            uuid PRIMARY KEY,
    tenant_id           text NOT NULL,
    aggregate_type      text NOT NULL,
    aggregate_id        text NOT NULL,
    aggregate_sequence  bigint NOT NULL CHECK (aggregate_sequence >= 1),
    event_type          text NOT NULL,
    schema_version      integer NOT NULL,
    payload             jsonb NOT NULL,
    traceparent         text,
    tracestate          text,
    occurred_at         timestamptz NOT NULL DEFAULT now(),
    available_at        timestamptz NOT NULL DEFAULT now(),
    claimed_by          text,
    claim_until         timestamptz,
    published_at        timestamptz,
    attempt_count       integer NOT NULL DEFAULT 0,
    last_error          text,
    quarantined_at      timestamptz,
    UNIQUE (aggregate_type, aggregate_id, aggregate_sequence)
);
CREATE INDEX outbox_dispatch_idx ON outbox_events (available_at, occurred_at) WHERE published_at IS NULL;

-- Wake the relay from the inserting transaction: the notification is delivered
-- at commit (and never for a rolled-back insert). One per statement, not per row.
CREATE FUNCTION outbox_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_events', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER outbox_events_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_events_notify();
