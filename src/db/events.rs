//! inboxctl's own bookkeeping beside the inbox: the events of its consumers (`inboxctl_events`) and the consumers
//! that ran (`inboxctl_consumers`), which `stats` and `top` read.

use uuid::Uuid;

use super::{Exec, sql};
use crate::inbox::ConsumerType;

statements! {
    /// Records one event of a consumer (`failed`, `dead_lettered`, `skipped`) in a statement of its own.
    /// `$1` consumer_type, `$2` kind, `$3` message id (null when the message had none), `$4` detail.
    const RECORD_EVENT = "\
INSERT INTO inboxctl_events (consumer_type, kind, message_id, detail) VALUES ($1, $2, $3, $4)";

    /// Registers a consumer process's consumer_type and queue, so `stats` knows which consumer_types have counters
    /// and which queue each reads, and `cleanup` in which vhost. `$1` consumer_type, `$2` queue, `$3` its partitions
    /// (null: not partitioned), `$4` the vhost. The queue and vhost it read before, when they were others, are kept
    /// (once each) in `earlier_queues`: `cleanup` looks in their dead-letter queues too. The same queue with no vhost
    /// recorded (a row the effect mode's registration made first, or an earlier version's) is not another.
    pub const REGISTER_CONSUMER = "\
INSERT INTO inboxctl_consumers AS c (consumer_type, queue, partitions, vhost, first_seen_at, last_seen_at)
VALUES ($1, $2, $3, $4, now(), now())
ON CONFLICT (consumer_type) DO UPDATE
SET queue = EXCLUDED.queue, partitions = EXCLUDED.partitions, vhost = EXCLUDED.vhost, last_seen_at = now(),
    earlier_queues = CASE
        WHEN (c.queue = EXCLUDED.queue AND (c.vhost IS NULL OR c.vhost IS NOT DISTINCT FROM EXCLUDED.vhost))
          OR c.earlier_queues @> jsonb_build_array(jsonb_build_object('queue', c.queue, 'vhost', c.vhost))
        THEN c.earlier_queues
        ELSE c.earlier_queues || jsonb_build_array(jsonb_build_object('queue', c.queue, 'vhost', c.vhost))
    END";

    /// `REGISTER_CONSUMER` on a database migrated before consumers kept their earlier queues (migration 14).
    const REGISTER_CONSUMER_WITHOUT_EARLIER = "\
INSERT INTO inboxctl_consumers (consumer_type, queue, partitions, vhost, first_seen_at, last_seen_at)
VALUES ($1, $2, $3, $4, now(), now())
ON CONFLICT (consumer_type) DO UPDATE
SET queue = EXCLUDED.queue, partitions = EXCLUDED.partitions, vhost = EXCLUDED.vhost, last_seen_at = now()";

    /// `REGISTER_CONSUMER` on a database migrated before consumers recorded their vhost (migration 13).
    const REGISTER_CONSUMER_WITHOUT_VHOST = "\
INSERT INTO inboxctl_consumers (consumer_type, queue, partitions, first_seen_at, last_seen_at)
VALUES ($1, $2, $3, now(), now())
ON CONFLICT (consumer_type) DO UPDATE SET queue = EXCLUDED.queue, partitions = EXCLUDED.partitions, last_seen_at = now()";

    /// Records how a consumer_type calls the outside world: `$1` consumer_type, `$2` its queue, `$3` effect mode,
    /// `$4` how long its API keeps idempotency keys, in seconds.
    const REGISTER_EFFECT_MODE = "\
INSERT INTO inboxctl_consumers (consumer_type, queue, first_seen_at, last_seen_at, effect_mode, effect_key_ttl)
VALUES ($1, $2, now(), now(), $3, make_interval(secs => $4))
ON CONFLICT (consumer_type) DO UPDATE SET effect_mode = EXCLUDED.effect_mode, effect_key_ttl = EXCLUDED.effect_key_ttl";

    /// The keyed consumers reading queue `$1` and how long their APIs keep keys, in seconds (`replay`'s warning).
    const KEYED_CONSUMERS_OF = "\
SELECT consumer_type::text, extract(epoch FROM effect_key_ttl)::float8 FROM inboxctl_consumers
WHERE queue = $1 AND effect_mode = 'keyed' AND effect_key_ttl IS NOT NULL";

    /// How long the API of each consumer_type that registered one keeps idempotency keys, in seconds (`effects
    /// reconcile`: past it, a look-up's "no booking" may be a key forgotten).
    const KEY_TTLS = "\
SELECT consumer_type::text, extract(epoch FROM effect_key_ttl)::float8 FROM inboxctl_consumers
WHERE effect_key_ttl IS NOT NULL";

    /// Duplicates discarded for a set of message ids (the demo's tally). `$1` message ids.
    const COUNT_DUPLICATES_FOR =
    "SELECT count(*) FROM inboxctl_events WHERE kind = 'duplicate' AND message_id = ANY($1)";
}

/// Records one event of a consumer (`RECORD_EVENT`): its kind, the message's id if it had one, a detail.
pub async fn record(
    executor: impl Into<Exec<'_>>,
    consumer_type: &ConsumerType,
    kind: &str,
    message_id: Option<Uuid>,
    detail: &str,
) -> sqlx::Result<()> {
    let detail = sql::storable(detail);
    unit!(executor, |conn| sql::query(RECORD_EVENT)
        .bind(consumer_type.as_str())
        .bind(kind)
        .bind(message_id)
        .bind(detail.as_ref())
        .execute(conn))
    .map(drop)
}

/// Registers a consumer process's consumer_type, the queue it reads, into how many partition queues that is spread,
/// if it is, and the vhost they are in (`REGISTER_CONSUMER`). On a database not yet migrated to keep the vhost (a
/// consumer deployed before `migrate` ran), without it, and said: the consumer runs, and `cleanup` looks for its
/// dead letters in its own vhost until `migrate` runs.
pub async fn register_consumer(
    pool: &sqlx::PgPool,
    consumer_type: &ConsumerType,
    queue: &str,
    partitions: Option<u16>,
    vhost: &str,
) -> sqlx::Result<()> {
    let with_vhost = async |statement: &'static str| -> sqlx::Result<()> {
        unit!(pool, |conn| sql::query(statement)
            .bind(consumer_type.as_str())
            .bind(queue)
            .bind(partitions.map(i32::from))
            .bind(vhost)
            .execute(conn))
        .map(drop)
    };
    let registered = match with_vhost(REGISTER_CONSUMER).await {
        Err(e) if super::sqlstate(&e).as_deref() == Some("42703") => {
            tracing::warn!(
                "this database does not keep the queues a consumer read before yet: run `inboxctl migrate` (until \
                 then, a consumer_type moved to another queue has its rows cleaned as if nothing of it waited in the \
                 old queue's dead-letter queues)"
            );
            with_vhost(REGISTER_CONSUMER_WITHOUT_EARLIER).await
        }
        other => other,
    };
    match registered {
        Err(e) if super::sqlstate(&e).as_deref() == Some("42703") => {
            tracing::warn!(
                "this database does not keep the vhost of a consumer yet: run `inboxctl migrate`, then restart \
                 this consumer (until then, cleanup looks for its dead letters in the vhost it is given)"
            );
            unit!(pool, |conn| sql::query(REGISTER_CONSUMER_WITHOUT_VHOST)
                .bind(consumer_type.as_str())
                .bind(queue)
                .bind(partitions.map(i32::from))
                .execute(conn))
            .map(drop)
        }
        other => other.map(drop),
    }
}

/// Records a consumer_type's effect mode and key lifetime (`REGISTER_EFFECT_MODE`).
pub async fn register_effect_mode(
    executor: impl Into<Exec<'_>>,
    consumer_type: &ConsumerType,
    queue: &str,
    mode: &str,
    key_ttl: std::time::Duration,
) -> sqlx::Result<()> {
    unit!(executor, |conn| sql::query(REGISTER_EFFECT_MODE)
        .bind(consumer_type.as_str())
        .bind(queue)
        .bind(mode)
        .bind(key_ttl.as_secs_f64())
        .execute(conn))
    .map(drop)
}

/// How long each consumer_type's API keeps idempotency keys, where one registered it (`KEY_TTLS`).
pub async fn key_ttls(
    executor: impl Into<Exec<'_>>,
) -> sqlx::Result<std::collections::HashMap<String, std::time::Duration>> {
    let query = sql::query_as::<(String, f64)>(KEY_TTLS);
    let rows = unit!(executor, |conn| query.fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(c, secs)| {
            let ttl = std::time::Duration::try_from_secs_f64(secs).unwrap_or_default();
            (c, ttl)
        })
        .collect())
}

/// The keyed consumer_types reading `queue`, each with its API's key lifetime (`KEYED_CONSUMERS_OF`).
pub async fn keyed_consumers_of(
    executor: impl Into<Exec<'_>>,
    queue: &str,
) -> sqlx::Result<Vec<(String, std::time::Duration)>> {
    let query = sql::query_as::<(String, f64)>(KEYED_CONSUMERS_OF).bind(queue);
    let rows = unit!(executor, |conn| query.fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(c, secs)| {
            (
                c,
                std::time::Duration::try_from_secs_f64(secs).unwrap_or_default(),
            )
        })
        .collect())
}

/// Duplicates discarded for these message ids (`COUNT_DUPLICATES_FOR`).
pub async fn count_duplicates_for(
    executor: impl Into<Exec<'_>>,
    message_ids: &[Uuid],
) -> sqlx::Result<i64> {
    unit!(executor, |conn| sql::query_scalar(COUNT_DUPLICATES_FOR)
        .bind(message_ids)
        .fetch_one(conn))
}
