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
/// so that [`text`] removes it wherever it appears.
pub fn register_url(url: &str) {
    for password in password_of(url).into_iter().chain(query_password(url)) {
        register(&password);
        if let Ok(decoded) = percent_decode(&password) {
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
    let mut list = secrets()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !list.iter().any(|s| s == secret) {
        list.push(secret.to_owned());
        // Longest first, so a secret that contains another is masked whole.
        list.sort_by_key(|s| std::cmp::Reverse(s.len()));
    }
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

/// A URL with its password, if any, replaced by `***` (in the user information, and a `password=` parameter).
pub fn url(url: &str) -> String {
    let masked = match userinfo_span(url) {
        Some((_, Some(password))) => format!("{}{MASK}{}", &url[..password.0], &url[password.1..]),
        _ => url.to_owned(),
    };
    match query_password_span(&masked) {
        Some((start, end)) => format!("{}{MASK}{}", &masked[..start], &masked[end..]),
        None => masked,
    }
}

/// Whether `url` carries a password: in its user information, or as a `password=` parameter.
pub fn has_password(url: &str) -> bool {
    password_of(url).is_some() || query_password(url).is_some()
}

fn query_password(url: &str) -> Option<String> {
    let (start, end) = query_password_span(url)?;
    Some(url[start..end].to_owned())
}

/// The byte span of the value of a `password=` query parameter (libpq's URLs accept one).
fn query_password_span(url: &str) -> Option<(usize, usize)> {
    let query_start = url.find('?')? + 1;
    let query_end = url[query_start..]
        .find('#')
        .map_or(url.len(), |i| query_start + i);
    let mut offset = query_start;
    for pair in url[query_start..query_end].split('&') {
        if let Some(value) = pair.strip_prefix("password=") {
            let start = offset + "password=".len();
            return (!value.is_empty()).then_some((start, start + value.len()));
        }
        offset += pair.len() + 1;
    }
    None
}

/// The password written in `url`'s user information, if it has one (percent-encoded as written).
fn password_of(url: &str) -> Option<String> {
    let (_, password) = userinfo_span(url)?;
    let (start, end) = password?;
    Some(url[start..end].to_owned())
}

/// For `scheme://user:password@host…`: the byte span of the userinfo and of the password in it.
#[allow(clippy::type_complexity)]
fn userinfo_span(url: &str) -> Option<((usize, usize), Option<(usize, usize)>)> {
    let scheme_end = url.find("://")? + 3;
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let at = authority.rfind('@')?;
    let userinfo = (scheme_end, scheme_end + at);
    let password = authority[..at]
        .find(':')
        .map(|colon| (scheme_end + colon + 1, scheme_end + at));
    Some((userinfo, password))
}

/// Masks the password of every `scheme://user:password@` in free text.
fn mask_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        // The URL starts at the scheme, which runs back to the last character that cannot be in a scheme.
        let start = rest[..pos]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '+' || c == '-' || c == '.'))
            .map_or(0, |i| i + 1);
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
