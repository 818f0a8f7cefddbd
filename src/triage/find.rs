//! `find`: everything known about a message, by its id — its inbox rows and events per consumer_type, its
//! poison-detection starts, its effects, and its copies in the dead-letter queues of the consumer_types inboxctl knows
//! (looked at, not taken: see [`crate::amqp::peek`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgPool;
use uuid::Uuid;

use crate::amqp::cause::Cause;
use crate::amqp::failure::failure;
use crate::amqp::{Connection, limits, peek, topology};
use crate::db::{self, triage};
use crate::error::Result;

/// What to look for, and where besides the known dead-letter queues.
#[derive(Debug, Clone)]
pub struct Plan {
    pub ids: Vec<Uuid>,
    /// Dead-letter-exchange queues to look in too (`--dlq`).
    pub dlqs: Vec<String>,
    /// Look at no more than this many messages per queue.
    pub limit: u64,
    /// How long any call to RabbitMQ may wait for its answer.
    pub broker_timeout: std::time::Duration,
}

/// A copy of the message in a dead-letter queue.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetterCopy {
    pub queue: String,
    /// Its place in the queue, from 1 (the oldest).
    pub position: u64,
    pub reason: Option<String>,
    pub exception_type: Option<String>,
    pub fingerprint: String,
    pub failed_at: Option<DateTime<Utc>>,
    pub origin: String,
    pub replays: u32,
    pub redelivered: bool,
}

/// Everything known about one message.
#[derive(Debug, Clone, Serialize)]
pub struct Found {
    pub message_id: Uuid,
    /// Whether anything at all was found.
    pub found: bool,
    pub inbox: Vec<triage::InboxRow>,
    pub events: Vec<triage::EventRow>,
    /// Whether there were more events than shown.
    pub events_cut: bool,
    pub attempts: Vec<triage::AttemptsRow>,
    pub effects: Vec<triage::EffectRow>,
    /// Its calls to the outside world (`inboxctl_effects`): the state each is in, its key, its attempts.
    pub calls: Vec<crate::db::external::Row>,
    pub dead_letters: Vec<DeadLetterCopy>,
    /// Whether it had more copies than shown ([`MAX_COPIES`]).
    pub copies_cut: bool,
}

impl Looked {
    /// A queue of another `vhost` that could not be looked at, and why.
    fn not(queue: String, vhost: &str, why: String) -> Self {
        Looked {
            queue,
            vhost: Some(vhost.to_owned()),
            depth: None,
            looked: 0,
            replay_running: false,
            looked_at_elsewhere: false,
            error: Some(why),
        }
    }
}

/// The most dead-letter copies shown per message: one failing in a loop can have thousands.
pub const MAX_COPIES: usize = 100;

/// One queue looked in.
#[derive(Debug, Clone, Serialize)]
pub struct Looked {
    pub queue: String,
    /// The vhost it was looked for in, when not the one asked for (`AMQP_URL`'s): its consumer's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vhost: Option<String>,
    /// Messages ready when the look began; none when the queue does not exist.
    pub depth: Option<u64>,
    pub looked: u64,
    /// A replay of the queue was running: the messages it holds were not there to be seen.
    pub replay_running: bool,
    /// Another look at the queue (`find`, `failures`, `top`'s detail, a cleanup's guard) held messages while this one
    /// looked: those it held may not have been seen.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub looked_at_elsewhere: bool,
    /// Why the queue could not be looked at (a classic queue whose node is down), if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub messages: Vec<Found>,
    pub queues: Vec<Looked>,
}

/// What the database knows of one message.
async fn in_database(pool: &PgPool, id: Uuid) -> Result<Found> {
    // The newest of each consumer_type: a message failing in a loop ends with what became of it.
    let (events, events_cut) = triage::events(pool, id).await?;
    Ok(Found {
        message_id: id,
        found: false,
        inbox: triage::inbox_rows(pool, id).await?,
        events_cut,
        events,
        attempts: triage::attempts(pool, id).await?,
        effects: triage::effects(pool, id).await?,
        calls: calls(pool, id).await?,
        dead_letters: Vec::new(),
        copies_cut: false,
    })
}

/// Its calls to the outside world; none on a database from before `inboxctl_effects`.
async fn calls(pool: &PgPool, id: Uuid) -> Result<Vec<crate::db::external::Row>> {
    match crate::db::external::of_message(pool, id, None).await {
        Err(e) if crate::db::sqlstate(&e).as_deref() == Some("42P01") => Ok(Vec::new()),
        other => Ok(other?),
    }
}

/// Whether `body` holds one of the ids of `index` in their hyphenated form (any case, braced or not): one pass over
/// the body, so that only such a body is parsed for its envelope's id.
fn holds_one_of(body: &[u8], index: &HashMap<Uuid, usize>) -> bool {
    body.windows(36).any(|w| {
        w[8] == b'-'
            && w[13] == b'-'
            && w[18] == b'-'
            && w[23] == b'-'
            && std::str::from_utf8(w)
                .ok()
                .and_then(|s| Uuid::parse_str(s).ok())
                .is_some_and(|id| index.contains_key(&id))
    })
}

/// Looks for every id of `plan` in the database and in the dead-letter queues.
pub async fn find(
    pool: &PgPool,
    broker: &crate::amqp::Broker,
    connection: &Connection,
    plan: &Plan,
) -> Result<Report> {
    // One entry per message, in the order given: an id given twice (`{…}` and plain, upper and lower case) would
    // otherwise get its dead-letter copies under its last entry only and be "found nowhere" under the first.
    let mut seen = std::collections::HashSet::new();
    let ids: Vec<Uuid> = plan
        .ids
        .iter()
        .copied()
        .filter(|id| seen.insert(*id))
        .collect();
    let mut messages = Vec::with_capacity(ids.len());
    for &id in &ids {
        messages.push(in_database(pool, id).await?);
    }
    // Each consumer_type's dead-letter queues where its consumer reads them: the vhost it recorded (else this one),
    // and those of the queues it read before (a consumer_type moved to another queue leaves its failures behind).
    let own = broker.vhost().to_owned();
    let vhosts = db::stats::registered_vhosts(pool).await?;
    let mut by_vhost: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut place = |queue: &str, vhost: Option<&String>| {
        let queues = by_vhost
            .entry(vhost.cloned().unwrap_or_else(|| own.clone()))
            .or_default();
        queues.insert(topology::error_queue(queue));
        queues.insert(topology::skipped_queue(queue));
    };
    for (consumer_type, queue) in db::stats::registered_consumers(pool).await? {
        place(&queue, vhosts.get(&consumer_type));
    }
    for (consumer_type, earlier) in db::stats::registered_earlier(pool).await? {
        let now_in = vhosts.get(&consumer_type).unwrap_or(&own).clone();
        for (queue, vhost) in earlier {
            for vhost in db::stats::earlier_vhosts(vhost.as_ref(), &now_in, &own) {
                place(&queue, Some(&vhost));
            }
        }
    }
    by_vhost
        .entry(own.clone())
        .or_default()
        .extend(plan.dlqs.iter().cloned());
    let index: HashMap<Uuid, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();

    let mut looked_in = Vec::new();
    for (vhost, queues) in by_vhost {
        if vhost == own {
            look_in(
                connection,
                &vhost,
                None,
                queues,
                plan,
                &index,
                &mut messages,
                &mut looked_in,
            )
            .await?;
            continue;
        }
        match broker.in_vhost(&vhost).connect("inboxctl find").await {
            Ok(there) => {
                let names = queues.clone();
                let looked = look_in(
                    &there,
                    &vhost,
                    Some(&vhost),
                    queues,
                    plan,
                    &index,
                    &mut messages,
                    &mut looked_in,
                )
                .await;
                crate::amqp::close(&there, "OK").await;
                // Its connection lost half way: the queues not looked at are said, the rest of the report stands.
                if let Err(e) = looked {
                    let why = crate::redact::text(&e.to_string());
                    for queue in names {
                        let done = looked_in
                            .iter()
                            .any(|l| l.queue == queue && l.vhost.as_ref() == Some(&vhost));
                        if !done {
                            looked_in.push(Looked::not(
                                queue,
                                &vhost,
                                format!("could not be looked at in its vhost: {why}"),
                            ));
                        }
                    }
                }
            }
            // A vhost this user cannot reach leaves its queues unlooked at, said: not a reason to show nothing.
            Err(e) => {
                let why = crate::redact::text(&e.to_string());
                looked_in.extend(queues.into_iter().map(|queue| {
                    Looked::not(
                        queue,
                        &vhost,
                        format!("could not connect to its vhost: {why}"),
                    )
                }));
            }
        }
    }
    for m in &mut messages {
        m.found = !(m.inbox.is_empty()
            && m.events.is_empty()
            && m.attempts.is_empty()
            && m.effects.is_empty()
            && m.calls.is_empty()
            && m.dead_letters.is_empty());
    }
    Ok(Report {
        messages,
        queues: looked_in,
    })
}

/// Looks for the copies of the ids of `index` in `queues` of `vhost` (`shown_vhost`: named in the report, when not the
/// one asked for), on `connection`, adding them to `messages` and each queue looked in to `looked_in`.
#[allow(clippy::too_many_arguments)]
async fn look_in(
    connection: &Connection,
    vhost: &str,
    shown_vhost: Option<&String>,
    queues: BTreeSet<String>,
    plan: &Plan,
    index: &HashMap<Uuid, usize>,
    messages: &mut [Found],
    looked_in: &mut Vec<Looked>,
) -> Result<()> {
    for queue in queues {
        if crate::amqp::no_queue_can_have(&queue) {
            continue;
        }
        // Before the look and after it (below): a replay beginning in between marks the queue before it takes.
        let running = || {
            crate::amqp::answered(
                "a look for a replay's marker",
                plan.broker_timeout,
                topology::replay_running(connection, &queue),
            )
        };
        let mut replay_running = running().await??;
        let mut position = 0;
        let looked = peek::each(
            connection,
            &queue,
            plan.limit,
            plan.broker_timeout,
            |delivery| {
                position += 1;
                // The id the consumer keyed it on (`envelope::keyed_id`): its envelope's, whatever the AMQP property
                // says (a producer that sets another, a shovel), else — a body no envelope — the property's. Only a
                // body holding one of the ids, or a copy whose property is one, is parsed.
                let by_property = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|id| Uuid::parse_str(id.as_str().trim()).ok())
                    .and_then(|id| index.get(&id).copied());
                let keyed = (by_property.is_some() || holds_one_of(&delivery.data, index))
                    .then(|| {
                        match crate::amqp::envelope::parse(&delivery.properties, &delivery.data) {
                            Ok(m) => index.get(&m.message_id).copied(),
                            Err(_) => by_property,
                        }
                    })
                    .flatten();
                let Some(i) = keyed else {
                    return;
                };
                if messages[i].dead_letters.len() >= MAX_COPIES {
                    messages[i].copies_cut = true;
                    return;
                }
                let failure = failure(delivery.properties.headers().as_ref(), &queue, vhost);
                messages[i].dead_letters.push(DeadLetterCopy {
                    queue: queue.clone(),
                    position,
                    // Another service's fault text may quote a URL with its password: masked, as inboxctl's own.
                    reason: failure
                        .reason
                        .as_deref()
                        .map(|r| crate::redact::text_cut(r, 1000)),
                    exception_type: failure
                        .exception_type
                        .as_deref()
                        .map(|t| limits::truncate(t, 256).into_owned()),
                    fingerprint: Cause::of(&failure).fingerprint,
                    failed_at: failure.failed_at,
                    origin: super::failures::origin_name(&failure.origin),
                    replays: failure.replays,
                    redelivered: delivery.redelivered,
                });
            },
        )
        .await;
        // One queue that cannot be reached leaves the others to look at, in the partial outage triage is for.
        let (looked, error) = match looked {
            Ok(looked) => (looked, None),
            Err(e) if connection.status().connected() => {
                (None, Some(crate::redact::text(&e.to_string())))
            }
            Err(e) => return Err(e),
        };
        replay_running = replay_running || running().await??;
        looked_in.push(Looked {
            queue,
            vhost: shown_vhost.cloned(),
            depth: looked.map(|l| l.depth),
            looked: looked.map_or(0, |l| l.looked),
            replay_running,
            looked_at_elsewhere: looked.is_some_and(|l| l.crowded),
            error,
        });
    }
    Ok(())
}
