-- A consumer spread over partition queues (`consume --partitions N`) reads <queue>.0 … <queue>.<N-1>, not <queue>:
-- `stats` and `top` sum those queues' depths. NULL: one queue, named `queue`.
ALTER TABLE inboxctl_consumers ADD COLUMN IF NOT EXISTS partitions INTEGER NULL;
