-- inboxctl's own bookkeeping, beside the users' schema (hence the inboxctl_ prefix).
--
-- Counters without a hot row: every event is a row of its own, inserted in the transaction that decided it (a
-- duplicate is recorded by the statement that discarded it), so a SIGKILL can never lose or double one. Processed
-- messages need no row here: they are the inbox rows themselves. `cleanup` prunes old events with the inbox rows.
CREATE TABLE IF NOT EXISTS inboxctl_events (
    consumer_type VARCHAR(500) NOT NULL,
    -- 'duplicate' | 'failed' (an attempt failed and will be retried) | 'dead_lettered' | 'skipped'
    kind          TEXT         NOT NULL,
    message_id    UUID         NULL,
    occurred_at   TIMESTAMPTZ  NOT NULL DEFAULT now(),
    detail        TEXT         NULL
);
CREATE INDEX IF NOT EXISTS ix_inboxctl_events_consumer_type_occurred_at ON inboxctl_events (consumer_type, occurred_at);
CREATE INDEX IF NOT EXISTS ix_inboxctl_events_message_id ON inboxctl_events (message_id);

-- One row per consumer_type an inboxctl consumer has run as: which queue it reads, when it was last started. A
-- consumer_type missing here was written by someone else (a .NET service), so its rates are unknown, not zero.
CREATE TABLE IF NOT EXISTS inboxctl_consumers (
    consumer_type VARCHAR(500) NOT NULL PRIMARY KEY,
    queue         TEXT         NOT NULL,
    first_seen_at TIMESTAMPTZ  NOT NULL,
    last_seen_at  TIMESTAMPTZ  NOT NULL
);
