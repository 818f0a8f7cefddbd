-- The Parcel Tracker consumers' effects. Deliberately no unique constraint on parcel_id: a double effect must stay
-- visible to anyone who counts rows, not be hidden by a constraint.
CREATE TABLE IF NOT EXISTS carrier_reservations (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    parcel_id       UUID        NOT NULL,
    slot_id         UUID        NOT NULL,
    pickup_at       TIMESTAMPTZ NOT NULL,
    message_id      UUID        NOT NULL,
    -- Derived from (message id, consumer_type): what a real carrier API that honours idempotency keys would get.
    idempotency_key UUID        NOT NULL,
    reserved_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS ix_carrier_reservations_parcel_id ON carrier_reservations (parcel_id);

CREATE TABLE IF NOT EXISTS notifications_sent (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    parcel_id       UUID        NOT NULL,
    tracking_number TEXT        NOT NULL,
    body            TEXT        NOT NULL,
    message_id      UUID        NOT NULL,
    idempotency_key UUID        NOT NULL,
    sent_at         TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS ix_notifications_sent_parcel_id ON notifications_sent (parcel_id);
