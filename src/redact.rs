//! Keeping passwords out of everything inboxctl prints.
//!
//! URLs are shown with their password replaced by `***`. Every password inboxctl was given is also registered here, so
//! that an error message from a driver that happens to echo it is scrubbed before it reaches a terminal or a log.

mod key_values;

use std::sync::{Mutex, OnceLock};

const MASK: &str = "***";

fn secrets() -> &'static Mutex<Vec<String>> {
    static SECRETS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    SECRETS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Remembers the password of `url` (if it has one, in its user information or as libpq's `password=` parameter),
/// so that [`text`] removes it wherever it appears. In a URL whose credentials cannot be told apart from the rest
/// (see [`url`]), everything after the first `:` of the masked part is taken for the password.
pub fn register_url(url: &str) {
    for (start, end) in password_spans(url) {
        let password = &url[start..end];
        register(password);
        if let Ok(decoded) = percent_decode(password) {
            register(&decoded);
        }
    }
}

/// Remembers a secret so that [`text`] removes it.
pub fn register(secret: &str) {
    // Very short strings would mask ordinary words; a password that short is shown masked in URLs anyway.
    if secret.len() < 3 {
        return;
    }
    // As a log line may show it too: escaped as `Debug` escapes a field's value, and as JSON does (a `"`, a `\`, a
    // control character in it).
    let quoted = |q: &str| -> String {
        q.strip_prefix('"')
            .and_then(|q| q.strip_suffix('"'))
            .unwrap_or(q)
            .to_owned()
    };
    let debug = quoted(&format!("{secret:?}"));
    let json = quoted(&serde_json::to_string(secret).unwrap_or_default());
    // A field logged with `?` in a JSON line: escaped as Debug does, then as JSON does.
    let json_of_debug = quoted(&serde_json::to_string(&debug).unwrap_or_default());
    let forms = [secret, &debug, &json, &json_of_debug];
    let mut list = secrets()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for form in forms {
        if form.len() >= 3 && !list.iter().any(|s| s == form) {
            list.push(form.to_owned());
        }
    }
    // Longest first, so a secret that contains another is masked whole.
    list.sort_by_key(|s| std::cmp::Reverse(s.len()));
}

/// `text` with every URL password masked and every registered secret replaced by `***`.
pub fn text(text: &str) -> String {
    let mut out = mask_urls(text);
    let list = secrets()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for secret in list.iter() {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), MASK);
        }
    }
    out
}

/// [`text`], then cut to `max` bytes ([`crate::amqp::limits::truncate`]). Masked first: cut first, a URL's `@` cut
/// off leaves no user information to find, and the start of its password was shown.
pub fn text_cut(text: &str, max: usize) -> String {
    crate::amqp::limits::truncate(&self::text(text), max).into_owned()
}

/// `url` with its password replaced by `***`: in the user information, and in a `password=` parameter. Safe for any
/// string, a URL that does not parse included: when the credentials are ambiguous (see [`credentials_ambiguous`]),
/// everything between `//` and the last `@` is masked, user name included.
pub fn url(url: &str) -> String {
    let mut spans = mask_spans(url);
    spans.sort_unstable();
    let mut out = String::with_capacity(url.len());
    let mut shown = 0;
    for (start, end) in spans {
        // Overlapping spans are masked as one.
        if start >= shown {
            out.push_str(&url[shown..start]);
            out.push_str(MASK);
        }
        shown = shown.max(end);
    }
    out.push_str(&url[shown..]);
    out
}

/// Whether `url` carries a password: in its user information, or as a `password=` parameter (not another parameter
/// named for one, such as a client key's `sslpassword=`: that one is no login password).
///
/// The user information is read as the drivers' URL parser reads it: in the authority (up to the first `/`, `?` or
/// `#`), to its last `@` — so an `@` after the host, in a vhost or a parameter (`amqp://app@rabbit:5672/team@eu`), is
/// no password, and a user name holding an `@` (`ops@corp:pw@db`) keeps its password. An authority cut short before
/// any `@` by a password holding an unencoded `/`, `?` or `#` (`u:pa/ss@h`) still has one when what follows its last
/// colon is no port (masking takes the whole ambiguous part either way).
pub fn has_password(url: &str) -> bool {
    let rest = &url[authority_start(url).unwrap_or(url.len())..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let in_userinfo = match authority.rfind('@') {
        Some(at) => authority[..at]
            .find(':')
            .is_some_and(|colon| colon + 1 < at),
        None => {
            credentials_ambiguous(url)
                && authority.rsplit_once(':').is_some_and(|(_, after)| {
                    !after.is_empty() && !after.bytes().all(|b| b.is_ascii_digit())
                })
        }
    };
    in_userinfo
        || query_password_parameters(url)
            .iter()
            .any(|p| p.plain && p.value_start < p.end)
}

/// `url` without the query parameters named for a password that are not libpq's `password=` (`sslpassword=`), and
/// whether it had any: the driver knows none of them, and would log each, value and all, as it ignores it.
pub fn without_unused_password_parameters(url: &str) -> (String, bool) {
    let unused: Vec<PasswordParameter> = query_password_parameters(url)
        .into_iter()
        .filter(|p| !p.plain)
        .collect();
    if unused.is_empty() {
        return (url.to_owned(), false);
    }
    let mut out = String::with_capacity(url.len());
    let mut from = 0;
    for p in &unused {
        // The parameter and the `&` after it (or, the last one, the separator before it).
        let (cut_from, cut_to) = if p.end < url.len() {
            (p.name_start, p.end + 1)
        } else {
            (p.name_start - 1, p.end)
        };
        out.push_str(&url[from..cut_from.max(from)]);
        from = cut_to;
    }
    out.push_str(&url[from.min(url.len())..]);
    (out, true)
}

/// Whether `url`'s `password=` parameter is followed by a part the driver does not know as a parameter: an `&` of the
/// password not percent-encoded, maybe. The driver cuts the password at every `&` and logs each part it does not
/// know, value and all, as it ignores it; masking takes the password whole, so that logged part would be a piece of
/// it no mask matches.
pub fn password_parameter_holds_ampersand(url: &str) -> bool {
    let Some((_, query)) = url.split_once('?') else {
        return false;
    };
    let query = query.split('#').next().unwrap_or(query);
    let mut after_password = false;
    for part in query.split('&') {
        // The driver skips an empty part (`&&`, a trailing `&`).
        if part.is_empty() {
            continue;
        }
        let raw = part.split('=').next().unwrap_or(part);
        let name = percent_decode(raw).unwrap_or_else(|()| raw.to_owned());
        if name == "password" {
            after_password = true;
        } else if after_password {
            if !driver_parameter(&name) {
                return true;
            }
            after_password = false;
        }
    }
    false
}

/// Whether the PostgreSQL driver reads a URL parameter of this name (or drops it before: named for a password).
fn driver_parameter(name: &str) -> bool {
    const KNOWN: [&str; 18] = [
        "sslmode",
        "ssl-mode",
        "sslrootcert",
        "ssl-root-cert",
        "ssl-ca",
        "sslcert",
        "ssl-cert",
        "sslkey",
        "ssl-key",
        "statement-cache-capacity",
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "application_name",
        "options",
    ];
    KNOWN.contains(&name)
        || (name.starts_with("options[") && name.ends_with(']'))
        || name.to_ascii_lowercase().ends_with("password")
}

/// Whether the user information of `url` cannot be told from the rest: an `@` comes after a `/`, `?` or `#` that a
/// URL parser takes for the end of the host, so a user name or password holds one of them unencoded (or the path or
/// query holds an `@`). The usual cause is a password with `/`, `?` or `#` that was not percent-encoded.
pub fn credentials_ambiguous(url: &str) -> bool {
    userinfo(url).is_some_and(|u| !u.clear)
}

/// The user information of a URL: from after `//` (in a string without one, after the first `:`) to the last `@`.
struct Userinfo {
    start: usize,
    /// The byte offset of the last `@`.
    end: usize,
    /// No `/`, `?` or `#` in it: every URL parser reads it the same way.
    clear: bool,
}

/// Where the authority (user information, host, port) begins: after `//` (in a string without one, after the first
/// `:`).
fn authority_start(url: &str) -> Option<usize> {
    match url.find("//") {
        Some(i) => Some(i + 2),
        None => url.find(':').map(|i| i + 1),
    }
}

fn userinfo(url: &str) -> Option<Userinfo> {
    let start = authority_start(url)?;
    let end = start + url[start..].rfind('@')?;
    Some(Userinfo {
        start,
        end,
        clear: !url[start..end].contains(['/', '?', '#']),
    })
}

/// The byte spans to mask: the password of clear user information, all of ambiguous user information, and the value
/// of a `password=` parameter.
fn mask_spans(url: &str) -> Vec<(usize, usize)> {
    let mut spans = Vec::with_capacity(2);
    if let Some(u) = userinfo(url) {
        if u.clear {
            if let Some(colon) = url[u.start..u.end].find(':') {
                spans.push((u.start + colon + 1, u.end));
            }
        } else {
            spans.push((u.start, u.end));
        }
    }
    spans.extend(query_password_spans(url));
    spans
}

/// The byte spans of what a URL's passwords may be: the user information's after its first `:` (a user name holds
/// no unencoded `:`), and a `password=` parameter's value.
fn password_spans(url: &str) -> Vec<(usize, usize)> {
    let mut spans = Vec::with_capacity(2);
    if let Some(u) = userinfo(url)
        && let Some(colon) = url[u.start..u.end].find(':')
        && u.start + colon + 1 < u.end
    {
        spans.push((u.start + colon + 1, u.end));
    }
    spans.extend(
        query_password_spans(url)
            .into_iter()
            .filter(|(start, end)| start < end),
    );
    spans
}

/// The byte spans of the values of the query parameters named `password=` (libpq's URLs accept one) or ending in
/// `password=` (`sslpassword=`, the client key's passphrase, which sqlx does not know and logs as it ignores it). A
/// value runs to the next `&` that starts another parameter (`name=`), else to the end: an unencoded `&` or `#` in a
/// password is kept inside the span rather than shown.
fn query_password_spans(url: &str) -> Vec<(usize, usize)> {
    query_password_parameters(url)
        .into_iter()
        .map(|p| (p.value_start, p.end))
        .collect()
}

/// A query parameter named for a password: where its name starts (after its `?` or `&`), where its value starts,
/// where it ends, and whether it is libpq's own `password=`.
struct PasswordParameter {
    name_start: usize,
    value_start: usize,
    end: usize,
    plain: bool,
}

fn query_password_parameters(url: &str) -> Vec<PasswordParameter> {
    let mut spans = Vec::new();
    let Some(query) = url.find('?') else {
        return spans;
    };
    let mut at = query + 1;
    loop {
        let rest = &url[at..];
        let name_end = rest.find('=').filter(|&eq| rest[..eq].find('&').is_none());
        let next = |from: usize| {
            url[from..]
                .match_indices('&')
                .map(|(i, _)| from + i)
                .find(|&amp| starts_parameter(&url[amp + 1..]))
        };
        // The driver decodes a parameter's name before it reads it: `pass%77ord=` is `password=`. Named for a
        // password in any case (`Password=`, which the driver ignores and would log, value and all).
        let name = name_end
            .map(|eq| percent_decode(&rest[..eq]).unwrap_or_else(|()| rest[..eq].to_owned()));
        match (name_end, name) {
            (Some(eq), Some(name)) if name.to_ascii_lowercase().ends_with("password") => {
                let start = at + eq + 1;
                let end = next(start).unwrap_or(url.len());
                spans.push(PasswordParameter {
                    name_start: at,
                    value_start: start,
                    end,
                    plain: name == "password",
                });
                if end == url.len() {
                    return spans;
                }
                at = end + 1;
            }
            _ => match rest.find('&') {
                Some(amp) => at += amp + 1,
                None => return spans,
            },
        }
    }
}

/// Whether `s` starts with a parameter's `name=`: a libpq-style name, or one the driver reads (`ssl-mode`,
/// `statement-cache-capacity`, `options[…]`), percent-decoded as the driver decodes it.
fn starts_parameter(s: &str) -> bool {
    s.find('=').is_some_and(|eq| {
        let raw = &s[..eq];
        let name = percent_decode(raw).unwrap_or_else(|()| raw.to_owned());
        eq > 0
            && !name.contains('&')
            && (name.chars().all(|c| c.is_ascii_lowercase() || c == '_') || driver_parameter(&name))
    })
}

/// Masks the password of every `scheme://user:password@` in free text.
fn mask_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        // The URL starts at the scheme, which runs back to the last character that cannot be in a scheme.
        let start = rest[..pos]
            .char_indices()
            .rev()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || c == '+' || c == '-' || c == '.'))
            .map_or(0, |(i, c)| i + c.len_utf8());
        let mut end = rest[pos..]
            .find(|c: char| c.is_whitespace() || c == '"' || c == '\'' || c == '`' || c == '>')
            .map_or(rest.len(), |i| pos + i);
        // A password may hold a quote, a backtick or `>` (`postgres://app:It's-Secret@db`): a `user:` cut short of its
        // `@` by one runs on to an `@` before the next blank, which is where its user information ends.
        if !rest[pos..end].contains('@') && rest[pos + 3..end].contains(':') {
            let blank = rest[end..]
                .find(char::is_whitespace)
                .map_or(rest.len(), |i| end + i);
            if rest[end..blank].contains('@') {
                end = blank;
            }
        }
        out.push_str(&key_values::mask(&rest[..start]));
        // A URL's own `;password=` (JDBC's `jdbc:sqlserver://db;user=sa;password=…`) as in free text.
        out.push_str(&key_values::mask(&url(&rest[start..end])));
        rest = &rest[end..];
    }
    out.push_str(&key_values::mask(rest));
    out
}

fn percent_decode(s: &str) -> Result<String, ()> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).map_err(|_| ())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| ())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| ())
}

#[cfg(test)]
mod tests;
