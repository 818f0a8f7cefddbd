//! JSON field names read as MassTransit's reader reads them: whatever their case. Its System.Text.Json options match
//! property names case-insensitively, for the envelope and the message alike, so a fleet whose naming policy writes
//! `MessageId` and `ParcelId` (PascalCase, .NET's own) is read by every MassTransit consumer; inboxctl reads it too.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, Visitor};

/// Reads a map key as the index of the field it names among `names` (compared without regard to ASCII case), or
/// `None` for a field not read. No allocation: the key is compared where it lies.
pub(crate) struct FieldOf(pub &'static [&'static str]);

impl<'de> DeserializeSeed<'de> for FieldOf {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        struct Names(&'static [&'static str]);
        impl Visitor<'_> for Names {
            type Value = Option<usize>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }

            fn visit_str<E: de::Error>(self, key: &str) -> Result<Option<usize>, E> {
                Ok(self
                    .0
                    .iter()
                    .position(|name| name.eq_ignore_ascii_case(key)))
            }
        }
        deserializer.deserialize_identifier(Names(self.0))
    }
}

/// Reads every field of `map`: `read` is given the index among `names` of each one named there (in any case) and
/// reads its value; the others are read past. A field given twice (in whatever case) is refused: which of two values
/// would count is not something to guess — a message id above all. At most 64 names.
pub(crate) fn each<'de, A: de::MapAccess<'de>>(
    map: &mut A,
    names: &'static [&'static str],
    mut read: impl FnMut(usize, &mut A) -> Result<(), A::Error>,
) -> Result<(), A::Error> {
    debug_assert!(names.len() <= 64);
    let mut seen = 0u64;
    while let Some(field) = map.next_key_seed(FieldOf(names))? {
        let Some(index) = field else {
            map.next_value::<de::IgnoredAny>()?;
            continue;
        };
        if seen & (1 << index) != 0 {
            return Err(de::Error::duplicate_field(names[index]));
        }
        seen |= 1 << index;
        read(index, map)?;
    }
    Ok(())
}

/// A string borrowed from the text when it holds no escape, else copied.
pub(crate) struct CowStr<'a>(pub Cow<'a, str>);

impl<'de> de::Deserialize<'de> for CowStr<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> Visitor<'de> for Text {
            type Value = CowStr<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Borrowed(v)))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(Text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: &[&str] = &["messageId", "message"];

    fn field(json: &str) -> Option<usize> {
        let mut de = serde_json::Deserializer::from_str(json);
        FieldOf(NAMES).deserialize(&mut de).unwrap()
    }

    #[test]
    fn a_field_is_found_whatever_its_case_and_only_by_its_whole_name() {
        assert_eq!(field(r#""messageId""#), Some(0));
        assert_eq!(field(r#""MessageId""#), Some(0));
        assert_eq!(field(r#""MESSAGEID""#), Some(0));
        assert_eq!(field(r#""Message""#), Some(1));
        assert_eq!(field(r#""message_id""#), None);
        assert_eq!(field(r#""messageIdX""#), None);
        // An escaped key is compared as the text it stands for.
        assert_eq!(field(r#""Message\u0049d""#), Some(0));
    }
}
