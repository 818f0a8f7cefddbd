//! A failure's fingerprint: what kind of failure (the exception type) and its reason with what varies from one
//! message to the next masked — ids, numbers, quoted values — so that one cause is one group however many messages it
//! failed, and a short id that stays the same from one run (and one machine) to the next.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::failure::Failure;

/// The cause of a failure: what groups dead-lettered messages that failed for one reason.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Cause {
    /// The short id of the two below ([`id`]).
    pub fingerprint: String,
    /// `MT-Fault-ExceptionType`, `rabbitmq:<reason>` or `skipped` (`-` when nothing says).
    pub exception_type: String,
    /// The reason, masked ([`mask`]; `-` when there is none).
    pub reason: String,
}

impl Cause {
    pub fn of(failure: &Failure) -> Self {
        let exception_type = failure.exception_type.as_deref().unwrap_or("-");
        let exception_type = super::limits::truncate(exception_type, 256).into_owned();
        let raw = failure.reason.as_deref();
        let reason = raw.map_or_else(|| "-".to_owned(), mask);
        // Shown masked of passwords too (another service's fault may quote a URL with its password; `mask` hides
        // only the words holding a digit); the fingerprint is the unmasked text's, so that a group keeps its id
        // whatever secrets the process that reads it was given.
        let shown = raw.map_or_else(|| "-".to_owned(), |r| mask(&crate::redact::text(r)));
        Self {
            fingerprint: id(&exception_type, &reason),
            exception_type,
            reason: shown,
        }
    }
}

/// The most of a reason that is read: a reason is a header any producer can fill, and one cause is recognisable long
/// before this.
pub const MAX_REASON: usize = 1024;

/// The reason with its varying parts masked as `#`: every word holding a digit (numbers, UUIDs, tracking numbers,
/// hex ids), and every quoted value (`'…'`, `"…"`, `` `…` ``). One exception: an HTTP status after `returned`,
/// `status`, `HTTP` or `code` is kept (`carrier API returned 503` and `… returned 404` are two causes, not one).
pub fn mask(reason: &str) -> String {
    let reason = crate::amqp::limits::truncate(reason, MAX_REASON);
    let mut out = String::with_capacity(reason.len());
    let mut chars = reason.char_indices().peekable();
    let mut previous_word = String::new();
    while let Some((start, c)) = chars.next() {
        let opens = out.chars().next_back().is_none_or(|p| !is_word_char(p));
        if matches!(c, '\'' | '"' | '`')
            && opens
            && let Some(end) = reason[start + 1..].find(c)
        {
            out.push(c);
            out.push('#');
            out.push(c);
            while chars.peek().is_some_and(|&(i, _)| i <= start + 1 + end) {
                chars.next();
            }
            previous_word.clear();
            continue;
        }
        if is_word_char(c) {
            let mut end = start + c.len_utf8();
            while let Some(&(i, next)) = chars.peek() {
                if !is_word_char(next) {
                    break;
                }
                end = i + next.len_utf8();
                chars.next();
            }
            let word = &reason[start..end];
            if !word.bytes().any(|b| b.is_ascii_digit()) || is_status(&previous_word, word) {
                out.push_str(word);
            } else {
                out.push('#');
            }
            previous_word = word.to_ascii_lowercase();
            continue;
        }
        if !c.is_whitespace() && c != ':' {
            previous_word.clear();
        }
        out.push(c);
    }
    out
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_' || c == '-'
}

/// An HTTP status code right after a word that announces one.
fn is_status(previous: &str, word: &str) -> bool {
    matches!(previous, "returned" | "status" | "http" | "code")
        && word.len() == 3
        && word.parse::<u16>().is_ok_and(|n| (100..600).contains(&n))
}

/// The short id of a fingerprint: the first 10 hex digits of SHA-256 over the exception type and the masked reason.
pub fn id(exception_type: &str, masked_reason: &str) -> String {
    let digest = Sha256::new()
        .chain_update(exception_type.as_bytes())
        .chain_update([0])
        .chain_update(masked_reason.as_bytes())
        .finalize();
    digest[..5].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_varies_is_masked_and_the_cause_stays() {
        for (reason, masked) in [
            ("timeout after 30000 ms", "timeout after # ms"),
            ("carrier API returned 503", "carrier API returned 503"),
            (
                "carrier API returned status: 404",
                "carrier API returned status: 404",
            ),
            ("HTTP 599 from carrier", "HTTP 599 from carrier"),
            ("HTTP 600 from carrier", "HTTP # from carrier"),
            (
                "parcel 1a280000-161d-4c08-9e18-08df4f1e91b6 not found",
                "parcel # not found",
            ),
            (
                "tracking number PT00000001NL is taken",
                "tracking number # is taken",
            ),
            (
                "destination 'Atlantis' is unknown",
                "destination '#' is unknown",
            ),
            ("key \"a b c\" and `x`", "key \"#\" and `#`"),
            ("an unclosed 'quote 12", "an unclosed 'quote #"),
            ("can't find parcel's slot 7", "can't find parcel's slot #"),
            ("retry 3 of 5, then 7.5s", "retry # of #, then #.#"),
            ("Größe 12 überschritten", "Größe # überschritten"),
        ] {
            assert_eq!(mask(reason), masked, "{reason}");
        }
    }

    #[test]
    fn one_cause_with_varying_ids_has_one_id_and_two_causes_two() {
        let a = id("System.TimeoutException", &mask("timeout after 30000 ms"));
        let b = id("System.TimeoutException", &mask("timeout after 12 ms"));
        let c = id(
            "System.InvalidOperationException",
            &mask("timeout after 12 ms"),
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 10);
        // Stable from one build to the next: written in listings that later runs read.
        assert_eq!(id("", ""), "6e340b9cff");
    }

    #[test]
    fn a_long_hostile_reason_is_bounded() {
        let long = "x".repeat(100_000);
        assert!(mask(&long).len() <= MAX_REASON);
        let quotes = "'".repeat(10_000);
        // An empty pair becomes three characters: at most half as long again.
        assert!(mask(&quotes).len() <= MAX_REASON * 3 / 2 + 1);
    }
}
