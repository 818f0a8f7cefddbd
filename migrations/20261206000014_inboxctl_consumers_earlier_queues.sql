-- The queues (each with its vhost) a consumer_type's consumers read before the one they read now: `cleanup` looks
-- for the dead-lettered messages a replay may still bring back in each one's `<queue>_error` and `<queue>_skipped`
-- too. A consumer_type moved to another queue (a quorum queue in place of a classic one, another vhost) leaves its
-- failed messages in the old queue's; looked for only in the new one's, their inbox rows could be deleted. A JSON
-- array of {"queue", "vhost"}, each pair once: its length is the number of queues a consumer_type ever moved from.
ALTER TABLE inboxctl_consumers ADD COLUMN IF NOT EXISTS earlier_queues JSONB NOT NULL DEFAULT '[]';
