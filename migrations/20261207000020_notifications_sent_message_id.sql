-- no-transaction
-- The same look-up's other table (see migration 19): the notifications sent, by message id, built concurrently.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_notifications_sent_message_id
    ON notifications_sent (message_id)
