-- The fingerprint (a hash of the event) each message was claimed with, per consumer_type: a later copy whose event
-- differs is a message id reused for another message (a producer bug), reported as a conflict rather than discarded
-- silently as a duplicate. A table of inboxctl's own beside inbox_messages, which is never altered (it may be a .NET
-- service's). Written by the claim's statement, deleted with its inbox row by `cleanup`; keyed like the inbox.
CREATE TABLE IF NOT EXISTS inboxctl_fingerprints (
    id            UUID         NOT NULL,
    consumer_type VARCHAR(500) NOT NULL,
    fingerprint   BYTEA        NOT NULL,
    PRIMARY KEY (id, consumer_type)
);
