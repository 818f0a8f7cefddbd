-- What `cleanup` looks for in inboxctl_effects: the calls done, by when they were settled, per consumer_type. Their
-- record goes with the retention window, as the inbox rows do; calls owed, started, in doubt or failed stay (they
-- are not in this index) until they are settled.
CREATE INDEX IF NOT EXISTS ix_inboxctl_effects_done ON inboxctl_effects (consumer_type, updated_at)
    WHERE state = 'done';
