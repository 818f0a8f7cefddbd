//! `--inbox-rows N`: the inbox modes measured against an inbox that already holds N processed rows, as a week of a
//! busy service's does — with ids of the kind `--id-kind`, which decides where in the primary key's B-tree each new
//! claim lands. The rows are made once into a template database per (N, id kind) and copied for each mode.

use std::time::Instant;

use inboxctl::db::{Database, schema};
use inboxctl::ids::IdKind;

use crate::error::Result;
use crate::scratch::drop_database;
use crate::sql;

/// The process part (bytes 0–7) of the prefilled NewIds: the one of the NewId captured from MassTransit
/// (`1a280000-161d-4c08-…`). The bench's publisher takes it too, so that its new ids land among the prefilled ones as
/// one long-running process's ids do; a process of its own would fill a range of the key apart from them.
pub const NEW_ID_PROCESS: [u8; 8] = [0x1a, 0x28, 0x00, 0x00, 0x16, 0x1d, 0x4c, 0x08];

pub fn kind_name(ids: IdKind) -> &'static str {
    match ids {
        IdKind::NewId => "newid",
        IdKind::V7 => "v7",
        IdKind::V4 => "v4",
    }
}

/// What the prefilled inbox holds: how many rows, of which ids, partitioned by day or not.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub rows: u64,
    pub ids: IdKind,
    pub partitioned: bool,
}

impl Shape {
    fn marker(self) -> String {
        format!(
            "inboxctl bench prefill v1: {} rows, {} ids{}",
            self.rows,
            kind_name(self.ids),
            if self.partitioned {
                ", partitioned by day"
            } else {
                ""
            }
        )
    }
}

/// The template database holding the rows of `shape`, built if it is not there yet.
pub async fn template(db: &Database, shape: Shape, say: &mut impl FnMut(&str)) -> Result<String> {
    let Shape {
        rows,
        ids,
        partitioned,
    } = shape;
    if partitioned && ids == IdKind::V4 {
        return Err(crate::error::Error::usage(
            "--inbox-partitioned keys the rows on the time inside their ids, and v4 ids carry none: use newid or v7",
        ));
    }
    let suffix = if partitioned { "_partitioned" } else { "" };
    let name = format!(
        "{}_bench_prefill_{rows}_{}{suffix}",
        db.name(),
        kind_name(ids)
    );
    let template = db.with_database(&name);
    if crate::template::ready(&template, &shape.marker()).await {
        return Ok(name);
    }
    say(&format!(
        "building {rows} inbox rows with {} ids into {name} (once; later runs reuse it)",
        kind_name(ids)
    ));
    drop_database(db, &name).await?;
    let statement = if partitioned {
        // A partition a day, from before the oldest row to past today (where the runs' claims land).
        let settings = inboxctl::db::partitions::Settings {
            interval: chrono::TimeDelta::days(1),
            source: inboxctl::inbox::TimeSource::Id,
        };
        schema::migrate_partitioned(&template, false, Some(settings)).await?;
        let mut conn = template.connect().await?;
        let now = chrono::Utc::now();
        inboxctl::db::partitions::ensure_partitions(
            &mut conn,
            settings,
            now - chrono::TimeDelta::days(8),
            now + chrono::TimeDelta::days(2),
        )
        .await?;
        sql::PREFILL_ROWS_PARTITIONED
    } else {
        schema::migrate(&template, false).await?;
        sql::PREFILL_ROWS
    };
    let pool = template.pool(1).await?;
    let started = Instant::now();
    let chunk = 1_000_000u64;
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        sqlx::query(statement)
            .bind(i64::try_from(done).unwrap_or(i64::MAX))
            .bind(i64::try_from(n).unwrap_or(i64::MAX))
            .bind(i64::try_from(rows).unwrap_or(i64::MAX))
            .bind(kind_name(ids))
            .bind(&NEW_ID_PROCESS[..])
            .execute(&pool)
            .await?;
        done += n;
        say(&format!(
            "  {done} rows ({:.0}s)",
            started.elapsed().as_secs_f64()
        ));
    }
    crate::template::finish(&pool, &shape.marker()).await?;
    pool.close().await;
    Ok(name)
}
