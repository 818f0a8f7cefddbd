//! Fingerprints of what a dead-lettered message carries, for `replay` to recognise copies of one message: keyed at
//! random for each run, 128 bits from two keyed hashes, so that neither chance nor a crafted message makes two
//! different copies look identical.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher as _, Hasher};

use lapin::message::Delivery;
use lapin::types::{AMQPValue, ShortString};

/// Fingerprints of what copies carry, keyed at random for each run: 128 bits from two keyed hashes, so that neither
/// chance nor a crafted message makes two different copies look identical.
#[derive(Default)]
pub struct Fingerprints {
    keys: [RandomState; 2],
}

/// Both keyed hashes at once.
struct Pair([std::collections::hash_map::DefaultHasher; 2]);

impl Hasher for Pair {
    fn write(&mut self, bytes: &[u8]) {
        self.0[0].write(bytes);
        self.0[1].write(bytes);
    }

    fn finish(&self) -> u64 {
        self.0[0].finish()
    }
}

impl Pair {
    fn finish128(&self) -> u128 {
        (u128::from(self.0[0].finish()) << 64) | u128::from(self.0[1].finish())
    }

    fn bytes(&mut self, bytes: &[u8]) {
        self.write_usize(bytes.len());
        self.write(bytes);
    }

    fn text(&mut self, text: Option<&ShortString>) {
        match text {
            None => self.write_u8(0),
            Some(s) => {
                self.write_u8(1);
                self.bytes(s.as_str().as_bytes());
            }
        }
    }
}

impl Fingerprints {
    pub fn new() -> Self {
        Self {
            keys: [RandomState::new(), RandomState::new()],
        }
    }

    fn hasher(&self) -> Pair {
        Pair([self.keys[0].build_hasher(), self.keys[1].build_hasher()])
    }

    pub fn body(&self, body: &[u8]) -> u128 {
        let mut h = self.hasher();
        h.bytes(body);
        h.finish128()
    }

    /// Body, every property and every header but the broker's own delivery counts (which change as a copy is
    /// delivered again, while the copy stays the same). Where a copy goes follows from these.
    pub fn content(&self, delivery: &Delivery) -> u128 {
        let p = &delivery.properties;
        let mut h = self.hasher();
        h.bytes(&delivery.data);
        for text in [
            p.content_type(),
            p.content_encoding(),
            p.correlation_id(),
            p.reply_to(),
            p.expiration(),
            p.message_id(),
            p.kind(),
            p.user_id(),
            p.app_id(),
            p.cluster_id(),
        ] {
            h.text(text.as_ref());
        }
        for number in [p.delivery_mode(), p.priority()] {
            h.write_u16(number.map_or(u16::MAX, u16::from));
        }
        h.write_u8(u8::from(p.timestamp().is_some()));
        h.write_u64(p.timestamp().unwrap_or(0));
        let headers: Vec<_> = p
            .headers()
            .iter()
            .flat_map(|t| t.inner())
            .filter(|(key, _)| !super::topology::is_per_delivery_header(key.as_str()))
            .collect();
        h.write_usize(headers.len());
        for (key, value) in headers {
            h.bytes(key.as_str().as_bytes());
            hash_value(&mut h, value);
        }
        h.finish128()
    }
}

/// Hashes a header value, nested tables and arrays included, without recursion: a header nested as deep as a frame
/// allows must not exhaust the stack.
fn hash_value(h: &mut Pair, root: &AMQPValue) {
    enum Next<'v> {
        Value(&'v AMQPValue),
        Key(&'v str),
    }
    let mut stack = vec![Next::Value(root)];
    while let Some(next) = stack.pop() {
        let value = match next {
            Next::Key(key) => {
                h.bytes(key.as_bytes());
                continue;
            }
            Next::Value(value) => value,
        };
        // A tag for the type, then a fixed-width number or a length-prefixed run of bytes: no two values alike.
        let (tag, number) = match value {
            AMQPValue::Boolean(v) => (1, u64::from(*v)),
            AMQPValue::ShortShortInt(v) => (2, i64::from(*v).cast_unsigned()),
            AMQPValue::ShortShortUInt(v) => (3, u64::from(*v)),
            AMQPValue::ShortInt(v) => (4, i64::from(*v).cast_unsigned()),
            AMQPValue::ShortUInt(v) => (5, u64::from(*v)),
            AMQPValue::LongInt(v) => (6, i64::from(*v).cast_unsigned()),
            AMQPValue::LongUInt(v) => (7, u64::from(*v)),
            AMQPValue::LongLongInt(v) => (8, v.cast_unsigned()),
            AMQPValue::Float(v) => (9, u64::from(v.to_bits())),
            AMQPValue::Double(v) => (10, v.to_bits()),
            AMQPValue::DecimalValue(v) => (11, (u64::from(v.scale) << 32) | u64::from(v.value)),
            AMQPValue::Timestamp(v) => (12, *v),
            AMQPValue::Void => (13, 0),
            AMQPValue::ShortString(v) => {
                h.write_u8(14);
                h.bytes(v.as_str().as_bytes());
                continue;
            }
            AMQPValue::LongString(v) => {
                h.write_u8(15);
                h.bytes(v.as_bytes());
                continue;
            }
            AMQPValue::ByteArray(v) => {
                h.write_u8(16);
                h.bytes(v.as_slice());
                continue;
            }
            AMQPValue::FieldArray(v) => {
                h.write_u8(17);
                h.write_usize(v.as_slice().len());
                stack.extend(v.as_slice().iter().rev().map(Next::Value));
                continue;
            }
            AMQPValue::FieldTable(v) => {
                h.write_u8(18);
                h.write_usize(v.inner().len());
                for (key, value) in v.inner().iter().rev() {
                    stack.push(Next::Value(value));
                    stack.push(Next::Key(key.as_str()));
                }
                continue;
            }
        };
        h.write_u8(tag);
        h.write_u64(number);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::BasicProperties;
    use lapin::types::{FieldTable, LongString};

    fn delivered(headers: &[(&str, AMQPValue)]) -> Delivery {
        let mut table = FieldTable::default();
        for (key, value) in headers {
            table.insert((*key).into(), value.clone());
        }
        let mut delivery = Delivery::mock(1, "".into(), "q".into(), false, b"{}".to_vec());
        delivery.properties = BasicProperties::default()
            .with_message_id("m".into())
            .with_headers(table);
        delivery
    }

    /// A quorum queue counts every time it hands a message out (`x-acquired-count`, RabbitMQ 4.3) and every failed
    /// delivery: a copy given back when a replay's connection was lost comes again with higher counts, and must still
    /// be known for the copy it is (else it is decided twice, and the replay ends its snapshot early).
    #[test]
    fn a_copy_delivered_again_by_a_quorum_queue_is_the_same_copy() {
        let prints = Fingerprints::new();
        let tenant = ("tenant", AMQPValue::LongString(LongString::from("acme")));
        let first = delivered(std::slice::from_ref(&tenant));
        let again = delivered(&[
            tenant.clone(),
            ("x-delivery-count", AMQPValue::LongLongInt(1)),
            ("x-acquired-count", AMQPValue::LongLongInt(2)),
        ]);
        assert_eq!(prints.content(&first), prints.content(&again));
        let other = delivered(&[("tenant", AMQPValue::LongString(LongString::from("other")))]);
        assert_ne!(prints.content(&first), prints.content(&other));
    }
}
