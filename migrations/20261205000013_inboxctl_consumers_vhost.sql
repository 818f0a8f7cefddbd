-- The RabbitMQ vhost a consumer_type's consumer reads its queue in: `cleanup` looks for the dead-lettered messages
-- a replay may still bring back in that consumer's `<queue>_error` and `<queue>_skipped`, and a look in another vhost
-- finds none there (they do not exist), which would let it delete the rows those replays need. NULL: registered by
-- a version that did not record it.
ALTER TABLE inboxctl_consumers ADD COLUMN IF NOT EXISTS vhost TEXT NULL;
