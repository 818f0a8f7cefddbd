//! The bench's own statements, on its scratch databases (inboxctl's are in its store, and the bench reaches them only
//! through the library's functions).

/// The PostgreSQL server version, as the server reports it.
pub const SERVER_VERSION: &str = "SELECT current_setting('server_version')";

pub const SYNCHRONOUS_COMMIT: &str = "SELECT current_setting('synchronous_commit')";

pub const SERVER_VERSION_NUM: &str = "SELECT current_setting('server_version_num')::int";

/// The tutorial's look-up before its transaction. `$1` message id, `$2` consumer_type.
pub const TUTORIAL_LOOKUP: &str =
    "SELECT EXISTS (SELECT 1 FROM inbox_messages WHERE id = $1 AND consumer_type = $2)";

/// Set on the tutorial's scratch database (`{}`: its quoted name): its sessions plan each statement with its values,
/// as EF Core's unprepared statements through Npgsql are planned. A prepared look-up is planned once for good, and
/// PostgreSQL keeps the plan it chose while the table was empty (just truncated, as before every run): the
/// `(consumer_type, processed_at)` index, scanning every row of the consumer_type for each look-up, until
/// autovacuum's ANALYZE happens to invalidate it. That plan was the tutorial mode's stall (186–1,561 msg/s over
/// runs, its backends busy on the look-up).
pub const TUTORIAL_PLANNING: &str = "ALTER DATABASE {} SET plan_cache_mode = force_custom_plan";

/// The tutorial's plain insert of the inbox row. `$1` message id, `$2` consumer_type.
pub const TUTORIAL_INSERT: &str =
    "INSERT INTO inbox_messages (id, consumer_type, received_at) VALUES ($1, $2, now())";

/// Empty the tables between runs.
pub const TRUNCATE: &str =
    "TRUNCATE inbox_messages, inboxctl_fingerprints, carrier_reservations, inboxctl_events";

/// `TRUNCATE` for a prefilled inbox (`--inbox-rows`): the rows the runs added go, the prefilled ones (consumer_type
/// `prefilled`) stay. Two ranges rather than `<>`, so that the `(consumer_type, processed_at)` index finds the
/// runs' rows instead of a scan of every prefilled one.
pub const TRUNCATE_KEEPING_PREFILL: &str = "\
DELETE FROM inbox_messages WHERE consumer_type < 'prefilled' OR consumer_type > 'prefilled';
TRUNCATE inboxctl_fingerprints, carrier_reservations, inboxctl_events";

/// The prefilled rows' id, of the kind `$4` made from the row's time `t`, its hash `h` and its .NET `ticks` (see
/// `PREFILL_ROWS`).
macro_rules! prefill_id {
    () => {
        "SELECT CASE $4
         WHEN 'v4' THEN gen_random_uuid()
         WHEN 'v7' THEN (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0')
                         || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid
         ELSE (encode($5::bytea, 'hex') || lpad(to_hex(ticks & 65535), 4, '0')
               || lpad(to_hex(ticks >> 16), 12, '0'))::uuid
       END,
"
    };
}

/// The prefilled rows `$1 + 1` to `$1 + $2` of `$3`, with their time `t` over the 7 days before now, hash and ticks.
macro_rules! prefill_rows {
    () => {
        "FROM generate_series($1 + 1, $1 + $2) AS g,
     LATERAL (SELECT now() - interval '7 days' + (g::float8 / $3::float8) * interval '7 days' AS t) AS x,
     LATERAL (SELECT md5(g::text) AS h,
                     (extract(epoch FROM t) * 10000000)::bigint + 621355968000000000 + g % 10000 AS ticks) AS y"
    };
}

/// `--inbox-rows`: `$2` processed inbox rows numbered from `$1` of `$3` in all, received over the 7 days before now in
/// the order of their numbers, their ids of the kind `$4` (`v4`, `v7`, `newid`) made from that time as a producer
/// would have: random; UUIDv7 (milliseconds first); MassTransit's NewId (the process part `$5`, 8 bytes, then the low
/// 16 bits of its .NET ticks, then the high 48).
pub const PREFILL_ROWS: &str = concat!(
    "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)\n",
    prefill_id!(),
    "       'prefilled', t, t\n",
    prefill_rows!()
);

/// The same rows in a partitioned inbox (`--inbox-partitioned`): each also keyed on its time (`message_time`, the
/// time inside its id; kept in that day's partition) with a fingerprint in the row, as inboxctl's claim writes them.
pub const PREFILL_ROWS_PARTITIONED: &str = concat!(
    "INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time, fingerprint)\n",
    prefill_id!(),
    "       'prefilled', t, t, t, decode(h, 'hex')\n",
    prefill_rows!()
);

/// The peer mode's own inbox table (pg-transactional-outbox's `inbox`, made by its set-up).
pub const TRUNCATE_PEER: &str = "TRUNCATE inbox";

/// Effects and the seconds from the first to the last.
pub const EFFECT_SPAN: &str = "SELECT count(*), extract(epoch FROM max(reserved_at) - min(reserved_at))::float8 FROM carrier_reservations";

/// Effects of a set of messages. `$1` message ids.
pub const COUNT_EFFECTS_FOR: &str =
    "SELECT count(*) FROM carrier_reservations WHERE message_id = ANY($1)";

/// When each message's effect was written. `$1` message ids.
pub const EFFECT_TIMES: &str =
    "SELECT message_id, reserved_at FROM carrier_reservations WHERE message_id = ANY($1)";

/// Effects and distinct parcels: the difference is the duplicate effects.
pub const DUPLICATE_EFFECTS: &str =
    "SELECT count(*), count(DISTINCT parcel_id) FROM carrier_reservations";

/// `--cleanup-rows`: `$2` inbox rows numbered from `$1` of `$4` in all, spread over the consumer_types `$3` in turn,
/// as a real inbox is (each message gets a row per consumer_type it reaches). Received and processed in the order of
/// their numbers over the last 14 days, so the older half is past a 7-day window and lies in the first half of the
/// heap, as in a table that has been filling for two weeks; one row in a hundred never processed, spread over the
/// consumer_types. Ids are time-ordered, as real message ids (MassTransit's, UUIDv7) are.
pub const SEED_ROWS: &str = "\
INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at)
SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
       ($3::text[])[1 + g % cardinality($3::text[])],
       t,
       CASE WHEN (g / cardinality($3::text[])) % 100 = 0 THEN NULL ELSE t END
FROM generate_series($1 + 1, $1 + $2) AS g,
     LATERAL (SELECT now() - interval '14 days' + (g::float8 / $4::float8) * interval '14 days' AS t) AS x";

/// The same rows for a partitioned inbox (`migrate --partitioned 1d`): each keyed on its time `t` (`message_time`)
/// and kept in that day's partition, its fingerprint in the row; rows never processed only in the last day (work in
/// flight: inboxctl's consumers set `processed_at`, so no older partition holds one, and every partition past the
/// window can go whole).
pub const SEED_ROWS_PARTITIONED: &str = "\
INSERT INTO inbox_messages (id, consumer_type, received_at, processed_at, message_time, fingerprint)
SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
       ($3::text[])[1 + g % cardinality($3::text[])],
       t,
       CASE WHEN (g / cardinality($3::text[])) % 100 = 0 AND t > now() - interval '1 day' THEN NULL ELSE t END,
       t,
       decode(md5(g::text), 'hex')
FROM generate_series($1 + 1, $1 + $2) AS g,
     LATERAL (SELECT now() - interval '14 days' + (g::float8 / $4::float8) * interval '14 days' AS t) AS x";

/// Flushes every dirty page, so that a run does not pay for what came before it (the role may not be allowed to).
pub const CHECKPOINT: &str = "CHECKPOINT";

/// After a template's rows are in: hint bits and the visibility map set, the planner's statistics fresh.
pub const VACUUM_INBOX: &str = "VACUUM ANALYZE inbox_messages";

/// Marks a template as complete (`{}`: the marker, made by the bench from a number and an id kind: no quote in it).
pub const MARK_TEMPLATE: &str = "COMMENT ON TABLE inbox_messages IS '{}'";

/// What the template's table comment says, if anything.
pub const TEMPLATE_MARKER: &str =
    "SELECT obj_description(to_regclass('inbox_messages'), 'pg_class')";

/// WAL position (bytes) and checkpoints forced so far, server-wide.
pub const WAL_AND_CHECKPOINTS: &str = "\
SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::float8, checkpoints_req FROM pg_stat_bgwriter";

/// Rows a cleanup with a retention of `$1` seconds deletes.
pub const COUNT_DELETABLE: &str =
    "SELECT count(*) FROM inbox_messages WHERE processed_at < now() - make_interval(secs => $1)";

/// The peers' cleanup: one statement for everything past the window.
pub const PLAIN_DELETE: &str =
    "DELETE FROM inbox_messages WHERE processed_at < now() - make_interval(secs => $1)";
