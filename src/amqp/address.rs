//! MassTransit's RabbitMQ endpoint addresses, `rabbitmq://host[:port]/[vhost/]name[?options]`: written into
//! `MT-Fault-InputAddress` by the consumer and read back by `replay` to find where a message failed.
//!
//! How MassTransit writes one (its `RabbitMqEndpointAddress` made into a `Uri`, then `Uri.ToString()`):
//! - the vhost is left out when it is `/`; any other is escaped as a URI data string (`/` → `%2F`, `?` → `%3F`);
//! - the name is not escaped by MassTransit, whose names hold only letters, digits and `-_.:`; .NET's path escaping
//!   would still turn `?`, `#`, a `%` that starts no escape, spaces and non-ASCII into escapes, but leave `/` as it is;
//! - `ToString()` shows some escapes decoded again (spaces, non-ASCII), never `%2F`, `%3F`, `%23` or `%25`;
//! - endpoint options follow a `?` (`temporary=true`, `durable=false`, `autodelete=true`, `type=…`, `bind=true`, …).
//!
//! MassTransit reads the vhost as the text between the first and the last `/` of the path, and the name as the rest.
//! [`write`] writes the same shape and escapes every byte of a name or vhost that could change how it reads (`/`,
//! `?`, `#`, `%`, anything outside the URI's unreserved and sub-delimiter characters, a lone `.` or `..`), so that
//! [`parse`] gives back any queue name exactly. [`parse`] refuses what it could only guess at — an unescaped `/` in a
//! name (a path of three segments), a `#`, a `?` followed by anything but MassTransit's options, a `%` that starts
//! no escape — rather than take the text after the last `/` as a queue: an older writer, or a hand-made header,
//! puts a queue `eu/orders` or `orders?x` there unescaped, and the guess names another consumer's queue.

use std::fmt::Write as _;

/// The origin an address names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    /// The vhost, or `None` when the address names none (MassTransit's way of writing the vhost `/`).
    pub vhost: Option<String>,
    /// The queue (MassTransit's endpoint name: its exchange and its queue have the same name).
    pub queue: String,
}

/// Why an address cannot be read without guessing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unreadable(&'static str);

/// The options MassTransit writes after `?` in an endpoint address, or reads from a host address.
const OPTIONS: &[&str] = &[
    "temporary",
    "durable",
    "autodelete",
    "type",
    "bind",
    "queue",
    "delayedtype",
    "alternateexchange",
    "bindexchange",
    "singleactiveconsumer",
    "heartbeat",
    "prefetch",
    "ttl",
];

/// The longest queue name AMQP can carry.
pub(crate) const MAX_NAME: usize = 255;

/// Reads the vhost and queue of an address MassTransit (or inboxctl) wrote.
pub fn parse(address: &str) -> Result<Address, Unreadable> {
    let (scheme, rest) = address
        .split_once("://")
        .ok_or(Unreadable("not a rabbitmq:// address"))?;
    if !["rabbitmq", "rabbitmqs", "amqp", "amqps"]
        .iter()
        .any(|s| scheme.eq_ignore_ascii_case(s))
    {
        return Err(Unreadable("not a rabbitmq:// address"));
    }
    if rest.contains('#') {
        return Err(Unreadable(
            "it holds a # (MassTransit writes one in a name as %23): the queue name cannot be told",
        ));
    }
    let (rest, query) = match rest.split_once('?') {
        Some((rest, query)) => (rest, Some(query)),
        None => (rest, None),
    };
    let path = rest
        .find('/')
        .map(|start| &rest[start + 1..])
        .ok_or(Unreadable("it names no queue"))?;
    let segments: Vec<&str> = path.split('/').collect();
    let (vhost, name) = match segments.as_slice() {
        [name] => (None, *name),
        [vhost, name] => (Some(decode(vhost)?), *name),
        _ => {
            return Err(Unreadable(
                "its path has more than two segments (a / in a vhost or queue name written unescaped): the queue \
                 name cannot be told",
            ));
        }
    };
    if vhost.as_deref() == Some("") {
        return Err(Unreadable("it names an empty vhost"));
    }
    // A client names its vhost in a short string: no vhost is longer, and one that long would be kept whole in every
    // report item that names it.
    if vhost.as_ref().is_some_and(|v| v.len() > MAX_NAME) {
        return Err(Unreadable("its vhost is longer than 255 bytes"));
    }
    let queue = decode(name)?;
    if queue.is_empty() {
        return Err(Unreadable("it names no queue"));
    }
    if queue.len() > MAX_NAME {
        return Err(Unreadable("its queue name is longer than 255 bytes"));
    }
    if let Some(query) = query {
        check_options(query, &queue)?;
    }
    Ok(Address { vhost, queue })
}

/// Options are MassTransit's `key=value` pairs; anything else after a `?` is more likely the rest of a name with an
/// unescaped `?` in it.
fn check_options(query: &str, queue: &str) -> Result<(), Unreadable> {
    for option in query.split('&') {
        let (key, value) = option.split_once('=').ok_or(Unreadable(
            "what follows its ? is not MassTransit's options (a ? in a name written unescaped?): the queue name \
             cannot be told",
        ))?;
        if !OPTIONS.iter().any(|o| key.eq_ignore_ascii_case(o)) {
            return Err(Unreadable(
                "what follows its ? is not MassTransit's options (a ? in a name written unescaped?): the queue \
                 name cannot be told",
            ));
        }
        if key.eq_ignore_ascii_case("queue") && decode(value)? != queue {
            return Err(Unreadable(
                "it names an exchange bound to a queue of another name (queue=)",
            ));
        }
    }
    Ok(())
}

/// Decodes `%XX` escapes; raw characters (spaces and non-ASCII, which .NET's `ToString()` shows decoded) are taken as
/// they are.
fn decode(segment: &str) -> Result<String, Unreadable> {
    if segment == "." || segment == ".." {
        return Err(Unreadable(
            "it has a . or .. path segment, which URI readers remove",
        ));
    }
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or(Unreadable(
                        "it has a % that starts no escape (a % in a name written unescaped?)",
                    ))?;
                out.push(hex);
                i += 3;
            }
            b if b.is_ascii_control() => {
                return Err(Unreadable("it holds a raw control character"));
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| Unreadable("its escapes do not decode to UTF-8"))
}

/// The address of queue `name` in `vhost` on `host` (`port` only when it is not the scheme's default; `tls` for
/// `rabbitmqs://`), as MassTransit writes it, with every byte escaped that could change how it reads.
pub fn write(host: &str, port: Option<u16>, tls: bool, vhost: &str, name: &str) -> String {
    let mut out = String::from(if tls { "rabbitmqs://" } else { "rabbitmq://" });
    if host.contains(':') && !host.starts_with('[') {
        let _ = write!(out, "[{host}]");
    } else {
        out.push_str(host);
    }
    if let Some(port) = port {
        let _ = write!(out, ":{port}");
    }
    out.push('/');
    if !vhost.is_empty() && vhost != "/" {
        // Escaped as MassTransit escapes a vhost (`Uri.EscapeDataString`): only unreserved characters stay.
        encode(&mut out, vhost, |b| {
            b.is_ascii_alphanumeric() || b"-._~".contains(&b)
        });
        out.push('/');
    }
    encode(&mut out, name, |b| {
        b.is_ascii_alphanumeric() || b"-._~:@!$&'()*+,;=".contains(&b)
    });
    out
}

fn encode(out: &mut String, text: &str, keep: impl Fn(u8) -> bool) {
    // A lone `.` or `..` segment would be removed by URI normalisation: escaped, it stays a name.
    let dots = text == "." || text == "..";
    for &b in text.as_bytes() {
        if keep(b) && !(dots && b == b'.') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn read(address: &str) -> Result<(Option<String>, String), Unreadable> {
        parse(address).map(|a| (a.vhost, a.queue))
    }

    fn queue(q: &str) -> Result<(Option<String>, String), Unreadable> {
        Ok((None, q.to_owned()))
    }

    fn in_vhost(v: &str, q: &str) -> Result<(Option<String>, String), Unreadable> {
        Ok((Some(v.to_owned()), q.to_owned()))
    }

    #[test]
    fn what_masstransit_writes_reads_back() {
        // The captured fixtures and what MassTransit 8 writes for endpoints, options and vhosts.
        assert_eq!(
            read("rabbitmq://127.0.0.1/parcel-created-carrier"),
            queue("parcel-created-carrier")
        );
        assert_eq!(
            read("rabbitmq://127.0.0.1/parcel-created-carrier?bind=true"),
            queue("parcel-created-carrier")
        );
        assert_eq!(
            read("rabbitmq://127.0.0.1/vm_MtCapture_bus_dewyyyysdigyonq7bdxw68wtro?temporary=true"),
            queue("vm_MtCapture_bus_dewyyyysdigyonq7bdxw68wtro")
        );
        assert_eq!(
            read("rabbitmqs://broker:5673/shop/orders?durable=false&autodelete=true"),
            in_vhost("shop", "orders")
        );
        assert_eq!(
            read("rabbitmq://h/ParcelTracker.Domain.Events:ParcelCreatedEvent"),
            queue("ParcelTracker.Domain.Events:ParcelCreatedEvent")
        );
        assert_eq!(
            read("rabbitmq://h/probe%3Fq/orders"),
            in_vhost("probe?q", "orders")
        );
        assert_eq!(
            read("rabbitmq://h/a%2Fb%25c/orders"),
            in_vhost("a/b%c", "orders")
        );
        // .NET's ToString() shows spaces and non-ASCII decoded.
        assert_eq!(
            read("rabbitmq://h/my vhost/bestellungen-ü"),
            in_vhost("my vhost", "bestellungen-ü")
        );
    }

    #[test]
    fn the_captured_error_fixtures_name_parcel_created_carrier() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/interop/messages/error"
        );
        let mut read_back = 0;
        for entry in std::fs::read_dir(dir).expect("the fixtures") {
            let text = std::fs::read_to_string(entry.expect("a fixture").path()).expect("readable");
            let json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
            let address = json["headers"]["MT-Fault-InputAddress"]["text"]
                .as_str()
                .expect("an input address");
            assert_eq!(read(address), queue("parcel-created-carrier"), "{address}");
            read_back += 1;
        }
        assert_eq!(read_back, 3);
    }

    #[test]
    fn what_it_cannot_read_without_guessing_is_refused() {
        for address in [
            // A / in a name written unescaped: vhost "shop/eu" or queue "eu/orders"?
            "rabbitmq://h/shop/eu/parcel-created-carrier",
            // A ? or # in a name written unescaped.
            "rabbitmq://h/orders?x",
            "rabbitmq://h/orders?",
            "rabbitmq://h/orders?x=1",
            "rabbitmq://h/orders#eu",
            "rabbitmq://h/probe?q/orders",
            // A % that starts no escape, escapes that are not UTF-8, control characters.
            "rabbitmq://h/50%off",
            "rabbitmq://h/%+1",
            "rabbitmq://h/%FF",
            "rabbitmq://h/a\u{1b}b",
            // Nothing to read.
            "rabbitmq://h/",
            "rabbitmq://h",
            "rabbitmq://h//orders",
            "rabbitmq://h/./orders",
            "rabbitmq://h/..",
            "parcel-created-carrier",
            "queue:parcel-created-carrier",
            "http://h/orders",
            // An exchange bound to a queue of another name.
            "rabbitmq://h/orders?bind=true&queue=other",
        ] {
            assert!(
                parse(address).is_err(),
                "{address:?} read as {:?}",
                parse(address)
            );
        }
        assert_eq!(
            read("rabbitmq://h/orders?bind=true&queue=orders"),
            queue("orders")
        );
        // A vhost no client could name (longer than a short string): kept, it would be copied into every report item.
        let long = format!("rabbitmq://h/{}/orders", "v".repeat(256));
        assert!(parse(&long).is_err(), "{:?}", parse(&long));
        let longest = format!("rabbitmq://h/{}/orders", "v".repeat(255));
        assert!(parse(&longest).is_ok(), "{:?}", parse(&longest));
    }

    #[test]
    fn written_like_masstransit_for_its_own_names() {
        assert_eq!(
            write("127.0.0.1", None, false, "/", "parcel-created-carrier"),
            "rabbitmq://127.0.0.1/parcel-created-carrier"
        );
        assert_eq!(
            write("127.0.0.1", Some(5673), false, "shop", "q"),
            "rabbitmq://127.0.0.1:5673/shop/q"
        );
        assert_eq!(
            write(
                "h",
                None,
                false,
                "/",
                "ParcelTracker.Domain.Events:ParcelCreatedEvent"
            ),
            "rabbitmq://h/ParcelTracker.Domain.Events:ParcelCreatedEvent"
        );
        assert_eq!(
            write("h", None, true, "probe?q", "eu/orders?x#1%"),
            "rabbitmqs://h/probe%3Fq/eu%2Forders%3Fx%231%25"
        );
        assert_eq!(
            write("::1", Some(5673), false, "/", ".."),
            "rabbitmq://[::1]:5673/%2E%2E"
        );
    }

    /// A queue or vhost name: any text AMQP can carry, biased towards the characters that matter in a URI.
    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            "[/?#%.:@&=+ a-z0-9\u{e9}\u{1b}-]{1,40}",
            any::<String>(),
            Just(".".to_owned()),
            Just("..".to_owned()),
        ]
        .prop_map(|mut s| {
            while s.len() > MAX_NAME {
                s.pop();
            }
            s
        })
        .prop_filter("not empty", |s| !s.is_empty())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn every_name_reads_back_exactly(
            queue in name(),
            vhost in prop_oneof![Just("/".to_owned()), name()],
            host in "[a-z0-9.]{1,20}|::1",
            port in proptest::option::of(any::<u16>()),
            tls in any::<bool>(),
        ) {
            let address = write(&host, port, tls, &vhost, &queue);
            let read = parse(&address).map_err(|e| format!("{address}: {e}"));
            let expected = Address {
                vhost: (vhost != "/").then(|| vhost.clone()),
                queue: queue.clone(),
            };
            prop_assert_eq!(read, Ok(expected));
        }

        #[test]
        fn any_text_is_read_or_refused_without_panicking(text in any::<String>()) {
            let _ = parse(&text);
            let _ = parse(&format!("rabbitmq://h/{text}"));
        }
    }
}
