-- Inventory: stock levels per (tenant, sku, location) and the movements they
-- are derived from. Every movement and the level change it causes are written
-- in one transaction, so on_hand = sum(on_hand_delta) and
-- reserved = sum(reserved_delta) of the movements, always.

CREATE TABLE stock_levels (
    tenant_id   text   NOT NULL,
    sku         text   NOT NULL,
    location    text   NOT NULL,
    on_hand     bigint NOT NULL DEFAULT 0 CHECK (on_hand >= 0),
    reserved    bigint NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    available   bigint GENERATED ALWAYS AS (on_hand - reserved) STORED,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, sku, location)
);

-- Stock receipts (inventory owns them): idempotent by (tenant, receipt_id).
CREATE TABLE stock_receipts (
    tenant_id    text   NOT NULL,
    receipt_id   text   NOT NULL,
    sku          text   NOT NULL,
    location     text   NOT NULL,
    qty          bigint NOT NULL CHECK (qty > 0),
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, receipt_id)
);

-- The location each order is fulfilled from (from OrderPlaced), needed when
-- ParcelDelivered (which carries only sku and qty) turns reservations into sales.
CREATE TABLE inventory_orders (
    tenant_id   text NOT NULL,
    order_id    uuid NOT NULL,
    location    text NOT NULL,
    event_id    uuid NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id)
);

-- qty is the movement as the business reads it (receipt +48, reserve 2,
-- sale -2); on_hand_delta / reserved_delta are its exact effect on the level.
-- shortage > 0 flags a reservation beyond what was available.
CREATE TABLE stock_movements (
    movement_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       text   NOT NULL,
    sku             text   NOT NULL,
    location        text   NOT NULL,
    movement_type   text   NOT NULL CHECK (movement_type IN ('receipt', 'reserve', 'sale')),
    qty             bigint NOT NULL,
    on_hand_delta   bigint NOT NULL,
    reserved_delta  bigint NOT NULL,
    shortage        bigint NOT NULL DEFAULT 0 CHECK (shortage >= 0),
    order_id        uuid,
    receipt_id      text,
    event_id        uuid,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((movement_type = 'receipt') = (receipt_id IS NOT NULL)),
    CHECK (movement_type = 'receipt' OR (order_id IS NOT NULL AND event_id IS NOT NULL)),
    FOREIGN KEY (tenant_id, sku, location) REFERENCES stock_levels (tenant_id, sku, location)
);
CREATE INDEX stock_movements_level_idx ON stock_movements (tenant_id, sku, location, movement_id);
CREATE INDEX stock_movements_order_idx ON stock_movements (tenant_id, order_id) WHERE order_id IS NOT NULL;
-- One movement per (event, sku, location): an event can never move stock twice.
CREATE UNIQUE INDEX stock_movements_event_uq ON stock_movements (tenant_id, event_id, sku, location)
    WHERE event_id IS NOT NULL;
CREATE UNIQUE INDEX stock_movements_receipt_uq ON stock_movements (tenant_id, receipt_id)
    WHERE receipt_id IS NOT NULL;
