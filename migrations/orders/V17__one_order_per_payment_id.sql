-- A provider's payment is recorded on one order of its tenant: the same
-- payment_id on a second order would book the same money twice (the
-- ledger's Cash and the order's status). order-api answers such a request
-- 409 payment_already_recorded, naming the order that holds it (stored with
-- its key); this index is the database's word on it, also for two such
-- requests at once on different orders (their order locks do not meet).
--
-- Built here, blocking writes to payments while it builds: on a large live
-- orders database build it by hand first (`CREATE UNIQUE INDEX CONCURRENTLY
-- IF NOT EXISTS payments_one_order_per_payment_id ON payments (tenant_id,
-- payment_id)`), and this migration finds it and checks that it is what it
-- would have built (V9's check). If payments already share an id, the build
-- fails naming the duplicate key: deploy/README.md has the query that lists
-- them and what to do.
CREATE UNIQUE INDEX IF NOT EXISTS payments_one_order_per_payment_id
    ON payments (tenant_id, payment_id);
DO $$
DECLARE
    as_built boolean;
BEGIN
    SELECT i.indisvalid AND i.indisunique AND i.indimmediate
           AND i.indnatts = i.indnkeyatts AND i.indpred IS NULL AND i.indexprs IS NULL
           AND i.indrelid = 'payments'::regclass
           AND ARRAY(SELECT a.attname::text
                       FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k (attnum, n)
                       JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                      ORDER BY k.n) = ARRAY['tenant_id', 'payment_id']
      INTO as_built
      FROM pg_index i
     WHERE i.indexrelid = to_regclass('payments_one_order_per_payment_id');
    IF as_built IS DISTINCT FROM true THEN
        RAISE EXCEPTION 'index payments_one_order_per_payment_id is not a valid unique index '
                        'on payments(tenant_id, payment_id): drop it and build it again';
    END IF;
END
$$;
