-- no-transaction
-- What `top`'s detail and `find` read of a consumer_type's failures (failed attempts, dead-lettered, skipped,
-- conflicts), newest first: through the index of all its events, a walk past every duplicate discarded since the last
-- failure — millions of them on a busy consumer_type whose upstream re-sends, on every look. The failures are few; an
-- index of them alone is small, and costs nothing per duplicate. CONCURRENTLY, so that adding it beside live
-- consumers does not hold their events' writes; hence outside a transaction, and alone in its file. `migrate` drops
-- an invalid leftover of an interrupted build first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_inboxctl_events_failures
    ON inboxctl_events (consumer_type, occurred_at)
    WHERE kind IN ('failed', 'dead_lettered', 'skipped', 'conflict');
