-- no-transaction
-- The dashboard's unprocessed figures per consumer_type: how many, and since when. The seed's partial index is on
-- received_at alone, so finding one consumer_type's oldest unprocessed row walks every other consumer_type's
-- unprocessed rows first (measured by `inboxctl bench --cleanup-rows 10000000`: over a second when another
-- consumer_type has 100k unprocessed rows). Partial, so it holds only unprocessed rows: empty for inboxctl's own
-- consumers, which never leave one. Concurrently, for large live tables; `migrate` drops an invalid leftover first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_inbox_messages_unprocessed_by_consumer_type
    ON inbox_messages (consumer_type, received_at) WHERE processed_at IS NULL
