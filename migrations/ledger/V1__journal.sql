-- Ledger: a double-entry journal per tenant. Entries are immutable (corrections
-- are reversing entries) and balanced, both enforced by the database itself.

CREATE TABLE ledger_accounts (
    tenant_id   text NOT NULL,
    code        text NOT NULL,
    name        text NOT NULL,
    kind        text NOT NULL CHECK (kind IN ('asset', 'liability', 'revenue', 'expense')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, code)
);

-- The order terms from OrderPlaced: a delivery is posted from them.
CREATE TABLE ledger_orders (
    tenant_id        text   NOT NULL,
    order_id         uuid   NOT NULL,
    customer_id      text   NOT NULL,
    currency         text   NOT NULL,
    merchandise      bigint NOT NULL CHECK (merchandise >= 0),
    shipping         bigint NOT NULL CHECK (shipping >= 0),
    tax              bigint NOT NULL CHECK (tax >= 0),
    total            bigint NOT NULL CHECK (total >= 0),
    cost_of_goods    bigint NOT NULL CHECK (cost_of_goods >= 0),
    placed_event_id  uuid   NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id)
);

CREATE TABLE journal_entries (
    entry_id     uuid PRIMARY KEY,
    tenant_id    text NOT NULL,
    order_id     uuid NOT NULL,
    event_id     uuid NOT NULL,
    event_type   text NOT NULL,
    description  text NOT NULL,
    currency     text NOT NULL,
    posted_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, event_id)
);
CREATE INDEX journal_entries_order_idx ON journal_entries (tenant_id, order_id, posted_at);

CREATE TABLE journal_lines (
    entry_id      uuid   NOT NULL REFERENCES journal_entries (entry_id),
    line_no       int    NOT NULL CHECK (line_no >= 1),
    tenant_id     text   NOT NULL,
    account_code  text   NOT NULL,
    debit         bigint NOT NULL DEFAULT 0 CHECK (debit >= 0),
    credit        bigint NOT NULL DEFAULT 0 CHECK (credit >= 0),
    CHECK ((debit > 0) <> (credit > 0)),
    PRIMARY KEY (entry_id, line_no),
    FOREIGN KEY (tenant_id, account_code) REFERENCES ledger_accounts (tenant_id, code)
);
CREATE INDEX journal_lines_account_idx ON journal_lines (tenant_id, account_code);

-- Immutable: no UPDATE, DELETE or TRUNCATE of posted entries and lines.
CREATE FUNCTION journal_reject_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'journal is immutable: % on % is not allowed (post a reversing entry instead)',
        TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'integrity_constraint_violation';
END;
$$;
CREATE TRIGGER journal_entries_immutable BEFORE UPDATE OR DELETE ON journal_entries
    FOR EACH ROW EXECUTE FUNCTION journal_reject_change();
CREATE TRIGGER journal_lines_immutable BEFORE UPDATE OR DELETE ON journal_lines
    FOR EACH ROW EXECUTE FUNCTION journal_reject_change();
CREATE TRIGGER journal_entries_no_truncate BEFORE TRUNCATE ON journal_entries
    FOR EACH STATEMENT EXECUTE FUNCTION journal_reject_change();
CREATE TRIGGER journal_lines_no_truncate BEFORE TRUNCATE ON journal_lines
    FOR EACH STATEMENT EXECUTE FUNCTION journal_reject_change();

-- Balanced: checked at commit (deferred), once all lines of the entry exist.
-- Fires for a new entry (no lines at all is unbalanced) and for every new line.
CREATE FUNCTION journal_check_balanced() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    debits  numeric;
    credits numeric;
    lines   bigint;
BEGIN
    SELECT coalesce(sum(debit), 0), coalesce(sum(credit), 0), count(*)
      INTO debits, credits, lines
      FROM journal_lines WHERE entry_id = NEW.entry_id;
    IF lines < 2 OR debits <> credits THEN
        RAISE EXCEPTION 'journal entry % is not balanced: debits %, credits %, % line(s)',
            NEW.entry_id, debits, credits, lines
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER journal_entries_balanced AFTER INSERT ON journal_entries
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION journal_check_balanced();
CREATE CONSTRAINT TRIGGER journal_lines_balanced AFTER INSERT ON journal_lines
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION journal_check_balanced();
