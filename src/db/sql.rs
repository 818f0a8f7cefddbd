//! Helpers the store's areas share. Every statement inboxctl sends lives in its area (`db::claim`, `db::cleanup`, …)
//! beside the function that binds it.

/// An identifier quoted for PostgreSQL: wrapped in double quotes, inner double quotes doubled.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
