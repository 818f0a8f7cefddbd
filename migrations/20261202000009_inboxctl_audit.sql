-- Every operator action that changed state — migrate, each cleanup run, replay, a consumer's start and stop — with who
-- did it and what came of it. Written in a statement of its own after (or, for a consumer, at the start of) the
-- action, never in the action's transaction: an audit that cannot be written never undoes the work, and the command
-- says so. `cleanup` deletes these rows only with a retention of their own (`--audit-retention`, 90 days by default).
CREATE TABLE IF NOT EXISTS inboxctl_audit (
    id            BIGINT       GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    occurred_at   TIMESTAMPTZ  NOT NULL DEFAULT now(),
    -- migrate | cleanup | replay | consume
    command       TEXT         NOT NULL,
    -- The database role the command ran as (current_user) and the operating system's user and host.
    database_role TEXT         NOT NULL DEFAULT current_user,
    os_user       TEXT         NULL,
    host          TEXT         NULL,
    -- The command line, passwords masked.
    command_line  TEXT         NOT NULL,
    -- done | partial | failed | started | stopped
    outcome       TEXT         NOT NULL,
    exit_code     INTEGER      NULL,
    -- What it did: counts, groups, consumer_types, the error.
    details       JSONB        NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS ix_inboxctl_audit_occurred_at ON inboxctl_audit (occurred_at);
