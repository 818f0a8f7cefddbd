//! Privilege checks: what the current role lacks on the tables a command needs, asked before it starts.

use super::{Exec, sql};

statements! {
    /// The privileges of `$1` (tables) × `$2` (privileges, comma-separated, per table) the current role lacks, per
    /// table, for the tables that exist. One row per table: (table, missing privileges).
    const MISSING_PRIVILEGES = "\
SELECT need.t, string_agg(p.privilege, ', ' ORDER BY p.n)
FROM unnest($1::text[], $2::text[]) AS need(t, privileges)
CROSS JOIN LATERAL unnest(string_to_array(need.privileges, ',')) WITH ORDINALITY AS p(privilege, n)
WHERE to_regclass(need.t) IS NOT NULL AND NOT has_table_privilege(need.t, p.privilege)
GROUP BY need.t
ORDER BY min(array_position($1::text[], need.t))";
}

/// The privileges the current role lacks on one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    pub table: String,
    /// Comma-separated, in the order asked for.
    pub privileges: String,
}

/// Of `needs` (a table and the privileges it needs, comma-separated), what the current role lacks, per table, in the
/// order of `needs` (`MISSING_PRIVILEGES`). Tables that do not exist are left out.
pub async fn missing_privileges(
    executor: impl Into<Exec<'_>>,
    needs: &[(&str, &str)],
) -> sqlx::Result<Vec<Missing>> {
    let (tables, privileges): (Vec<&str>, Vec<&str>) = needs.iter().copied().unzip();
    let rows: Vec<(String, String)> = unit!(executor, |conn| sql::query_as(MISSING_PRIVILEGES)
        .bind(&tables)
        .bind(&privileges)
        .fetch_all(conn))?;
    Ok(rows
        .into_iter()
        .map(|(table, privileges)| Missing { table, privileges })
        .collect())
}
