//! What the tests send and trust: captured MassTransit deliveries, fresh parcel events, and test-made certificates.

use base64::Engine as _;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use uuid::Uuid;

use super::EVENT_EXCHANGE;

/// One captured delivery from `tests/fixtures/interop/messages`.
pub struct Fixture {
    pub name: String,
    pub properties: BasicProperties,
    pub body: Vec<u8>,
    pub message_id: String,
    pub json: serde_json::Value,
}

pub fn fixture(path: &str) -> Fixture {
    let full = format!(
        "{}/tests/fixtures/interop/messages/{path}",
        env!("CARGO_MANIFEST_DIR")
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&full).unwrap()).unwrap();
    let body = base64::engine::general_purpose::STANDARD
        .decode(json["body_base64"].as_str().unwrap())
        .unwrap();
    let p = &json["properties"];
    // Only what the captures hold is rebuilt: a capture with another property set, or a header of another AMQP type,
    // fails here rather than being sent without it.
    for (name, value) in p.as_object().unwrap() {
        assert!(
            value.is_null()
                || ["content_type", "delivery_mode", "message_id"].contains(&name.as_str()),
            "{path}: property {name} is not rebuilt by this loader"
        );
    }
    let mut properties = BasicProperties::default()
        .with_content_type(p["content_type"].as_str().unwrap().into())
        .with_delivery_mode(u8::try_from(p["delivery_mode"].as_u64().unwrap()).unwrap())
        .with_message_id(p["message_id"].as_str().unwrap().into());
    let mut headers = FieldTable::default();
    for (key, value) in json["headers"].as_object().unwrap() {
        let v = match value["amqp_type"].as_str().unwrap() {
            "S (longstr)" => AMQPValue::LongString(LongString::from(
                value["text"].as_str().unwrap().as_bytes().to_vec(),
            )),
            "I (int32)" => {
                AMQPValue::LongInt(i32::try_from(value["value"].as_i64().unwrap()).unwrap())
            }
            "l (int64)" => AMQPValue::LongLongInt(value["value"].as_i64().unwrap()),
            other => {
                panic!("{path}: header {key} of AMQP type {other} is not rebuilt by this loader")
            }
        };
        headers.insert(key.as_str().into(), v);
    }
    properties = properties.with_headers(headers);
    Fixture {
        name: path.to_owned(),
        message_id: p["message_id"].as_str().unwrap().to_owned(),
        properties,
        body,
        json,
    }
}

/// The fixtures of one folder, by name.
pub fn fixtures(folder: &str) -> Vec<Fixture> {
    let dir = format!(
        "{}/tests/fixtures/interop/messages/{folder}",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .iter()
        .map(|n| fixture(&format!("{folder}/{n}")))
        .collect()
}

/// A MassTransit `ParcelCreatedEvent` for a new parcel: (properties, body, parcel id).
pub fn parcel_message(message_id: Uuid, destination: &str) -> (BasicProperties, Vec<u8>, Uuid) {
    let broker = inboxctl::amqp::Broker::from_url("amqp://127.0.0.1:5672/%2f").unwrap();
    let message = inboxctl::producer::Message {
        message_id,
        event: inboxctl::parcel::ParcelCreatedEvent {
            parcel_id: Uuid::new_v4(),
            tracking_number: "PT00000001NL".to_owned(),
            destination: destination.to_owned(),
        },
    };
    let host = inboxctl::amqp::envelope::HostInfo::current();
    let (props, body) = inboxctl::producer::envelope(&message, &broker, EVENT_EXCHANGE, &host);
    (props, body, message.event.parcel_id)
}

/// Makes a certificate authority and a server certificate for 127.0.0.1 / localhost signed by it, and a second,
/// unrelated authority, in `dir`, with openssl.
pub fn certificates(dir: &std::path::Path) {
    let sh = |script: &str| {
        let out = std::process::Command::new("sh")
            .args(["-ec", script])
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj '/CN=inboxctl test CA' 2>/dev/null
        openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.pem -days 2 -subj '/CN=another CA' 2>/dev/null
        openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj '/CN=localhost' 2>/dev/null
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nbasicConstraints=CA:FALSE\\nkeyUsage=digitalSignature,keyEncipherment\\nextendedKeyUsage=serverAuth\\n' > ext.cnf
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile ext.cnf 2>/dev/null");
}

/// A library run's options for `queue` on the test's queue type: a partition-less endpoint, 8 unacked, 2 at a time,
/// 3 attempts 100 ms apart, ending idle after 2 s, one message a batch. A test changes what it is about.
pub fn library_options(queue: &str) -> inboxctl::consumer::ConsumerOptions {
    use std::time::Duration;
    inboxctl::consumer::ConsumerOptions {
        queue: queue.to_owned(),
        queue_type: super::queue_type(),
        event_exchange: EVENT_EXCHANGE.to_owned(),
        prefetch: 8,
        concurrency: 2,
        max_attempts: 3,
        retry_delay: Duration::from_millis(100),
        exit_when_idle: Some(Duration::from_secs(2)),
        shutdown_timeout: Duration::from_secs(10),
        broker_timeout: Duration::from_secs(10),
        attempt_timeout: Duration::from_secs(30),
        counts: std::sync::Arc::default(),
        batch_size: 1,
        batch_wait: Duration::from_millis(50),
        poison_after: 5,
        on_conflict: Default::default(),
        timings: None,
        partitions: None,
        owed_effects: None,
    }
}
