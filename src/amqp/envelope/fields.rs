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

/// Notes that the field `names[index]` was read, refusing one read before (in whatever case): which of two values
/// would count is not something to guess — a message id above all.
pub(crate) fn first_time<E: de::Error>(
    seen: &mut [bool],
    names: &'static [&'static str],
    index: usize,
) -> Result<(), E> {
    if std::mem::replace(&mut seen[index], true) {
        return Err(E::duplicate_field(names[index]));
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
