//! A minimal AMQP 0-9-1 publisher written frame by frame, for messages lapin cannot send: a client library writes a
//! header table by recursion, so a table nested a thousand levels deep overflows its writer's stack before the broker
//! ever sees it. Here the content header's bytes are the caller's, written as they are.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// `{"<key>": {"<key>": … {}}}` as the bytes of a header value of type `F`, `depth` tables deep, built without
/// recursion.
pub fn nested_table_value(key: &str, depth: usize) -> Vec<u8> {
    let mut inner: Vec<u8> = 0u32.to_be_bytes().to_vec();
    for _ in 0..depth {
        let mut entry = vec![u8::try_from(key.len()).unwrap()];
        entry.extend_from_slice(key.as_bytes());
        entry.push(b'F');
        entry.extend_from_slice(&inner);
        let mut table = u32::try_from(entry.len()).unwrap().to_be_bytes().to_vec();
        table.extend_from_slice(&entry);
        inner = table;
    }
    let mut value = vec![b'F'];
    value.extend_from_slice(&inner);
    value
}

/// The bytes of a header table from `(key, value bytes with their type tag)` pairs; a key is any bytes.
pub fn table<K: AsRef<[u8]>>(entries: &[(K, Vec<u8>)]) -> Vec<u8> {
    let mut body = Vec::new();
    for (key, value) in entries {
        let key = key.as_ref();
        body.push(u8::try_from(key.len()).unwrap());
        body.extend_from_slice(key);
        body.extend_from_slice(value);
    }
    let mut out = u32::try_from(body.len()).unwrap().to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

/// A long-string header value.
pub fn long_string(text: &str) -> Vec<u8> {
    let mut out = vec![b'S'];
    out.extend_from_slice(&u32::try_from(text.len()).unwrap().to_be_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

/// Publishes one persistent message with `message_id` (any bytes), content type `content_type` and the header table `headers`
/// (bytes as [`table`] makes them) to `exchange` with `routing_key`, on `host:port` in `vhost` as guest, and waits for
/// the broker's confirm.
#[allow(clippy::too_many_arguments)]
pub fn publish(
    addr: &str,
    vhost: &str,
    exchange: &str,
    routing_key: &str,
    message_id: impl AsRef<[u8]>,
    content_type: &str,
    headers: &[u8],
    body: &[u8],
) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"AMQP\x00\x00\x09\x01").unwrap();
    expect_method(&mut s, 10, 10); // connection.start
    let mut ok = method(10, 11);
    ok.extend_from_slice(&0u32.to_be_bytes()); // client properties
    short(&mut ok, "PLAIN");
    long(&mut ok, b"\0guest\0guest");
    short(&mut ok, "en_US");
    frame(&mut s, 1, 0, &ok);
    let tune = expect_method(&mut s, 10, 30);
    let mut tune_ok = method(10, 31);
    tune_ok.extend_from_slice(&tune[0..6]); // channel max, frame max as the broker proposed
    tune_ok.extend_from_slice(&0u16.to_be_bytes()); // no heartbeat
    frame(&mut s, 1, 0, &tune_ok);
    let mut open = method(10, 40);
    short(&mut open, vhost);
    short(&mut open, "");
    open.push(0);
    frame(&mut s, 1, 0, &open);
    expect_method(&mut s, 10, 41);
    let mut channel_open = method(20, 10);
    short(&mut channel_open, "");
    frame(&mut s, 1, 1, &channel_open);
    expect_method(&mut s, 20, 11);
    let mut select = method(85, 10);
    select.push(0);
    frame(&mut s, 1, 1, &select);
    expect_method(&mut s, 85, 11);

    let mut publish = method(60, 40);
    publish.extend_from_slice(&0u16.to_be_bytes());
    short(&mut publish, exchange);
    short(&mut publish, routing_key);
    publish.push(0);
    frame(&mut s, 1, 1, &publish);
    let mut header = Vec::new();
    header.extend_from_slice(&60u16.to_be_bytes());
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&(body.len() as u64).to_be_bytes());
    // content type, headers, delivery mode, message id
    let flags: u16 = (1 << 15) | (1 << 13) | (1 << 12) | (1 << 7);
    header.extend_from_slice(&flags.to_be_bytes());
    short(&mut header, content_type);
    header.extend_from_slice(headers);
    header.push(2);
    short_bytes(&mut header, message_id.as_ref());
    frame(&mut s, 2, 1, &header);
    frame(&mut s, 3, 1, body);
    expect_method(&mut s, 60, 80); // basic.ack: confirmed
    frame(&mut s, 1, 0, &{
        let mut close = method(10, 50);
        close.extend_from_slice(&200u16.to_be_bytes());
        short(&mut close, "OK");
        close.extend_from_slice(&[0, 0, 0, 0]);
        close
    });
    let _ = expect_method(&mut s, 10, 51);
}

fn method(class: u16, method: u16) -> Vec<u8> {
    let mut out = class.to_be_bytes().to_vec();
    out.extend_from_slice(&method.to_be_bytes());
    out
}

fn short(out: &mut Vec<u8>, text: &str) {
    short_bytes(out, text.as_bytes());
}

/// A short string of any bytes (a message id that is not UTF-8, which the broker passes on as it is).
fn short_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(u8::try_from(bytes.len()).unwrap());
    out.extend_from_slice(bytes);
}

fn long(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap().to_be_bytes());
    out.extend_from_slice(bytes);
}

fn frame(s: &mut TcpStream, kind: u8, channel: u16, payload: &[u8]) {
    let mut out = vec![kind];
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
    out.extend_from_slice(payload);
    out.push(0xCE);
    s.write_all(&out).unwrap();
}

/// Reads frames until a method frame; panics unless it is `class.method`. Returns its arguments.
fn expect_method(s: &mut TcpStream, class: u16, method: u16) -> Vec<u8> {
    loop {
        let mut head = [0u8; 7];
        s.read_exact(&mut head).unwrap();
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let mut payload = vec![0u8; size + 1];
        s.read_exact(&mut payload).unwrap();
        if head[0] != 1 {
            continue;
        }
        let got = (
            u16::from_be_bytes([payload[0], payload[1]]),
            u16::from_be_bytes([payload[2], payload[3]]),
        );
        assert_eq!(
            got,
            (class, method),
            "the broker answered {got:?}: {}",
            String::from_utf8_lossy(&payload)
        );
        return payload[4..size].to_vec();
    }
}
