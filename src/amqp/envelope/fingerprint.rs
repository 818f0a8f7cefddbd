//! The fingerprint of an event: what tells a copy of a message from another message that reuses its id. Its
//! canonical JSON, hashed, and the one case where that form would lose the difference — a number the parse rounds.

use serde_json::value::RawValue;
use sha2::Digest as _;

use super::super::limits::MAX_CANONICAL_EVENT;
use crate::inbox::Fingerprint;

/// The fingerprint of an event, to tell a copy of a message from another message reusing its id: SHA-256 (first 16
/// bytes) of its canonical form — parsed, object keys sorted, no whitespace — so that a legitimate re-send that
/// differs in key order, whitespace or the envelope around it (`sentTime`, headers) has the same fingerprint. An
/// event larger than [`MAX_CANONICAL_EVENT`], deeper than the JSON parser's bound, or holding a number the parse
/// would round (more digits than a double holds exactly: a .NET `decimal`, an amount past 2^64), is fingerprinted
/// over its bytes as they are: two events that differ only in such a number's last digits are two events, not a
/// copy and its original.
pub fn fingerprint(event: &RawValue) -> Fingerprint {
    let text = event.get();
    let canonical = (text.len() <= MAX_CANONICAL_EVENT && !has_rounded_number(text))
        .then(|| serde_json::from_str::<serde_json::Value>(text).ok())
        .flatten()
        .map(|value| {
            let mut out = Vec::with_capacity(text.len());
            write_canonical(&value, &mut out);
            out
        });
    let digest = sha2::Sha256::digest(canonical.as_deref().unwrap_or(text.as_bytes()));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Fingerprint::from_bytes(bytes)
}

/// Whether `json` holds a number that parsing would not keep exactly: an integer beyond 64 bits, or a decimal with
/// more significant digits than a double holds (15) or an exponent near its limits. Strings are skipped.
fn has_rounded_number(json: &str) -> bool {
    let bytes = json.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < bytes.len()
                    && matches!(bytes[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                if rounded(&json[start..i]) {
                    return true;
                }
            }
            _ => i += 1,
        }
    }
    false
}

/// Whether one JSON number's text would be rounded by parsing it (see [`has_rounded_number`]): the value serde_json
/// writes back after parsing it — what the canonical form holds — is not the value written. A double written
/// shortest-round-trip (`0.30000000000000004`, as JavaScript, .NET and Python write them) comes back as it was.
fn rounded(number: &str) -> bool {
    // An integer of up to 15 digits, and a decimal of up to 15 digits without an exponent, come back from a double as
    // written: the numbers events usually hold, answered without a parse, on every message's path.
    if !number.contains(['e', 'E']) && number.bytes().filter(u8::is_ascii_digit).count() <= 15 {
        return false;
    }
    let Ok(parsed) = serde_json::from_str::<serde_json::Number>(number) else {
        return true;
    };
    match (decimal(number), decimal(&parsed.to_string())) {
        (Some(a), Some(b)) => a != b,
        _ => true,
    }
}

/// A JSON number's value as (negative, significant digits, exponent of the first digit); zero as `(false, "", 0)`.
fn decimal(number: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits: String = int.chars().chain(frac.chars()).collect();
    let leading = digits.len() - digits.trim_start_matches('0').len();
    let significant = digits.trim_matches('0');
    if significant.is_empty() {
        return Some((false, String::new(), 0));
    }
    let point = i64::try_from(int.len()).ok()? - i64::try_from(leading).ok()?;
    Some((
        negative,
        significant.to_owned(),
        exponent.checked_add(point)?,
    ))
}

/// `value` as compact JSON with every object's keys sorted, whatever order the map type keeps them in. Its depth is
/// bounded by the JSON parser's (128 levels).
fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_scalar(&serde_json::Value::String(key.clone()), out);
                out.push(b':');
                write_canonical(value, out);
            }
            out.push(b'}');
        }
        serde_json::Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => write_scalar(scalar, out),
    }
}

fn write_scalar(value: &serde_json::Value, out: &mut Vec<u8>) {
    // Writing a string, number, bool or null into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_owned()).expect("json")
    }

    #[test]
    fn a_fingerprint_ignores_key_order_and_whitespace_not_content() {
        let a = fingerprint(&event(
            r#"{"parcelId": "p1", "destination": "Berlin", "n": [1, {"b": 2, "a": 1}]}"#,
        ));
        let reordered = fingerprint(&event(
            "{\n  \"n\" : [ 1 , { \"a\":1,\"b\":2 } ],\"destination\":\"Berlin\",\"parcelId\":\"p1\"}",
        ));
        assert_eq!(a, reordered);
        let other = fingerprint(&event(
            r#"{"parcelId": "p1", "destination": "Paris", "n": [1, {"b": 2, "a": 1}]}"#,
        ));
        assert_ne!(a, other);
        let swapped_array = fingerprint(&event(
            r#"{"parcelId": "p1", "destination": "Berlin", "n": [{"b": 2, "a": 1}, 1]}"#,
        ));
        assert_ne!(a, swapped_array, "array order is content");
    }

    #[test]
    fn a_fingerprint_tells_numbers_apart_past_a_doubles_precision() {
        let with = |amount: &str| fingerprint(&event(&format!(r#"{{"a": "x", "v": {amount}}}"#)));
        // A .NET decimal's 20 digits, and integers past 64 bits: once rounded to one double, now told apart.
        assert_ne!(with("1234567890.1234567891"), with("1234567890.1234567899"));
        assert_ne!(with("18446744073709551616"), with("18446744073709551617"));
        assert_ne!(with("1e-400"), with("2e-400"));
        // Numbers a double holds keep the canonical form of before: the same fingerprints as stored ones.
        let spaced =
            |amount: &str| fingerprint(&event(&format!(r#"{{ "v" : {amount}, "a":"x" }}"#)));
        for n in [
            "1",
            "-7",
            "1.5",
            "1.50",
            "123456789012345",
            "0.000001",
            "18446744073709551615",
            "-9223372036854775808",
        ] {
            assert_eq!(with(n), spaced(n), "{n}");
        }
        assert_eq!(with("1.5"), with("1.50"), "the same value");
        // Digits inside a string are not a number.
        assert!(!has_rounded_number(
            r#"{"id": "123456789012345678901234567890"}"#
        ));
        assert!(!has_rounded_number(
            r#"{"id": "a\"123456789012345678901234567890"}"#
        ));
        assert!(has_rounded_number(
            r#"{"id": "a\"", "n": 123456789012345678901234567890}"#
        ));
    }

    /// The fingerprint as stored before this change: always the canonical form (size permitting).
    fn old(text: &str) -> Fingerprint {
        let value: serde_json::Value = serde_json::from_str(text).unwrap();
        let mut out = Vec::new();
        write_canonical(&value, &mut out);
        let digest = sha2::Sha256::digest(&out);
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        Fingerprint::from_bytes(bytes)
    }

    #[test]
    fn ordinary_numbers_keep_their_stored_fingerprint() {
        let mut changed = Vec::new();
        for n in [
            "0",
            "-0",
            "1e5",
            "1E+2",
            "0.1",
            "123.456e-7",
            "-0.0",
            "1.5e10",
            // doubles written shortest-round-trip (JS, .NET Core, Python): the double holds them exactly
            "0.30000000000000004",
            "52.52000659999999",
            "33.333333333333336",
            "1.0e308",
            "1e300",
            "-2.5e-300",
            "1e0",
            "1234567890123456.0",
            "100000000000000000000",
            "0.1234567890123456",
            "1.2345678901234567",
            "3.141592653589793",
            "-0.0",
            "0e999",
        ] {
            let text = format!(r#"{{ "v": {n}, "a": "x" }}"#);
            let value: serde_json::Value = serde_json::from_str(&text).unwrap();
            let back = value["v"].to_string();
            let new = fingerprint(&RawValue::from_string(text.clone()).unwrap());
            if new != old(&text) {
                changed.push(format!("{n} (serde writes it back as {back})"));
            }
        }
        assert!(
            changed.is_empty(),
            "stored fingerprints changed for: {changed:#?}"
        );
        // What serde_json's parse does lose stays apart.
        for n in [
            "19.990000000000002",
            "9007199254740993.5",
            "1234567890.1234567891",
            "18446744073709551617",
            "1e-400",
            "1e400",
        ] {
            assert!(has_rounded_number(&format!("[{n}]")), "{n}");
        }
    }

    #[test]
    fn the_number_scan_never_panics() {
        for s in [
            "",
            "-",
            "--",
            "1e",
            "1e+",
            "é1",
            "\"",
            "\"\\",
            "\"\\é\"1",
            "é\"\\\"",
            "1.2.3e-e",
            "\"é",
            "-é",
            "9e99999999999999999",
            "\u{10FFFF}-1",
            "\"\\\u{10FFFF}\"12345678901234567890",
        ] {
            let _ = has_rounded_number(s);
        }
        let long = format!("{}e{}", "9".repeat(100_000), "9".repeat(100));
        assert!(has_rounded_number(&long));
    }
}
