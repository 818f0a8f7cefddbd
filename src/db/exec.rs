//! What a store function runs its statements on ([`Exec`]), the connection it holds meanwhile ([`Held`]), and the
//! transaction of its own it runs them in through a transaction pooler ([`Unit`], see [`super::pooler`]).

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool, Postgres};
use sqlx::{Connection as _, Transaction};

use super::pooler;

/// What a store function runs its statements on (written `executor: impl Into<Exec<'_>>`): a pool (`&PgPool`), or a
/// connection (`&mut PgConnection`, a pool's, or a transaction's). Through a transaction pooler, each function's
/// statements on a pool or on a connection outside a transaction go in a transaction of their own ([`Unit`]).
///
/// A concrete type rather than a trait (sqlx's `Acquire`, or one of ours): the futures of functions generic over a
/// trait whose connection comes back from a future are "not general enough" to be spawned (rust-lang/rust#100013).
pub enum Exec<'c> {
    Pool(&'c PgPool),
    Connection(&'c mut PgConnection),
}

impl<'c> Exec<'c> {
    /// The connection to send the statements on: one of the pool's, or the one given.
    pub(crate) async fn connection(self) -> sqlx::Result<Held<'c>> {
        match self {
            Exec::Pool(pool) => Ok(Held::Pooled(pool.acquire().await?)),
            Exec::Connection(conn) => Ok(Held::Borrowed(conn)),
        }
    }
}

impl<'c> From<&'c PgPool> for Exec<'c> {
    fn from(pool: &'c PgPool) -> Self {
        Exec::Pool(pool)
    }
}

impl<'c> From<&'c mut PgConnection> for Exec<'c> {
    fn from(conn: &'c mut PgConnection) -> Self {
        Exec::Connection(conn)
    }
}

impl<'c> From<&'c mut PoolConnection<Postgres>> for Exec<'c> {
    fn from(conn: &'c mut PoolConnection<Postgres>) -> Self {
        Exec::Connection(conn)
    }
}

impl<'c> From<&'c mut Transaction<'_, Postgres>> for Exec<'c> {
    fn from(tx: &'c mut Transaction<'_, Postgres>) -> Self {
        Exec::Connection(tx)
    }
}

/// A connection a store function holds while it runs: one taken from a pool (given back when dropped), or borrowed.
pub(crate) enum Held<'c> {
    Pooled(PoolConnection<Postgres>),
    Borrowed(&'c mut PgConnection),
}

impl std::ops::Deref for Held<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Held::Pooled(conn) => conn,
            Held::Borrowed(conn) => conn,
        }
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Held::Pooled(conn) => conn,
            Held::Borrowed(conn) => conn,
        }
    }
}

/// One store function's hold on a connection (written `unit!(executor, |conn| …)`): through a transaction pooler, a
/// transaction of its own around the function's statements unless the connection is in one already; otherwise the
/// connection as it is, at no cost.
pub(crate) enum Unit<'c> {
    Own(Transaction<'c, Postgres>),
    Borrowed(&'c mut PgConnection),
}

impl<'c> Unit<'c> {
    pub(crate) async fn of(conn: &'c mut PgConnection) -> sqlx::Result<Self> {
        if pooler::active() && !conn.is_in_transaction() {
            Ok(Unit::Own(pooler::begin(conn).await?))
        } else {
            Ok(Unit::Borrowed(conn))
        }
    }

    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        match self {
            Unit::Own(tx) => tx,
            Unit::Borrowed(conn) => conn,
        }
    }

    /// Commits the unit's own transaction when `result` is a success, rolls it back when not; returns `result` (or
    /// the commit's error).
    pub(crate) async fn end<T>(self, result: sqlx::Result<T>) -> sqlx::Result<T> {
        match (self, result) {
            (Unit::Borrowed(_), result) => result,
            (Unit::Own(tx), Ok(value)) => tx.commit().await.map(|()| value),
            (Unit::Own(tx), Err(e)) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }
}
