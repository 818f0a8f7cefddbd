-- The inbox exactly as users already have it (the tutorial's DDL; EF Core creates the same table with its key named
-- "PK_inbox_messages"). IF NOT EXISTS: an existing table is adopted as it is, after `inboxctl migrate` has checked
-- that its columns and key are the ones below.
CREATE TABLE IF NOT EXISTS inbox_messages (
    id            UUID          NOT NULL,
    consumer_type VARCHAR(500)  NOT NULL,
    received_at   TIMESTAMPTZ   NOT NULL,
    processed_at  TIMESTAMPTZ   NULL,
    CONSTRAINT pk_inbox_messages PRIMARY KEY (id, consumer_type)
);

CREATE INDEX IF NOT EXISTS ix_inbox_messages_unprocessed ON inbox_messages (received_at) WHERE processed_at IS NULL;
