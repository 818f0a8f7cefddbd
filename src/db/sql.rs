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

/// `text` as PostgreSQL's text can hold it: a NUL character (which JSON's `\u0000`, an AMQP string or an HTTP body
/// can carry, and PostgreSQL refuses in any text: "invalid byte sequence for encoding UTF8: 0x00") is written as
/// U+FFFD. For text from a message or a remote service bound into a text column.
pub fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\u{FFFD}"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nul_is_stored_as_a_replacement_character() {
        assert_eq!(storable("Ber\0lin"), "Ber\u{FFFD}lin");
        assert!(matches!(
            storable("Berlin"),
            std::borrow::Cow::Borrowed("Berlin")
        ));
    }
}
