//! Keeping passwords out of everything inboxctl prints.
//!
//! URLs are shown with their password replaced by `***`. Every password inboxctl was given is also registered here, so
//! that an error message from a driver that happens to echo it is scrubbed before it reaches a terminal or a log.

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
        let end = rest[pos..]
            .find(|c: char| c.is_whitespace() || c == '"' || c == '\'' || c == '`' || c == '>')
            .map_or(rest.len(), |i| pos + i);
        out.push_str(&rest[..start]);
        out.push_str(&url(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
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
mod tests {
    use super::*;

    #[test]
    fn masks_the_password_of_a_url() {
        assert_eq!(
            url("postgres://app:s3cret@db.internal:5432/parcels?sslmode=require"),
            "postgres://app:***@db.internal:5432/parcels?sslmode=require"
        );
        assert_eq!(
            url("amqp://guest@127.0.0.1:5672/%2f"),
            "amqp://guest@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            url("amqp://127.0.0.1:5672/%2f"),
            "amqp://127.0.0.1:5672/%2f"
        );
        assert_eq!(url("amqp://u:p%40ss@h/v"), "amqp://u:***@h/v");
        assert_eq!(
            url("postgres://app@db/parcels?sslmode=require&password=s3cret-q&application_name=x"),
            "postgres://app@db/parcels?sslmode=require&password=***&application_name=x"
        );
        assert!(has_password("postgres://app@db/parcels?password=s3cret-q"));
        assert!(!has_password("postgres://app@db/parcels?sslmode=require"));
    }

    #[test]
    fn an_unencoded_slash_question_mark_or_hash_masks_everything_up_to_the_last_at() {
        for (given, shown) in [
            (
                "postgres://postgres:pa#ss@127.0.0.1:5432/db",
                "postgres://***@127.0.0.1:5432/db",
            ),
            (
                "postgres://postgres:pa/s?s@127.0.0.1:5432/db",
                "postgres://***@127.0.0.1:5432/db",
            ),
            ("amqp://u:p@s/s@h/v", "amqp://***@h/v"),
            // An @ in the password but no / ? #: the user information is still clear.
            ("amqp://u:p@ss@h/v", "amqp://u:***@h/v"),
            // No // at all: from the scheme's colon.
            ("amqp:u:pw#x@h", "amqp:***@h"),
            // A password parameter holding an @ is masked whole, with what it makes ambiguous.
            (
                "postgres://app@db/x?password=p@ss&a=b",
                "postgres://***&a=b",
            ),
        ] {
            assert_eq!(url(given), shown, "{given}");
            assert!(has_password(given), "{given}");
        }
        // An @ after the host, in a vhost or a parameter: no password (a password file beside it was refused as a
        // second one).
        for given in [
            "amqp://app@rabbit:5672/team@eu",
            "postgres://app@db:5432/x?sslrootcert=/etc/ssl/ca@2025.pem",
            "postgres://db:5432/app?application_name=svc@n1",
            "amqp://rabbit:5672/team@eu",
            "amqp://[::1]:5672/team@eu",
        ] {
            assert!(!has_password(given), "{given}");
        }
        // As the drivers read them: the last @ of the authority ends the user information.
        for given in [
            "amqp://app:pw@rabbit:5672/team@eu",
            "postgres://ops@corp:S3cret@db:5432/app?sslrootcert=/etc/ssl/ca@2025.pem",
            "amqp://app:@dm1n@rabbit:5672/team@eu",
        ] {
            assert!(has_password(given), "{given}");
        }
        assert!(credentials_ambiguous("postgres://postgres:pa#ss@h/db"));
        assert!(!credentials_ambiguous("postgres://postgres:pa@ss@h/db"));
        assert!(!credentials_ambiguous("postgres://h/db"));
    }

    #[test]
    fn any_string_is_safe_to_mask() {
        for given in [
            "",
            "@",
            "//",
            "//@",
            ":@",
            "a:b",
            "?password=",
            "p://u:é@h",
            "x://@@@",
        ] {
            let _ = url(given);
            let _ = has_password(given);
        }
    }

    proptest::proptest! {
        /// Whatever a password holds, written into a URL raw or percent-encoded, `url` never shows it, and once the URL
        /// is registered neither does `text`.
        #[test]
        fn no_password_survives_masking(
            password in "[a-zA-Z0-9@#/?:%&=+ é€😀\\u{202e}-]{8,24}",
            user in "[a-z@]{0,6}",
        ) {
            let encoded = url::form_urlencoded::byte_serialize(password.as_bytes()).collect::<String>();
            for written in [password.as_str(), encoded.as_str()] {
                let mut forms = vec![
                    format!("postgres://{user}:{written}@127.0.0.1:5432/db?sslmode=disable"),
                    format!("amqp://{user}:{written}@127.0.0.1:5672/%2f"),
                ];
                // An unencoded & starts the next parameter for every parser: what follows it cannot be told from one.
                if !written.contains('&') {
                    forms.push(format!("postgres://{user}@127.0.0.1:5432/db?password={written}&sslmode=disable"));
                }
                for given in forms {
                    let shown = url(&given);
                    let template = given.replace(written, "");
                    proptest::prop_assume!(!template.contains(password.as_str()));
                    proptest::prop_assert!(!shown.contains(password.as_str()), "{given} -> {shown}");
                    proptest::prop_assert!(!shown.contains(written), "{given} -> {shown}");
                    register_url(&given);
                    let scrubbed = text(&format!("error near {written} in {given}: {password}"));
                    proptest::prop_assert!(!scrubbed.contains(password.as_str()), "{scrubbed}");
                }
            }
        }
    }

    #[test]
    fn every_parameter_named_for_a_password_is_masked_and_registered() {
        assert_eq!(
            url(
                "postgres://a@h/d?sslkey=/k.pem&sslpassword=KeyPhr4se-x&sslmode=require&password=pw2-x"
            ),
            "postgres://a@h/d?sslkey=/k.pem&sslpassword=***&sslmode=require&password=***"
        );
        assert_eq!(
            url("postgres://a@h/d?application_name=password&sslmode=require"),
            "postgres://a@h/d?application_name=password&sslmode=require",
            "a value is not a name"
        );
        register_url("postgres://a@h/d?sslpassword=KeyPhr4se-y");
        assert_eq!(
            text("ignoring unrecognized connect parameter key=sslpassword value=KeyPhr4se-y"),
            "ignoring unrecognized connect parameter key=sslpassword value=***"
        );
        // No login password: a password file may give one.
        assert!(!has_password("postgres://a@h/d?sslpassword=k3y"));
        assert!(has_password("postgres://a@h/d?sslpassword=k3y&password=p"));
        for (given, driver) in [
            (
                "postgres://a@h/d?sslpassword=k&ey&sslmode=require",
                "postgres://a@h/d?sslmode=require",
            ),
            (
                "postgres://a@h/d?sslmode=require&sslpassword=k+y",
                "postgres://a@h/d?sslmode=require",
            ),
            ("postgres://a@h/d?sslpassword=k", "postgres://a@h/d"),
            (
                "postgres://a@h/d?password=p&sslpassword=k&x=1",
                "postgres://a@h/d?password=p&x=1",
            ),
        ] {
            assert_eq!(
                without_unused_password_parameters(given),
                (driver.to_owned(), true)
            );
        }
        assert_eq!(
            without_unused_password_parameters("postgres://a@h/d?password=p"),
            ("postgres://a@h/d?password=p".to_owned(), false)
        );
    }

    /// The driver decodes names (`pass%77ord=` logs in with its value): masked, and taken as the login's password.
    /// `Password=` it ignores, and would log: masked, and left out of what it is given.
    #[test]
    fn a_password_parameter_whose_name_is_encoded_or_capitalised_is_masked() {
        let encoded = "postgres://app@db/parcels?sslmode=disable&pass%77ord=S3cretX";
        assert_eq!(
            url(encoded),
            "postgres://app@db/parcels?sslmode=disable&pass%77ord=***"
        );
        assert!(has_password(encoded));
        let capital = "postgres://app@db/parcels?Password=S3cretY";
        assert_eq!(url(capital), "postgres://app@db/parcels?Password=***");
        assert!(
            !without_unused_password_parameters(capital)
                .0
                .contains("S3cretY")
        );
        // The password the driver reads is what is registered, not the parameters after it.
        assert_eq!(
            url("postgres://app@db/x?password=s3cretQ&ssl-mode=require&options[search_path]=app"),
            "postgres://app@db/x?password=***&ssl-mode=require&options[search_path]=app"
        );
        for cut in [
            "postgres://app@db/parcels?password=Tr0ub&4dor&sslmode=require",
            "postgres://app@db/parcels?password=pa&ss=word",
            "postgres://app@db/parcels?sslmode=disable&password=x&y",
        ] {
            assert!(password_parameter_holds_ampersand(cut), "{cut}");
        }
        // Parameters the driver reads, after a password: nothing of it is cut.
        for whole in [
            "postgres://app@db/parcels?password=Tr0ub%264dor&sslmode=require",
            "postgres://app@db/x?password=s3cret&ssl-mode=require&statement-cache-capacity=0",
            "postgres://app@db/x?password=s3cret&options[search_path]=app",
            "postgres://app@db/x?password=s3cret",
            "postgres://app@db/x?sslmode=require",
            "postgres://app@db/x?password=s3cret&&sslmode=require",
            "postgres://app@db/x?password=s3cret&",
        ] {
            assert!(!password_parameter_holds_ampersand(whole), "{whole}");
        }
    }

    #[test]
    fn registers_a_password_given_as_a_parameter() {
        register_url("postgres://app@db/x?password=q-param-pw");
        assert_eq!(
            text("password q-param-pw rejected"),
            "password *** rejected"
        );
    }

    #[test]
    fn masks_urls_and_registered_secrets_in_free_text() {
        register_url("postgres://app:hunter2hunter2@db/x");
        let out = text(
            "connect postgres://app:hunter2hunter2@db/x failed: password hunter2hunter2 rejected",
        );
        assert!(!out.contains("hunter2hunter2"), "{out}");
        assert!(out.contains("postgres://app:***@db/x"), "{out}");
    }

    #[test]
    fn registers_the_decoded_password_too() {
        register_url("amqp://u:p%40ssw0rd-x@h/v");
        assert_eq!(text("auth p@ssw0rd-x failed"), "auth *** failed");
    }
}
