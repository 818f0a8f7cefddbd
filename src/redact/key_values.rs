//! Passwords in connection strings that are not URLs: libpq's keyword/value form (`host=db password=…`) and .NET's
//! and ODBC's (`Host=db;Password=…;`), which other services' fault texts quote.

use super::MASK;

/// The keys whose values are passwords in a connection string that is not a URL: libpq's `password=…` (keyword/value
/// form) and .NET's and ODBC's `Password=…;`, `Pwd=…;` (another service's fault text quotes them).
const PASSWORD_KEYS: [&str; 2] = ["password", "pwd"];

/// Masks the value of every `password=`/`pwd=` key, in any case, of a connection string in free text (not a URL's:
/// [`super::url`] masks those): the key starts the text or follows a space, `;`, a quote or a bracket; the value runs to the
/// next `;` or space, or, quoted, to its closing quote (a doubled quote or a backslash escapes one inside).
pub(super) fn mask(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut from = 0;
    while let Some(eq) = lower[from..].find('=').map(|i| from + i) {
        from = eq + 1;
        let Some(key) = PASSWORD_KEYS
            .iter()
            .find(|key| lower[..eq].trim_end().ends_with(*key))
        else {
            continue;
        };
        let key_start = lower[..eq].trim_end().len() - key.len();
        let starts_key = lower[..key_start].chars().next_back().is_none_or(|c| {
            c.is_whitespace() || matches!(c, ';' | '"' | '\'' | '(' | '[' | '{' | ',')
        });
        let value_start = eq + 1 + (text[eq + 1..].len() - text[eq + 1..].trim_start().len());
        let value_end = value_end(text, value_start);
        if !starts_key || value_end == value_start {
            continue;
        }
        out.push_str(&text[copied..value_start]);
        out.push_str(MASK);
        copied = value_end;
        from = value_end;
    }
    out.push_str(&text[copied..]);
    out
}

/// Where the value starting at `start` ends: at its closing quote if it is quoted (the whole rest if none closes it),
/// else at the next `;` or space.
fn value_end(text: &str, start: usize) -> usize {
    let value = &text[start..];
    let Some(quote) = value.chars().next().filter(|c| matches!(c, '"' | '\'')) else {
        return start
            + value
                .find(|c: char| c == ';' || c.is_whitespace())
                .unwrap_or(value.len());
    };
    let mut chars = value.char_indices().skip(1).peekable();
    while let Some((i, c)) = chars.next() {
        if c == '\\' {
            chars.next();
        } else if c == quote {
            if chars.peek().is_some_and(|&(_, next)| next == quote) {
                chars.next();
            } else {
                return start + i + c.len_utf8();
            }
        }
    }
    text.len()
}

#[cfg(test)]
mod tests {
    use super::mask;

    #[test]
    fn a_net_connection_strings_password_is_masked_in_any_case() {
        assert_eq!(
            mask("Npgsql failed: Host=db;Username=app;Password=HunterSecret;Database=parcels"),
            "Npgsql failed: Host=db;Username=app;Password=***;Database=parcels"
        );
        assert_eq!(mask("Server=db;PWD=HunterSecret"), "Server=db;PWD=***");
        assert_eq!(
            mask("Server=db; password = HunterSecret ;"),
            "Server=db; password = *** ;"
        );
    }

    #[test]
    fn a_quoted_password_is_masked_to_its_closing_quote() {
        assert_eq!(
            mask("Password=\"a;b\"\"c d\";Host=x"),
            "Password=***;Host=x"
        );
        assert_eq!(
            mask("host=db password='a b\\' c' user=x"),
            "host=db password=*** user=x"
        );
        // Never closed: everything after it may be the password.
        assert_eq!(mask("Password='abc;Host=x"), "Password=***");
    }

    #[test]
    fn a_key_only_ending_in_password_or_an_empty_value_is_left() {
        for text in [
            "SslPassword=abc",
            "the `password=` parameter",
            "Password=;Host=x",
            "no password here",
            "password",
        ] {
            assert_eq!(mask(text), text);
        }
    }
}
