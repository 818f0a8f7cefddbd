//! Passwords in connection strings that are not URLs: libpq's keyword/value form (`host=db password=…`) and .NET's
//! and ODBC's (`Host=db;Password=…;`), which other services' fault texts quote.

use super::MASK;

/// The keys whose values are passwords in a connection string that is not a URL: libpq's `password=…` (keyword/value
/// form) and .NET's and ODBC's `Password=…;`, `Pwd=…;` (another service's fault text quotes them).
const PASSWORD_KEYS: [&str; 2] = ["password", "pwd"];

/// Masks the value of every `password=`/`pwd=` key, in any case, of a connection string in free text (not a URL's:
/// [`super::url`] masks those): the key starts the text or follows a space, `;`, a quote, a bracket, or a query's `?`
/// or `&` (`/token?username=svc&password=…` without a scheme). Where its value
/// ends: see [`value_end`]; what is not sure to be past it is masked with it.
pub(super) fn mask(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut from = 0;
    while let Some(eq) = lower[from..].find('=').map(|i| from + i) {
        from = eq + 1;
        let before = lower[..eq].trim_end();
        let Some(key) = PASSWORD_KEYS.iter().find(|key| before.ends_with(*key)) else {
            continue;
        };
        let preceding = before[..before.len() - key.len()].chars().next_back();
        let starts_key = preceding.is_none_or(|c| {
            c.is_whitespace() || matches!(c, ';' | '"' | '\'' | '(' | '[' | '{' | ',' | '?' | '&')
        });
        if !starts_key {
            continue;
        }
        let value_start = eq + 1 + (text[eq + 1..].len() - text[eq + 1..].trim_start().len());
        // A query's parameter ends at the next `&` (or `#`, or a blank).
        let value_end = if matches!(preceding, Some('?' | '&')) {
            text[value_start..]
                .find(|c: char| c == '&' || c == '#' || c.is_whitespace())
                .map_or(text.len(), |i| value_start + i)
        } else {
            value_end(text, value_start)
        };
        if value_end == value_start {
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

/// Where the value starting at `start` ends:
/// - quoted (`"…"`, `'…'`, a doubled quote or a backslash escaping one inside; `\"…\"` as a JSON line writes it;
///   ODBC's `{…}`, `}}` escaping a brace): at its closing quote, the whole rest if none closes it;
/// - else at the next `;` or line end, or at a space followed by another key (`user=`, libpq's form) or by nothing: a
///   .NET value may hold spaces (`Password=correct horse battery;`).
fn value_end(text: &str, start: usize) -> usize {
    let value = &text[start..];
    if let Some(rest) = value.strip_prefix("\\\"") {
        return rest.find("\\\"").map_or(text.len(), |i| start + 2 + i + 2);
    }
    let closing = match value.chars().next() {
        Some(quote @ ('"' | '\'')) => quote,
        Some('{') => '}',
        _ => return unquoted_end(text, start),
    };
    let mut chars = value.char_indices().skip(1).peekable();
    while let Some((i, c)) = chars.next() {
        if c == '\\' && closing != '}' {
            chars.next();
        } else if c == closing {
            if chars.peek().is_some_and(|&(_, next)| next == closing) {
                chars.next();
            } else {
                return start + i + c.len_utf8();
            }
        }
    }
    text.len()
}

fn unquoted_end(text: &str, start: usize) -> usize {
    let value = &text[start..];
    let mut at = 0;
    while let Some(i) = value[at..].find(|c: char| c == ';' || c.is_whitespace()) {
        let pos = at + i;
        let c = value[pos..].chars().next().unwrap_or(';');
        if matches!(c, ';' | '\n' | '\r') {
            return start + value[..pos].trim_end().len();
        }
        let after = value[pos..].trim_start_matches([' ', '\t']);
        if after.is_empty() || after.starts_with([';', '\n', '\r']) || starts_another_key(after) {
            return start + pos;
        }
        at = pos + c.len_utf8();
    }
    text.len()
}

/// Whether `s` begins with `name=`: a word of letters, digits and `_`, then `=`.
fn starts_another_key(s: &str) -> bool {
    let name = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    name > 0 && s[name..].trim_start().starts_with('=')
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
        assert_eq!(
            mask("Password=correct horse battery;Host=x"),
            "Password=***;Host=x"
        );
        assert_eq!(mask("Pwd={a;b}}c d};Server=x"), "Pwd=***;Server=x");
    }

    #[test]
    fn libpqs_form_ends_a_value_at_the_next_key_or_masks_the_rest_of_the_line() {
        assert_eq!(
            mask("host=db password=HunterSecret user=app"),
            "host=db password=*** user=app"
        );
        assert_eq!(
            mask("password=Hunter Secret, then more\nnext line"),
            "password=***\nnext line"
        );
    }

    #[test]
    fn a_quote_escaped_as_a_json_line_writes_it_is_a_quote() {
        assert_eq!(
            mask(r#"{"reason":"Host=db;Password=\"a b\";Database=x"}"#),
            r#"{"reason":"Host=db;Password=***;Database=x"}"#
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
