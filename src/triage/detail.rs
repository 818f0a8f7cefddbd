//! One consumer_type up close, for `top`'s detail view: its latest failures, the failure groups of its error queue,
//! its oldest unprocessed rows, and the last audit entries that name it.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgPool;
use uuid::Uuid;

use super::Listing;
use crate::amqp::{Connection, topology};
use crate::db::{self, schema};
use crate::error::Result;

/// How many of each the view shows.
const SHOWN: i64 = 20;

/// The most messages of the error queue looked at for its groups.
pub const LOOK_LIMIT: u64 = 10_000;

/// One consumer_type up close.
#[derive(Debug, Clone)]
pub struct Detail {
    pub consumer_type: String,
    pub error_queue: String,
    /// Newest first.
    pub failures: Vec<db::triage::FailureRow>,
    /// The error queue's groups; `Err` says why they could not be listed (no broker, no queue).
    pub groups: std::result::Result<Listing, String>,
    /// (message id, received at: None where the table holds ±infinity).
    pub oldest_unprocessed: Vec<(Uuid, Option<DateTime<Utc>>)>,
    /// `Err` says why the audit could not be read (a role without `SELECT` on it): the rest is shown all the same.
    pub audit: std::result::Result<Vec<db::audit::Row>, String>,
}

/// Loads the detail of `consumer_type`, which reads `queue`; `connection` is the broker's, when there is one.
pub async fn load(
    pool: &PgPool,
    connection: Option<&Connection>,
    vhost: &str,
    consumer_type: &str,
    queue: &str,
) -> Result<Detail> {
    let mut conn = pool.acquire().await?;
    let failures = if schema::table_exists(&mut conn, "inboxctl_events").await? {
        db::triage::recent_failures(&mut *conn, consumer_type, SHOWN).await?
    } else {
        Vec::new()
    };
    let oldest_unprocessed =
        db::triage::oldest_unprocessed(&mut *conn, consumer_type, SHOWN).await?;
    let audit = if schema::table_exists(&mut conn, "inboxctl_audit").await? {
        db::audit::list_for(&mut *conn, consumer_type, SHOWN)
            .await
            .map_err(|e| crate::redact::text(&db::describe(&e)))
    } else {
        Ok(Vec::new())
    };
    drop(conn);
    let error_queue = topology::error_queue(queue);
    let groups = match connection {
        None => Err("RabbitMQ not reachable".to_owned()),
        Some(c) => match super::failures::list(
            c,
            &error_queue,
            vhost,
            LOOK_LIMIT,
            crate::amqp::DEFAULT_BROKER_TIMEOUT,
        )
        .await
        {
            Ok(listing) => Ok(listing),
            Err(crate::error::Error::QueueNotFound(_)) => {
                Err(format!("{error_queue} does not exist: nothing failed"))
            }
            Err(e) => Err(crate::redact::text(&e.to_string())),
        },
    };
    Ok(Detail {
        consumer_type: consumer_type.to_owned(),
        error_queue,
        failures,
        groups,
        oldest_unprocessed,
        audit,
    })
}
