-- Calls to the outside world made after the claim's commit (`consume carrier --carrier-url … --effect-mode
-- after-commit|at-most-once`), and the record of those made inside it (keyed): one row per (message, consumer_type),
-- written in the claim's transaction, so a committed claim always has its call on record.
--   pending  — owed: a consumer process makes the call when lease_until (if any) has passed;
--   started  — a process leased it (until lease_until) and is making the call; past the lease, after-commit calls
--              again (after a look-up if it has one), at-most-once never does: the call is in doubt;
--   in_doubt — the call may or may not have been made (at-most-once): an operator or `effects reconcile` settles it;
--   done     — made, its reference (the carrier's slot id) kept;
--   failed   — refused every attempt (after --max-attempts), or its outcome was unknown that often.
CREATE TABLE IF NOT EXISTS inboxctl_effects (
    message_id      UUID         NOT NULL,
    consumer_type   VARCHAR(500) NOT NULL,
    idempotency_key UUID         NOT NULL,
    mode            TEXT         NOT NULL CHECK (mode IN ('keyed', 'after-commit', 'at-most-once')),
    state           TEXT         NOT NULL CHECK (state IN ('pending', 'started', 'in_doubt', 'done', 'failed')),
    request         JSONB        NOT NULL,
    attempts        INTEGER      NOT NULL DEFAULT 0,
    lease_until     TIMESTAMPTZ  NULL,
    last_error      TEXT         NULL,
    reference       TEXT         NULL,
    created_at      TIMESTAMPTZ  NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ  NOT NULL DEFAULT now(),
    CONSTRAINT pk_inboxctl_effects PRIMARY KEY (message_id, consumer_type)
);
-- What the consumers' workers, `effects`, `stats` and `top` look for: the rows not done, per consumer_type. Done rows,
-- nearly all of them, are not in it.
CREATE INDEX IF NOT EXISTS ix_inboxctl_effects_open ON inboxctl_effects (consumer_type, created_at)
    WHERE state IN ('pending', 'started', 'in_doubt', 'failed');

-- How each consumer makes its calls, and how long the API it calls keeps idempotency keys (keyed): `replay` warns
-- about messages older than that. NULL: no calls outside the database (the stand-in that writes a row).
ALTER TABLE inboxctl_consumers ADD COLUMN IF NOT EXISTS effect_mode TEXT NULL;
ALTER TABLE inboxctl_consumers ADD COLUMN IF NOT EXISTS effect_key_ttl INTERVAL NULL;
