//! Helpers the store's areas share. Every statement inboxctl sends lives in its area (`db::claim`, `db::cleanup`, …)
//! beside the function that binds it, and goes out through [`query`], [`query_as`] or [`query_scalar`]: prepared once
//! per connection and kept (a named statement), or — through a transaction pooler, where no prepared statement outlives
//! a transaction ([`super::pooler`]) — unnamed, parsed again each time.

use sqlx::postgres::{PgArguments, PgRow, Postgres};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{FromRow, SqlSafeStr};

use super::pooler;

/// An identifier quoted for PostgreSQL: wrapped in double quotes, inner double quotes doubled.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `sqlx::query`, named and kept unless through a transaction pooler.
pub(crate) fn query<'q>(statement: impl SqlSafeStr) -> Query<'q, Postgres, PgArguments> {
    sqlx::query(statement).persistent(!pooler::active())
}

/// `sqlx::query_as`, named and kept unless through a transaction pooler.
pub(crate) fn query_as<'q, O>(statement: impl SqlSafeStr) -> QueryAs<'q, Postgres, O, PgArguments>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_as(statement).persistent(!pooler::active())
}

/// `sqlx::query_scalar`, named and kept unless through a transaction pooler.
pub(crate) fn query_scalar<'q, O>(
    statement: impl SqlSafeStr,
) -> QueryScalar<'q, Postgres, O, PgArguments>
where
    (O,): for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_scalar(statement).persistent(!pooler::active())
}

/// `sqlx::query_scalar_with`, named and kept unless through a transaction pooler: a statement built around a caller's
/// (`claim::claim_with`), whose arguments come bound.
pub(crate) fn query_scalar_with<'q, O>(
    statement: impl SqlSafeStr,
    arguments: PgArguments,
) -> QueryScalar<'q, Postgres, O, PgArguments>
where
    (O,): for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_scalar_with(statement, arguments).persistent(!pooler::active())
}
