-- no-transaction
-- The index cleanup's batches and stats' per-consumer counts need: rows of one consumer_type by processed_at.
-- The seed's partial index serves unprocessed rows only; without this one, each cleanup batch scans the whole table
-- (measured by scripts/cleanup-index.sh: 2M rows, 6k deletable, one batch of up to 5,000 rows: ~290 ms without,
-- ~13 ms with). CONCURRENTLY, so that adding it to a large live table does not block the consumers' inserts; hence
-- outside a transaction, and alone in its file. `migrate` drops an invalid leftover of an interrupted build first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_inbox_messages_consumer_type_processed_at
    ON inbox_messages (consumer_type, processed_at)
