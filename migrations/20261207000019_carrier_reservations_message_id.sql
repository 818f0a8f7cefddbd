-- no-transaction
-- `find` looks up a message's effects by its id. The effect tables are never pruned (a reservation outlives its inbox
-- row), and their only index was the parcel's: each id looked up read the whole table, hundreds of millions of rows in
-- a fleet's lifetime. CONCURRENTLY, so that adding it beside live consumers does not hold their writes; hence outside
-- a transaction, and alone in its file. `migrate` drops an invalid leftover of an interrupted build first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_carrier_reservations_message_id
    ON carrier_reservations (message_id)
