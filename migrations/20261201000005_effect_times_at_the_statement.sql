-- The effects' timestamps are taken when the row is written, not when its transaction began: in a batch, one
-- transaction holds many messages, and `inboxctl bench` measures latency from publish to the effect's own write.
ALTER TABLE carrier_reservations ALTER COLUMN reserved_at SET DEFAULT clock_timestamp();
ALTER TABLE notifications_sent ALTER COLUMN sent_at SET DEFAULT clock_timestamp();
