//! What inboxctl reads of a MassTransit envelope: its id, types, message and sent time, named whatever their case
//! ([`super::fields`]), the rest read past unkept.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::fields;

/// The envelope fields inboxctl reads, named whatever their case ([`fields`]). Unknown fields are ignored; a field
/// given twice (in any case) is an error.
pub(super) struct EnvelopeIn<'a> {
    pub(super) message_id: Option<std::borrow::Cow<'a, str>>,
    pub(super) message_type: Option<MessageTypes>,
    pub(super) message: Option<&'a RawValue>,
    pub(super) sent_time: Option<std::borrow::Cow<'a, str>>,
}

/// [`EnvelopeIn`]'s fields, as MassTransit writes them.
const ENVELOPE_FIELDS: &[&str] = &["messageId", "messageType", "message", "sentTime"];

impl<'de> Deserialize<'de> for EnvelopeIn<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Envelope;
        impl<'de> serde::de::Visitor<'de> for Envelope {
            type Value = EnvelopeIn<'de>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a MassTransit envelope")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<EnvelopeIn<'de>, A::Error> {
                let mut envelope = EnvelopeIn {
                    message_id: None,
                    message_type: None,
                    message: None,
                    sent_time: None,
                };
                fields::each(&mut map, ENVELOPE_FIELDS, |index, map| {
                    match index {
                        0 => {
                            envelope.message_id = map
                                .next_value::<Option<fields::CowStr<'de>>>()?
                                .map(|t| t.0);
                        }
                        1 => envelope.message_type = map.next_value()?,
                        2 => envelope.message = map.next_value()?,
                        _ => {
                            envelope.sent_time = map
                                .next_value::<Option<fields::CowStr<'de>>>()?
                                .map(|t| t.0);
                        }
                    }
                    Ok(())
                })?;
                Ok(envelope)
            }
        }
        deserializer.deserialize_map(Envelope)
    }
}

/// How many of an envelope's `messageType`s are kept. MassTransit lists the message's type and those it implements,
/// a handful; a body may list millions (each `"",` three bytes of JSON, a `String` of 24 bytes and more once kept):
/// read whole, one such message of RabbitMQ's largest size took gigabytes, several at once the process.
pub const MAX_MESSAGE_TYPES: usize = 64;

/// An envelope's `messageType`: its first [`MAX_MESSAGE_TYPES`] kept, the rest read past.
pub(super) struct MessageTypes(pub(super) Vec<String>);

impl<'de> Deserialize<'de> for MessageTypes {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Types;
        impl<'de> serde::de::Visitor<'de> for Types {
            type Value = MessageTypes;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of message types")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<MessageTypes, A::Error> {
                let mut kept = Vec::new();
                while kept.len() < MAX_MESSAGE_TYPES {
                    match seq.next_element::<String>()? {
                        Some(t) => kept.push(t),
                        None => return Ok(MessageTypes(kept)),
                    }
                }
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(MessageTypes(kept))
            }
        }
        deserializer.deserialize_seq(Types)
    }
}
