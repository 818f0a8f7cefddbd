//! RabbitMQ: connecting, the MassTransit topology, envelopes and dead-letter headers.

pub mod address;
pub mod cause;
pub mod copy;
pub mod dead_letter;
pub mod envelope;
mod error;
pub mod failure;
pub mod fingerprint;
pub mod limits;
mod markers;
pub mod nodes;
pub mod pass;
pub mod peek;
pub mod publish;
mod reconnect;
pub mod tail;
pub mod topology;

pub use error::BrokerError;
pub use lapin::message::Delivery;
pub use lapin::{BasicProperties, Connection};
pub use reconnect::{
    BLOCKED_HINT, GaveUp, Link, MAX_FRUITLESS_RECONNECTS, close, is_blocked, is_connection_lost,
};

use std::str::FromStr;
use std::time::Duration;

use lapin::ConnectionProperties;
use lapin::uri::AMQPUri;

use crate::error::{Error, Result};
use crate::{redact, secret};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The heartbeat asked for unless the URL says otherwise, in seconds: a dead connection is noticed within two.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// How long a call to RabbitMQ may take before its connection is given up (`--broker-timeout`).
pub const DEFAULT_BROKER_TIMEOUT: Duration = Duration::from_secs(30);

/// Waits for RabbitMQ's answer to `call` (`what`: "a copy's confirm", say) at most `within`. Heartbeats find a
/// connection that went silent, but not one that stays alive and never answers: a node in a memory or disk alarm
/// holds every publish, and its confirm, for as long as the alarm lasts. Past `within` the answer is
/// [`Error::BrokerSilent`], which counts as the connection lost ([`is_connection_lost`]).
pub async fn answered<F: std::future::Future>(
    what: &'static str,
    within: Duration,
    call: F,
) -> Result<F::Output> {
    let call = async {
        crate::failpoint::hit_with("broker-answer", what).await;
        call.await
    };
    tokio::time::timeout(within, call)
        .await
        .map_err(|_| Error::BrokerSilent { what, within })
}

/// Where the broker is, and how to trust it and log in: what `--amqp-url`, `--amqp-ca-file` and
/// `--amqp-password-file` give.
#[derive(Clone, Debug, Default)]
pub struct BrokerOptions {
    pub url: String,
    /// A CA certificate (PEM) an amqps:// broker's certificate must chain to.
    pub ca_file: Option<std::path::PathBuf>,
    /// A file holding the password (one line), when the URL has none.
    pub password_file: Option<std::path::PathBuf>,
}

/// A CA file longer than this is no CA file (a bundle of every public authority is about 200 KB).
const MAX_CA_FILE: u64 = 4 * 1024 * 1024;

/// Connection settings parsed from an `amqp://` or `amqps://` URL: one node, or several (see [`nodes`]).
#[derive(Clone, Debug)]
pub struct Broker {
    url: String,
    /// One per node, in the order given; never empty. They differ only in host and port.
    nodes: Vec<AMQPUri>,
    /// The node the next connection is tried at first: the last one that answered.
    next: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// A CA file for amqps://, and its PEM text.
    ca: Option<(std::path::PathBuf, String)>,
}

impl Broker {
    /// Parses a broker URL. Its password is registered for redaction before anything can print it.
    pub fn from_url(url: &str) -> Result<Self> {
        redact::register_url(url);
        secret::warn_if_ambiguous(secret::AMQP_URL, url);
        let nodes = nodes::split(url)
            .map_err(|e| {
                Error::Usage(format!(
                    "invalid {} {}: {e}",
                    secret::AMQP_URL.flag,
                    redact::url(url)
                ))
            })?
            .iter()
            .map(|node| Self::node(url, node))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            url: url.to_owned(),
            nodes,
            next: std::sync::Arc::default(),
            ca: None,
        })
    }

    /// Parses the URL of one node of `url`.
    fn node(url: &str, node: &str) -> Result<AMQPUri> {
        let mut uri =
            AMQPUri::from_str(node).map_err(|e| secret::invalid_url(secret::AMQP_URL, url, &e))?;
        // The AMQP URI parser reads the host as a domain name only: an IPv6 address (`[2001:db8::5]`) would leave it
        // at its default, `localhost`, and the login would go there, in clear text on amqp://. Its address is the
        // host, unbracketed, as a socket address wants it.
        if let Ok(parsed) = url::Url::parse(node)
            && let Some(url::Host::Ipv6(address)) = parsed.host()
        {
            uri.authority.host = address.to_string();
        }
        if uri.authority.userinfo.password.len() >= 3 {
            redact::register(&uri.authority.userinfo.password);
        }
        if uri.query.heartbeat.is_none() {
            // RabbitMQ's default is 60 s, and a connection whose end is never seen (a node stopped under it, a
            // network gone) is given up only after two: two minutes of a consumer holding nothing. `?heartbeat=`
            // in the URL sets another.
            uri.query.heartbeat = Some(DEFAULT_HEARTBEAT_SECS);
        }
        Ok(uri)
    }

    /// The first node's settings: the user, the vhost and the options are every node's.
    fn uri(&self) -> &AMQPUri {
        &self.nodes[0]
    }

    /// How many nodes the URL names.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The broker `options` describe: the URL, with a CA file and a password file if given.
    pub fn new(options: &BrokerOptions) -> Result<Self> {
        let mut broker = Self::from_url(&options.url)?;
        if let Some(path) = &options.ca_file {
            // A CA file beside a connection that is not TLS verifies nothing, and the login goes in clear text: the
            // operator meant amqps://.
            if broker
                .nodes
                .iter()
                .any(|n| n.scheme != lapin::uri::AMQPScheme::AMQPS)
            {
                return Err(Error::Usage(format!(
                    "--amqp-ca-file {} is for amqps:// URLs, and --amqp-url is not one: that connection would not be \
                     encrypted (its login sent in clear text) and nothing would be verified against the file; use \
                     amqps://",
                    path.display()
                )));
            }
            let pem =
                secret::read_bounded_text("--amqp-ca-file", path, MAX_CA_FILE, "PEM certificates")?;
            if !pem.contains("-----BEGIN CERTIFICATE-----") {
                return Err(Error::Usage(format!(
                    "--amqp-ca-file {}: no PEM certificate in it",
                    path.display()
                )));
            }
            broker.ca = Some((path.clone(), pem));
        }
        if let Some(path) = &options.password_file {
            let password = secret::read_password_file("--amqp-password-file", path)?;
            if redact::has_password(&options.url) {
                return Err(secret::given_twice("--amqp-url", "--amqp-password-file"));
            }
            let user = broker.uri().authority.userinfo.username.clone();
            let urls: Vec<String> = nodes::split(&broker.url)
                .map_err(Error::Usage)?
                .iter()
                .map(|node| secret::url_with_password(node, &user, &password))
                .collect();
            broker.url = nodes::join(&urls).map_err(Error::Usage)?;
            for node in &mut broker.nodes {
                node.authority.userinfo.password.clone_from(&password);
            }
        }
        Ok(broker)
    }

    /// The CA file given with `--amqp-ca-file`, for child processes.
    pub fn ca_file(&self) -> Option<&std::path::Path> {
        self.ca.as_ref().map(|(path, _)| path.as_path())
    }

    /// The URL with its password masked, for messages.
    pub fn display_url(&self) -> String {
        redact::url(&self.url)
    }

    /// The URL as given, password included: only for handing to a child process, never for printing.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn vhost(&self) -> &str {
        &self.uri().vhost
    }

    /// The same broker — nodes, user, password, options, CA — in `vhost`.
    pub fn in_vhost(&self, vhost: &str) -> Broker {
        let mut other = self.clone();
        other.url = nodes::with_vhost(&self.url, vhost);
        for node in &mut other.nodes {
            node.vhost = vhost.to_owned();
        }
        other
    }

    /// The user inboxctl connects as.
    pub fn username(&self) -> &str {
        &self.uri().authority.userinfo.username
    }

    /// The address MassTransit writes for a queue of this broker, `rabbitmq://host[:port]/[vhost/]queue`, escaped so
    /// that `replay` reads back exactly this queue (see [`address`]).
    pub fn queue_address(&self, queue: &str) -> String {
        let uri = self.uri();
        let port = uri.authority.port;
        address::write(
            &bracketed(&uri.authority.host),
            (port != uri.scheme.default_port()).then_some(port),
            uri.scheme == lapin::uri::AMQPScheme::AMQPS,
            &uri.vhost,
            queue,
        )
    }

    /// Opens a connection, named so that `rabbitmqctl list_connections` shows who it is. With several nodes, the
    /// one that answered last is tried first, then each of the others in turn; a node that refuses the login or the
    /// vhost refuses for all of them (they share users and vhosts), so that ends the tries.
    pub async fn connect(&self, name: &str) -> Result<Connection> {
        use std::sync::atomic::Ordering::Relaxed;
        let first = self.next.load(Relaxed) % self.nodes.len();
        let mut unavailable = Error::BrokerUnavailable {
            url: self.display_url(),
            reason: "no node to connect to".to_owned(),
        };
        for k in 0..self.nodes.len() {
            let node = (first + k) % self.nodes.len();
            // Past this node before it is tried: a caller that gives up on the connect while a silent node keeps it
            // waiting (`top`, which bounds each refresh's connect) starts at the next one the next time, rather than
            // at the same silent node for ever.
            self.next.store(node + 1, Relaxed);
            match self.connect_node(node, name).await {
                Ok(connection) => {
                    self.next.store(node, Relaxed);
                    if k > 0 {
                        tracing::info!(node = %self.node_display(node), "connected to another RabbitMQ node");
                    }
                    return Ok(connection);
                }
                Err(e @ Error::BrokerUnavailable { .. }) => {
                    if self.nodes.len() > 1 {
                        tracing::warn!(node = %self.node_display(node), error = %e.for_a_retry(), "RabbitMQ node unavailable");
                    }
                    unavailable = e;
                }
                Err(e) => return Err(e),
            }
        }
        // The next try starts past the node that failed last.
        self.next.store(first + 1, Relaxed);
        Err(match unavailable {
            Error::BrokerUnavailable { url, reason } if self.nodes.len() > 1 => {
                Error::BrokerUnavailable {
                    url,
                    reason: format!(
                        "none of its {} nodes answered; the last: {reason}",
                        self.nodes.len()
                    ),
                }
            }
            e => e,
        })
    }

    /// Where node `node` is, for messages: `host:port`.
    fn node_display(&self, node: usize) -> String {
        let uri = &self.nodes[node];
        format!("{}:{}", bracketed(&uri.authority.host), uri.authority.port)
    }

    /// Opens a connection to node `node`.
    async fn connect_node(&self, node: usize, name: &str) -> Result<Connection> {
        let properties =
            ConnectionProperties::default().with_connection_name(name.to_owned().into());
        let uri = self.nodes[node].clone();
        let connect = async {
            match &self.ca {
                None => Connection::connect_uri(uri, properties).await,
                Some((_, pem)) => {
                    let tls = lapin::tcp::OwnedTLSConfig {
                        identity: None,
                        cert_chain: Some(pem.clone()),
                    };
                    let runtime = lapin::runtime::default_runtime()?;
                    Connection::connect_uri_with_config(uri, properties, tls, runtime).await
                }
            }
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(e)) => Err(self.diagnose(&e)),
            Err(_) => Err(Error::BrokerUnavailable {
                url: self.display_url(),
                reason: format!(
                    "no answer within {}",
                    humantime::format_duration(CONNECT_TIMEOUT)
                ),
            }),
        }
    }
}

impl Broker {
    /// The one place RabbitMQ's refusals of a connection become inboxctl's errors (the policy is in [`Error`]): a
    /// refused login, a vhost that does not exist or is closed to the user, else a broker that cannot be used.
    fn diagnose(&self, error: &lapin::Error) -> Error {
        use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
        let url = self.display_url();
        let reason = redact::text(&error.to_string());
        let lapin::ErrorKind::ProtocolError(refusal) = error.kind() else {
            return Error::BrokerUnavailable { url, reason };
        };
        let said = redact::text(refusal.get_message().as_str());
        match refusal.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                if said.contains("Login was refused") =>
            {
                Error::BrokerLoginRefused {
                    url,
                    user: self.username().to_owned(),
                    reason: said,
                }
            }
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) if said.contains("not found") => {
                Error::VhostMissing {
                    url,
                    vhost: self.vhost().to_owned(),
                    user: self.username().to_owned(),
                }
            }
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
            | AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => Error::PrivilegeRefused {
                service: "RabbitMQ",
                reason: said,
                fix: format!(
                    "let the user in: `rabbitmqctl set_permissions -p {} {} '.*' '.*' '.*'` (or the narrower grants of \
                     docs/security.md)",
                    self.vhost(),
                    self.username()
                ),
            },
            _ => Error::BrokerUnavailable { url, reason },
        }
    }
}

/// Whether a broker error means "another connection's exclusive queue" (405, `RESOURCE_LOCKED`).
pub fn is_locked(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(e)
            if matches!(e.kind(), lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::RESOURCELOCKED))
    )
}

/// Whether a broker error means "this entity does not exist" (a passive declare's 404).
pub fn is_not_found(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(e)
            if matches!(e.kind(), lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::NOTFOUND))
    )
}

/// Whether `error` says a queue does not exist ("no queue '…' in vhost '…'"). RabbitMQ answers NOT_FOUND too for a
/// queue that exists but cannot be reached — a classic queue whose node is down or that crashed ("home node … is down
/// or inaccessible") — which tells nothing of what it holds: taken for absent, its dead letters would read as none.
pub fn is_absent_queue(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(e)
            if matches!(e.kind(), lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::NOTFOUND))
                && e.get_message().as_str().starts_with("NOT_FOUND - no queue '")
    )
}

/// Validates a queue or exchange name given on the command line: AMQP allows at most 255 bytes, and inboxctl also
/// refuses control characters so that a name is always safe to print.
pub fn validate_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::Usage(format!("{what} must not be empty")));
    }
    if name.len() > 255 {
        return Err(Error::Usage(format!(
            "{what} is {} bytes long; AMQP allows at most 255",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::Usage(format!(
            "{what} must not contain control characters"
        )));
    }
    Ok(())
}

/// Whether no queue can be called `name`: empty, or longer than AMQP's 255 bytes. Any other name — a control
/// character in it included, which inboxctl's flags refuse but RabbitMQ takes — may be a queue's, and is looked at.
pub fn no_queue_can_have(name: &str) -> bool {
    name.is_empty() || name.len() > 255
}

/// A host as a URL writes it: an IPv6 address in brackets.
fn bracketed(host: &str) -> std::borrow::Cow<'_, str> {
    match host.contains(':') {
        true => format!("[{host}]").into(),
        false => host.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AMQP URI parser left an IPv6 host at `localhost`: the login went to whatever listened there.
    #[test]
    fn an_ipv6_host_is_connected_to_not_localhost() {
        let broker =
            Broker::from_url("amqp://app:s3cret@[2001:db8::5]:5673,[::1]/%2f").expect("valid");
        assert_eq!(broker.nodes[0].authority.host, "2001:db8::5");
        assert_eq!(broker.nodes[0].authority.port, 5673);
        assert_eq!(broker.nodes[1].authority.host, "::1");
        assert_eq!(broker.node_display(0), "[2001:db8::5]:5673");
        assert_eq!(broker.queue_address("q"), "rabbitmq://[2001:db8::5]:5673/q");
        let broker = Broker::from_url("amqp://app:s3cret@rabbit.example/%2f").expect("valid");
        assert_eq!(broker.nodes[0].authority.host, "rabbit.example");
    }

    #[test]
    fn queue_addresses_are_written_the_masstransit_way() {
        let broker = Broker::from_url("amqp://guest:guest@127.0.0.1:5672/%2f").expect("valid");
        assert_eq!(
            broker.queue_address("parcel-created-carrier"),
            "rabbitmq://127.0.0.1/parcel-created-carrier"
        );
        let broker = Broker::from_url("amqp://127.0.0.1:5673/shop").expect("valid");
        assert_eq!(
            broker.queue_address("q"),
            "rabbitmq://127.0.0.1:5673/shop/q"
        );
    }

    #[test]
    fn a_heartbeat_of_ten_seconds_unless_the_url_says_otherwise() {
        let broker = Broker::from_url("amqp://127.0.0.1:5672/%2f").expect("valid");
        assert_eq!(broker.uri().query.heartbeat, Some(DEFAULT_HEARTBEAT_SECS));
        let broker = Broker::from_url("amqp://127.0.0.1:5672/%2f?heartbeat=30").expect("valid");
        assert_eq!(broker.uri().query.heartbeat, Some(30));
    }

    #[test]
    fn a_host_list_is_one_node_per_host_sharing_user_vhost_and_options() {
        let broker =
            Broker::from_url("amqp://u:secret@a:5672,b:5673,c/shop?heartbeat=4").expect("valid");
        assert_eq!(broker.node_count(), 3);
        let hosts: Vec<_> = (0..3).map(|n| broker.node_display(n)).collect();
        assert_eq!(hosts, ["a:5672", "b:5673", "c:5672"]);
        for node in &broker.nodes {
            assert_eq!(node.vhost, "shop");
            assert_eq!(node.authority.userinfo.username, "u");
            assert_eq!(node.query.heartbeat, Some(4));
        }
        assert!(!broker.display_url().contains("secret"));
        assert!(Broker::from_url("amqp://a,,b/").is_err());
    }

    #[test]
    fn a_password_file_gives_every_node_its_password() {
        let dir = std::env::temp_dir().join(format!("inboxctl-nodes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("password");
        std::fs::write(&file, "s3cret-pw\n").expect("written");
        let broker = Broker::new(&BrokerOptions {
            url: "amqp://u@a:1,b:2/v".to_owned(),
            ca_file: None,
            password_file: Some(file),
        })
        .expect("valid");
        assert!(
            broker
                .nodes
                .iter()
                .all(|n| n.authority.userinfo.password == "s3cret-pw")
        );
        assert_eq!(broker.url(), "amqp://u:s3cret-pw@a:1,b:2/v");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn names_are_validated() {
        assert!(validate_name("queue", "parcel-created-carrier").is_ok());
        assert!(validate_name("queue", "").is_err());
        assert!(validate_name("queue", &"q".repeat(256)).is_err());
        assert!(validate_name("queue", "a\u{1b}b").is_err());
    }
}
