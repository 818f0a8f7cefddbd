-- Starts of redelivered messages that have not reached an outcome yet, per consumer_type. A message whose every
-- attempt ends its consumer process (an abort, a crash outside the per-message guard, an out-of-memory kill) is
-- recognised by its count here and moved to the error queue, instead of taking the consumer down forever. Only a
-- redelivered message gets a row, from its start to its outcome: a first delivery costs nothing. A message in flight
-- at an earlier end is tried alone; only starts made alone count against it, so a healthy message that was merely
-- in flight beside the culprit is never moved aside.
CREATE TABLE IF NOT EXISTS inboxctl_attempts (
    consumer_type   VARCHAR(500) NOT NULL,
    message_id      UUID         NOT NULL,
    started         INTEGER      NOT NULL,
    -- Of them, the starts made alone (nothing else in flight in its process): only these can convict a message.
    alone           INTEGER      NOT NULL DEFAULT 0,
    last_started_at TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_type, message_id)
);
