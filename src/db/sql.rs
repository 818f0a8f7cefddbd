//! Helpers the store's areas share, and the statements of `inboxctl bench`, which stay here until the bench leaves
//! the library. Every statement the product sends lives in its area (`db::claim`, `db::cleanup`, …) beside the
//! function that binds it; the bench's are not part of [`super::statements`] (they address tables and views the
//! migrations do not make, such as the peer's `inbox`).

/// An identifier quoted for PostgreSQL: wrapped in double quotes, inner double quotes doubled.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

// The store's statements the bench runs on its own, re-exported under their old names for it.
pub use super::claim::CLAIM;
pub use super::effects::INSERT_CARRIER_RESERVATION;
pub use super::events::REGISTER_CONSUMER;
pub use super::stats::{
    COUNT_ROWS_CAPPED, COUNT_UNPROCESSED_CAPPED, EVENT_SERIES, INBOX_CONSUMER_TYPES,
    INBOX_ESTIMATES, OLDEST_UNPROCESSED_AGE, PROCESSED_SERIES,
};

/// The PostgreSQL server version, as the server reports it.
pub const SERVER_VERSION: &str = "SELECT current_setting('server_version')";

/// `inboxctl bench` on its scratch databases: empty the tables between runs.
pub const BENCH_TRUNCATE: &str =
    "TRUNCATE inbox_messages, inboxctl_fingerprints, carrier_reservations, inboxctl_events";

/// The peer mode's own inbox table (pg-transactional-outbox's `inbox`, made by its set-up).
pub const BENCH_TRUNCATE_PEER: &str = "TRUNCATE inbox";

/// Effects and the seconds from the first to the last.
pub const BENCH_EFFECT_SPAN: &str = "SELECT count(*), extract(epoch FROM max(reserved_at) - min(reserved_at))::float8 FROM carrier_reservations";

/// Effects of a set of messages. `$1` message ids.
pub const BENCH_COUNT_EFFECTS_FOR: &str =
    "SELECT count(*) FROM carrier_reservations WHERE message_id = ANY($1)";

/// When each message's effect was written. `$1` message ids.
pub const BENCH_EFFECT_TIMES: &str =
    "SELECT message_id, reserved_at FROM carrier_reservations WHERE message_id = ANY($1)";

/// Effects and distinct parcels: the difference is the duplicate effects.
pub const BENCH_DUPLICATE_EFFECTS: &str =
    "SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations";

/// `inboxctl bench --cleanup-rows`: `$2` inbox rows numbered from `$1` of `$4` in all, spread over the
/// consumer_types `$3` in turn, as a real inbox is (each message gets a row per consumer_type it reaches). Received and
/// processed in the order of their numbers over the last 14 days, so the older half is past a 7-day window and lies in
/// the first half of the heap, as in a table that has been filling for two weeks; one row in a hundred never
/// processed, spread over the consumer_types. Ids are time-ordered, as real message ids (MassTransit's, UUIDv7) are.
pub const BENCH_SEED_ROWS: &str = "\
INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
       ($3::text[])[1 + g % cardinality($3::text[])],
       t,
       CASE WHEN (g / cardinality($3::text[])) % 100 = 0 THEN NULL ELSE t END
FROM generate_series($1 + 1, $1 + $2) AS g,
     LATERAL (SELECT now() - interval '14 days' + (g::float8 / $4::float8) * interval '14 days' AS t) AS x";

/// WAL position (bytes) and checkpoints forced so far, server-wide.
pub const BENCH_WAL_AND_CHECKPOINTS: &str = "\
SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::float8, checkpoints_req FROM pg_stat_bgwriter";

/// Rows a cleanup with a retention of `$1` seconds deletes.
pub const BENCH_COUNT_DELETABLE: &str =
    "SELECT count(*) FROM inbox_messages WHERE processed_at < now() - make_interval(secs => $1)";

/// The peers' cleanup: one statement for everything past the window.
pub const BENCH_PLAIN_DELETE: &str =
    "DELETE FROM inbox_messages WHERE processed_at < now() - make_interval(secs => $1)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("parceltracker"), "\"parceltracker\"");
        assert_eq!(
            quote_ident("a\"; DROP TABLE x; --"),
            "\"a\"\"; DROP TABLE x; --\""
        );
    }
}
