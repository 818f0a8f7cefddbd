-- no-transaction
-- What `stats` and `top` count of each consumer_type's calls in doubt and failed, every refresh: those stay until an
-- operator settles them, and a carrier's outage can leave millions. Through this index each count stops where it is
-- capped, and the oldest in doubt is the first entry of its state, rather than a walk of every call not done. The
-- calls started (in flight, few) are in it too: an at-most-once one past its lease is in doubt, found without a walk
-- of a backlog of calls owed.
-- CONCURRENTLY, so that adding it beside live consumers does not hold their claims' writes; hence outside a
-- transaction, and alone in its file. `migrate` drops an invalid leftover of an interrupted build first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_inboxctl_effects_unsettled
    ON inboxctl_effects (consumer_type, state, created_at)
    WHERE state IN ('started', 'in_doubt', 'failed');
