-- no-transaction
-- What each consumer's effects worker looks for every 200 ms (the calls due to be leased) and marks in doubt: the
-- calls owed or started. The index of the open calls (migration 11) holds the failed and in-doubt ones too, which
-- stay until an operator settles them; after a carrier's outage left 100,000 of them, each poll walked them all
-- (a sequential scan of ~13 ms, measured on this project's machine; ~0.05 ms with this index). CONCURRENTLY, so that
-- adding it beside a live consumer does not hold its claims' writes; hence outside a transaction, and alone in its
-- file. `migrate` drops an invalid leftover of an interrupted build first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_inboxctl_effects_owed
    ON inboxctl_effects (consumer_type, created_at)
    WHERE state IN ('pending', 'started');
