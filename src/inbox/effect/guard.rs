//! Whether an effect statement may go inside its claim's statement (see [`super::Effect`]): judged from its text,
//! strictly — a statement refused goes the usual way, correct and slower; one let through that wrote for copies
//! would make an effect twice.

/// Why `sql` cannot be sent inside the claim's statement, if it cannot: not a data-modifying statement, or one that
/// may write without a row of `claimed` (see [`writes_only_through_claimed`]).
pub(super) fn unfit(sql: &str) -> Option<&'static str> {
    let first = sql
        .trim_start()
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or_default();
    if !["insert", "update", "delete"]
        .iter()
        .any(|k| first.eq_ignore_ascii_case(k))
    {
        return Some(
            "it is not an INSERT, UPDATE or DELETE (a SELECT inside WITH runs only if something reads it)",
        );
    }
    if !writes_only_through_claimed(sql) {
        return Some(
            "it does not read `claimed` as the plain source of its rows (in a FROM, JOIN or USING clause of the \
             statement itself, not of a subquery, an outer join's optional side, a set operation or an aggregate), \
             and may write for copies too",
        );
    }
    None
}

/// What a quoted name (`"…"`) reads as in [`blanked`]'s text: a word no statement has.
const QUOTED_NAME: &str = " quoted_name_ ";

/// `sql` in lower case with its string literals (`'…'`, `E'…'` with its backslash escapes, `$tag$…$tag$`) and
/// comments (`--`, `/* */`, nested) each replaced by one space, and its quoted names by [`QUOTED_NAME`]: what is left
/// is keywords, names, parameters and punctuation.
fn blanked(sql: &str) -> String {
    let chars: Vec<char> = sql.chars().collect();
    let mut text = String::with_capacity(sql.len());
    let mut i = 0;
    let word_before = |i: usize| i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\'' => {
                // An E'…' string takes backslash escapes; any string takes '' for a quote.
                let escapes = i > 0
                    && matches!(chars[i - 1], 'e' | 'E')
                    && !(i > 1 && (chars[i - 2].is_alphanumeric() || chars[i - 2] == '_'));
                if escapes {
                    text.pop();
                }
                i += 1;
                while i < chars.len() {
                    match chars[i] {
                        '\\' if escapes => i += 2,
                        '\'' if chars.get(i + 1) == Some(&'\'') => i += 2,
                        '\'' => break,
                        _ => i += 1,
                    }
                }
                i += 1;
                text.push(' ');
            }
            '"' => {
                i += 1;
                while i < chars.len() {
                    match chars[i] {
                        '"' if chars.get(i + 1) == Some(&'"') => i += 2,
                        '"' => break,
                        _ => i += 1,
                    }
                }
                i += 1;
                // A name all the same, though not one this reads: a call of it (`"count"(*)`) is seen as a call.
                text.push_str(QUOTED_NAME);
            }
            '-' if chars.get(i + 1) == Some(&'-') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                text.push(' ');
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                let mut depth = 0usize;
                while i < chars.len() {
                    if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                        depth += 1;
                        i += 2;
                    } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                text.push(' ');
            }
            // A dollar-quoted string: `$tag$` (the tag a name not starting with a digit, or empty) … `$tag$`. A `$`
            // after a name's character is part of the name; `$` and digits are a parameter.
            '$' if !word_before(i) && !chars.get(i + 1).is_some_and(char::is_ascii_digit) => {
                let tag_end = chars[i + 1..]
                    .iter()
                    .position(|c| !(c.is_alphanumeric() || *c == '_'))
                    .map(|n| i + 1 + n);
                match tag_end.filter(|&e| chars[e] == '$') {
                    Some(e) => {
                        let tag: String = chars[i..=e].iter().collect();
                        let rest: String = chars[e + 1..].iter().collect();
                        i = match rest.find(&tag) {
                            Some(at) => e + 1 + rest[..at].chars().count() + tag.chars().count(),
                            None => chars.len(),
                        };
                        text.push(' ');
                    }
                    None => {
                        text.push('$');
                        i += 1;
                    }
                }
            }
            c => {
                text.extend(c.to_lowercase());
                i += 1;
            }
        }
    }
    text
}

/// The highest `$n` in `sql`, outside string literals, quoted identifiers and comments.
pub(super) fn highest_parameter(sql: &str) -> usize {
    let text = blanked(sql);
    let bytes = text.as_bytes();
    let mut highest = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'$'
            && !(i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'))
        {
            let digits = bytes[i + 1..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            if let Ok(n) = text[i + 1..i + 1 + digits].parse::<usize>() {
                highest = highest.max(n);
            }
            i += digits;
        }
        i += 1;
    }
    highest
}

/// Aggregates built into PostgreSQL (and `regr_*`): over no rows, one without `GROUP BY` still makes a row. Looked for
/// at any depth (`coalesce(max(x), 0)` is one too).
const AGGREGATES: [&str; 38] = [
    "count",
    "sum",
    "min",
    "max",
    "avg",
    "array_agg",
    "string_agg",
    "json_agg",
    "jsonb_agg",
    "json_object_agg",
    "jsonb_object_agg",
    "json_objectagg",
    "json_arrayagg",
    "bool_and",
    "bool_or",
    "every",
    "bit_and",
    "bit_or",
    "bit_xor",
    "xmlagg",
    "range_agg",
    "range_intersect_agg",
    "stddev",
    "stddev_pop",
    "stddev_samp",
    "variance",
    "var_pop",
    "var_samp",
    "any_value",
    "corr",
    "covar_pop",
    "covar_samp",
    "mode",
    "percentile_cont",
    "percentile_disc",
    "rank",
    "dense_rank",
    "cume_dist",
];

/// Whether `sql` (an `INSERT`, `UPDATE` or `DELETE`) can write only through `claimed`, which has one row when this
/// delivery takes the message and none for a copy — judged from its text, and strictly: a statement this refuses
/// goes the usual way, correct and slower; one it let through that wrote for copies would make an effect twice.
/// `claimed` must be a source of the statement's own rows: an item of its `FROM`, `JOIN` or `USING` clause outside
/// any parentheses (not in a subquery: `VALUES ((SELECT 1 FROM claimed))`, `WHERE NOT EXISTS (SELECT FROM claimed)`
/// write for copies), not an alias (`FROM u AS claimed`), not a schema (`FROM claimed.log`), not the right side of
/// `IS DISTINCT FROM`. Refused too: outside parentheses, a set operation (`UNION`, `INTERSECT`, `EXCEPT`: the other
/// side makes rows of its own), any outer or natural join (`LEFT`, `RIGHT`, `FULL`, `NATURAL`: `claimed` may be its
/// optional side, however nested), `HAVING` and `GROUP BY ()` (one group from no rows); anywhere, a built-in aggregate
/// ([`AGGREGATES`], `regr_*`, `WITHIN GROUP`) without `GROUP BY`, and `GROUPING SETS`, `ROLLUP`, `CUBE`. An aggregate
/// of the consumer's own making it cannot know: such a statement must not be written. Text in literals, quoted names
/// and comments does not count.
fn writes_only_through_claimed(sql: &str) -> bool {
    let text = blanked(sql);
    // Each word with its parenthesis depth; `(`, `)`, `,` and `.` as words too, to see a call, a list and a name's
    // parts. A `$` after a name's characters is one of them (`claimed$log` is a name of its own).
    let mut tokens: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut word = String::new();
    let flush = |word: &mut String, tokens: &mut Vec<(String, usize)>, depth: usize| {
        if !word.is_empty() {
            tokens.push((std::mem::take(word), depth));
        }
    };
    for c in text.chars() {
        if c.is_alphanumeric() || c == '_' || (c == '$' && !word.is_empty()) {
            word.push(c);
            continue;
        }
        flush(&mut word, &mut tokens, depth);
        match c {
            '(' => {
                tokens.push(("(".to_owned(), depth));
                depth += 1;
            }
            ',' => tokens.push((",".to_owned(), depth)),
            '.' => tokens.push((".".to_owned(), depth)),
            ')' => {
                // More `)` than `(`: not a statement this can judge.
                let Some(up) = depth.checked_sub(1) else {
                    return false;
                };
                depth = up;
                tokens.push((")".to_owned(), depth));
            }
            _ => {}
        }
    }
    flush(&mut word, &mut tokens, depth);
    let all: Vec<&str> = tokens.iter().map(|(w, _)| w.as_str()).collect();
    let top: Vec<&str> = tokens
        .iter()
        .filter(|(_, d)| *d == 0)
        .map(|(w, _)| w.as_str())
        .collect();
    const REFUSED_AT_TOP: [&str; 9] = [
        "union",
        "intersect",
        "except",
        "left",
        "right",
        "full",
        "natural",
        "having",
        "outer",
    ];
    // (`left(…)` and `right(…)` are functions, not joins.)
    if top.iter().enumerate().any(|(i, w)| {
        REFUSED_AT_TOP.contains(w)
            && !(["left", "right"].contains(w) && top.get(i + 1) == Some(&"("))
    }) {
        return false;
    }
    if all
        .iter()
        .any(|w| ["grouping", "rollup", "cube", "within"].contains(w))
    {
        return false;
    }
    if top.windows(4).any(|w| w == ["group", "by", "(", ")"]) {
        return false;
    }
    // `GROUP BY ALL ()`, `GROUP BY DISTINCT ()` (PostgreSQL 14): one group from no rows too.
    if top
        .windows(3)
        .any(|w| w[0] == "by" && ["all", "distinct"].contains(&w[1]) && w[2] == "(")
    {
        return false;
    }
    // A name followed by `(` is a call unless it names a table: after `INTO`, `UPDATE`, `FROM`, `JOIN`, `USING`,
    // `TABLE` or `AS`, or after such a word and a schema (`INTO s.mode (…)`); `pg_catalog.count(*)` is a call.
    let tables = ["into", "update", "from", "join", "using", "table", "as"];
    let is_call = |at: usize| {
        all.get(at + 1) == Some(&"(")
            && !(at >= 1 && tables.contains(&all[at - 1]))
            && !(at >= 3 && all[at - 1] == "." && tables.contains(&all[at - 3]))
    };
    // A call of a quoted name (`"count"(*)`): what it is, the text does not say.
    if (0..all.len()).any(|at| all[at] == QUOTED_NAME.trim() && is_call(at)) {
        return false;
    }
    let grouped = top.windows(2).any(|w| w == ["group", "by"]);
    // A call, not a table of that name (`INSERT INTO mode (…)`, `FROM rank`).
    let is_aggregate = |w: &str| {
        AGGREGATES.contains(&w)
            || w.starts_with("regr_")
            || (w.starts_with("json") && w.contains("agg"))
    };
    let aggregated = (0..all.len()).any(|at| is_aggregate(all[at]) && is_call(at));
    if aggregated && !grouped {
        return false;
    }
    const CLAUSES: [&str; 19] = [
        "from",
        "join",
        "using",
        "set",
        "select",
        "where",
        "values",
        "on",
        "and",
        "or",
        "returning",
        "into",
        "update",
        "insert",
        "delete",
        "by",
        "having",
        "with",
        "window",
    ];
    // `claimed` itself a list's item (`FROM claimed`, `FROM u, claimed`, `JOIN claimed`), not an alias (`FROM u AS
    // claimed`, `FROM u claimed`), a column (`SET a = 1, claimed = true`), a schema (`FROM claimed.log`) nor what `IS
    // DISTINCT FROM` compares with.
    top.iter().enumerate().any(|(at, word)| {
        *word == "claimed"
            && at >= 1
            && ["from", "join", "using", ","].contains(&top[at - 1])
            && top.get(at + 1) != Some(&".")
            && top[..at]
                .iter()
                .enumerate()
                .rev()
                .find(|(_, w)| CLAUSES.contains(w))
                .is_some_and(|(i, clause)| {
                    ["from", "join", "using"].contains(clause)
                        && !(*clause == "from" && i >= 1 && top[i - 1] == "distinct")
                })
    })
}

#[cfg(test)]
mod tests {
    use super::{highest_parameter, unfit, writes_only_through_claimed as names_claimed};

    #[test]
    fn an_effect_reads_claimed_only_where_it_names_it_as_a_word() {
        assert!(names_claimed("INSERT INTO t SELECT $1 FROM claimed"));
        assert!(names_claimed(
            "UPDATE t SET n = n + 1 FROM claimed WHERE t.id = $1"
        ));
        assert!(names_claimed("DELETE FROM t USING claimed WHERE t.id = $1"));
        assert!(!names_claimed("INSERT INTO t VALUES ($1)"));
        assert!(!names_claimed("INSERT INTO unclaimed SELECT $1"));
        assert!(!names_claimed("INSERT INTO t (claimed_at) VALUES (now())"));
        assert!(names_claimed("insert into t select $1 from CLAIMED"));
        assert!(names_claimed(
            "UPDATE t SET n = 1 FROM u, claimed WHERE t.id = $1"
        ));
        assert!(names_claimed(
            "INSERT INTO t SELECT $1 FROM u JOIN claimed ON true"
        ));
        // A column of that name, or the word in a literal or a comment: the statement would write for copies too.
        assert!(!names_claimed("INSERT INTO t VALUES ($1) -- from claimed"));
        assert!(!names_claimed(
            "INSERT INTO t VALUES ($1) /* from claimed */"
        ));
        assert!(names_claimed(
            "INSERT INTO t /* note */ SELECT $1 FROM -- here\n claimed"
        ));
        assert!(names_claimed(
            "INSERT INTO t SELECT 'it''s', $1 FROM claimed"
        ));
        assert!(!names_claimed(
            "UPDATE accounts SET balance = balance + $2, claimed = true WHERE id = $1"
        ));
        assert!(!names_claimed(
            "INSERT INTO t SELECT $1, 'from claimed' FROM u"
        ));
    }

    #[test]
    fn an_effect_that_could_write_for_a_copy_is_not_sent_with_the_claim() {
        let fit = [
            "INSERT INTO t SELECT $1 FROM (VALUES (1)) v, claimed",
            "INSERT INTO t SELECT $1 FROM claimed WHERE NOT EXISTS (SELECT 1 FROM t WHERE id = $1)",
            "INSERT INTO t SELECT count(*) FROM claimed GROUP BY 1",
            "INSERT INTO t SELECT $1, E'it\\'s' FROM claimed",
            "INSERT INTO t (a, b) SELECT $1, $2 FROM claimed ON CONFLICT (a) DO UPDATE SET b = EXCLUDED.b",
            "INSERT INTO t SELECT left($1::text, 160), right($2::text, 3) FROM claimed",
            "INSERT INTO mode (a) SELECT $1 FROM claimed",
            "INSERT INTO t SELECT $1 FROM claimed JOIN rank ON true",
            "INSERT INTO \"Orders\" (id) SELECT $1 FROM claimed",
            "INSERT INTO s.\"T\" (a) SELECT $1 FROM claimed",
            "INSERT INTO s.mode (a) SELECT $1 FROM claimed",
        ];
        for sql in fit {
            assert!(names_claimed(sql), "{sql}");
        }
        // Each of these writes a row when `claimed` has none.
        let unfit = [
            "INSERT INTO t SELECT $1 FROM (VALUES (1)) v LEFT JOIN claimed ON true",
            "INSERT INTO t SELECT $1 FROM (VALUES (1)) v LEFT OUTER JOIN claimed ON true",
            "INSERT INTO t SELECT $1 FROM claimed RIGHT JOIN u ON true",
            "INSERT INTO t SELECT $1 FROM claimed FULL JOIN u ON true",
            "INSERT INTO t SELECT $1 WHERE NOT EXISTS (SELECT FROM claimed)",
            "INSERT INTO t VALUES ($1, (SELECT 1 FROM claimed))",
            "INSERT INTO t SELECT $1 FROM claimed UNION ALL SELECT $1",
            "INSERT INTO t SELECT count(*) FROM claimed",
            "INSERT INTO t SELECT $1 FROM u AS claimed",
            "INSERT INTO t SELECT $1 FROM u claimed",
            "UPDATE t SET n = (SELECT 1 FROM claimed)",
            "INSERT INTO t SELECT $$ FROM claimed $$",
            "INSERT INTO t SELECT $x$ FROM claimed $x$",
            "INSERT INTO t SELECT E'\\' FROM claimed '",
            "INSERT INTO t SELECT 1 FROM \"claimed\"",
            "INSERT INTO t SELECT 1 /* /* nested */ FROM claimed */",
            "INSERT INTO t SELECT 1 FROM u) FROM claimed (",
            "INSERT INTO t SELECT $1, CAST(count(*) AS int) FROM claimed",
            "INSERT INTO t SELECT coalesce(max(1), 0) FROM claimed",
            "INSERT INTO t SELECT $1 FROM claimed HAVING true",
            "INSERT INTO t SELECT count(*) FROM claimed GROUP BY ()",
            "INSERT INTO t SELECT count(*) FROM claimed GROUP BY ROLLUP (1)",
            "INSERT INTO t SELECT count(*) FROM claimed GROUP BY GROUPING SETS ((), (1))",
            "INSERT INTO t SELECT $1 FROM u LEFT JOIN v JOIN claimed ON true ON true",
            "INSERT INTO t SELECT $1 FROM u LEFT JOIN v CROSS JOIN claimed ON true",
            "INSERT INTO t SELECT $1 FROM claimed LEFT JOIN u ON true",
            "UPDATE accounts SET n = 1 WHERE $3::bool IS DISTINCT FROM claimed",
            "INSERT INTO t SELECT 1 FROM claimed.log",
            "INSERT INTO t SELECT 1 FROM claimed$log",
            "INSERT INTO t SELECT any_value(1) FROM claimed",
            "INSERT INTO t SELECT regr_count(1, 1) FROM claimed",
            "INSERT INTO t SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY 1) FROM claimed",
            "INSERT INTO t SELECT count(*) FROM claimed GROUP BY ALL ()",
            "INSERT INTO t SELECT count(*) FROM claimed GROUP BY DISTINCT ()",
            "INSERT INTO t SELECT \"count\"(*) FROM claimed",
            "INSERT INTO t SELECT jsonb_agg_strict(1) FROM claimed",
            "INSERT INTO t SELECT json_object_agg_unique_strict(1, 1) FROM claimed",
            "INSERT INTO t SELECT 1 FROM u WINDOW w AS (), claimed AS ()",
            "INSERT INTO t SELECT pg_catalog.count(*) FROM claimed",
            "INSERT INTO t SELECT coalesce(pg_catalog.max(1), 0) FROM claimed",
            "INSERT INTO t SELECT \"pg_catalog\".count(*) FROM claimed",
            "INSERT INTO t SELECT pg_catalog.\"count\"(*) FROM claimed",
        ];
        for sql in unfit {
            assert!(!names_claimed(sql), "{sql}");
        }
    }

    #[test]
    fn only_a_data_modifying_statement_naming_claimed_goes_with_the_claim() {
        assert_eq!(unfit("  INSERT INTO t SELECT $1 FROM claimed"), None);
        assert_eq!(unfit("update t set n = 1 from claimed"), None);
        assert_eq!(unfit("DELETE FROM t USING claimed"), None);
        assert!(unfit("SELECT book($1) FROM claimed").is_some());
        assert!(unfit("WITH x AS (SELECT 1) INSERT INTO t SELECT 1 FROM claimed").is_some());
        assert!(unfit("INSERT INTO t VALUES ($1)").is_some());
        // The Parcel Tracker's own go with the claim.
        assert_eq!(unfit(crate::db::effects::CARRIER_RESERVATION_EFFECT), None);
        assert_eq!(unfit(crate::db::effects::NOTIFICATION_SENT_EFFECT), None);
    }

    #[test]
    fn the_highest_parameter_is_read_outside_string_literals() {
        assert_eq!(highest_parameter("SELECT $1, $12, $3 FROM claimed"), 12);
        assert_eq!(highest_parameter("SELECT '$9', $2 FROM claimed"), 2);
        assert_eq!(highest_parameter("SELECT $$x$$, 1"), 0);
        assert_eq!(highest_parameter("SELECT $q$ $7 $q$, $1"), 1);
        // A backslash-escaped quote in an E'' string does not end it.
        assert_eq!(highest_parameter("SELECT E'it\\'s $5', $2"), 2);
        assert_eq!(highest_parameter("SELECT 'a''b $6', $2 -- $9"), 2);
        assert_eq!(highest_parameter("SELECT a$1 FROM t, $3"), 3);
        assert_eq!(highest_parameter("SELECT 1"), 0);
    }
}
