//! Text from the database, the broker or a message is never written to a terminal as it is: an escape sequence in a
//! consumer_type or a failure reason could move the cursor, retitle the window or worse. What cannot be printed is
//! shown escaped, so it stays visible and inert.

use std::borrow::Cow;
use std::fmt::Write;

/// `s` with every control character (C0, DEL, C1) and every bidirectional override written as a visible `\u{…}` escape.
/// A backslash is doubled so that an escape in the output is always one inboxctl wrote.
pub fn text(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c == '\\' {
            out.push_str("\\\\");
        } else if needs_escape(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Like [`text`], for text that is allowed to span lines (stack traces, multi-line reasons): `\n` and `\t` stay.
pub fn multiline(s: &str) -> String {
    s.split('\n')
        .map(|line| line.split('\t').map(text).collect::<Vec<_>>().join("\t"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn needs_escape(c: char) -> bool {
    c == '\\' || is_unsafe(c)
}

/// Whether a terminal could act on `c` rather than show it, or show nothing for it: a control character (C0, DEL,
/// C1), a bidirectional mark or override, a line or paragraph separator, or a character drawn as nothing — Unicode's
/// format characters and default-ignorable ones (zero-width spaces and joiners, the soft hyphen, invisible operators,
/// fillers, variation selectors, tags) — so that `carrier\u{200b}` or `carrier\u{2063}` cannot pass for `carrier`
/// on the dashboard, and no text hides in tag characters.
pub fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00ad}'
                | '\u{034f}'
                | '\u{0600}'..='\u{0605}'
                | '\u{061c}'
                | '\u{06dd}'
                | '\u{070f}'
                | '\u{0890}'..='\u{0891}'
                | '\u{08e2}'
                | '\u{115f}'..='\u{1160}'
                | '\u{17b4}'..='\u{17b5}'
                | '\u{180b}'..='\u{180f}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{206f}'
                | '\u{3164}'
                | '\u{fe00}'..='\u{fe0f}'
                | '\u{feff}'
                | '\u{ffa0}'
                | '\u{fff0}'..='\u{fffb}'
                | '\u{110bd}'
                | '\u{110cd}'
                | '\u{13430}'..='\u{1343f}'
                | '\u{1bca0}'..='\u{1bca3}'
                | '\u{1d173}'..='\u{1d17a}'
                | '\u{e0000}'..='\u{e0fff}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_borrowed_unchanged() {
        assert!(matches!(text("parcel-created-carrier"), Cow::Borrowed(_)));
        assert_eq!(text("Zürich → Köln"), "Zürich → Köln");
    }

    #[test]
    fn escape_sequences_and_controls_are_shown_inert() {
        let evil = "carrier\u{1b}[31mRED\u{1b}]0;title\u{7}\r\n\u{9b}2J";
        let shown = text(evil);
        assert!(!shown.chars().any(|c| c.is_control()), "{shown:?}");
        assert_eq!(
            shown,
            "carrier\\u{1b}[31mRED\\u{1b}]0;title\\u{7}\\u{d}\\u{a}\\u{9b}2J"
        );
    }

    #[test]
    fn a_literal_backslash_cannot_forge_an_escape() {
        assert_eq!(text("a\\u{1b}b"), "a\\\\u{1b}b");
    }

    #[test]
    fn bidi_overrides_are_escaped() {
        assert_eq!(text("abc\u{202e}def"), "abc\\u{202e}def");
        assert_eq!(text("abc\u{61c}def"), "abc\\u{61c}def");
    }

    #[test]
    fn invisible_characters_and_separators_are_escaped() {
        for c in [
            '\u{200b}',
            '\u{200d}',
            '\u{2028}',
            '\u{2029}',
            '\u{2060}',
            '\u{feff}',
            '\u{ad}',
            '\u{2063}',
            '\u{206a}',
            '\u{3164}',
            '\u{fe0f}',
            '\u{fff9}',
            '\u{e0041}',
            '\u{e0100}',
            '\u{180e}',
        ] {
            let name = format!("carrier{c}");
            assert_eq!(text(&name), format!("carrier\\u{{{:x}}}", c as u32));
        }
    }

    #[test]
    fn multiline_keeps_newlines_and_tabs_only() {
        assert_eq!(multiline("a\n\tb\u{1b}c"), "a\n\tb\\u{1b}c");
    }
}
