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
pub mod pass;
pub mod peek;
pub mod publish;
mod reconnect;
pub mod topology;

pub use error::BrokerError;
pub use lapin::message::Delivery;
pub use lapin::{BasicProperties, Connection};
pub use reconnect::{GaveUp, Link, MAX_FRUITLESS_RECONNECTS, close, is_connection_lost};

use std::str::FromStr;
use std::time::Duration;

use lapin::ConnectionProperties;
use lapin::uri::AMQPUri;

use crate::error::{Error, Result};
use crate::{redact, secret};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The heartbeat asked for unless the URL says otherwise, in seconds: a dead connection is noticed within two.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 10;

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

/// Connection settings parsed from an `amqp://` or `amqps://` URL.
#[derive(Clone, Debug)]
pub struct Broker {
    url: String,
    uri: AMQPUri,
    /// A CA file for amqps://, and its PEM text.
    ca: Option<(std::path::PathBuf, String)>,
}

impl Broker {
    /// Parses a broker URL. Its password is registered for redaction before anything can print it.
    pub fn from_url(url: &str) -> Result<Self> {
        redact::register_url(url);
        let uri =
            AMQPUri::from_str(url).map_err(|e| secret::invalid_url(secret::AMQP_URL, url, &e))?;
        secret::warn_if_ambiguous(secret::AMQP_URL, url);
        if uri.authority.userinfo.password.len() >= 3 {
            redact::register(&uri.authority.userinfo.password);
        }
        let mut uri = uri;
        if uri.query.heartbeat.is_none() {
            // RabbitMQ's default is 60 s, and a connection whose end is never seen (a node stopped under it, a
            // network gone) is given up only after two: two minutes of a consumer holding nothing. `?heartbeat=`
            // in the URL sets another.
            uri.query.heartbeat = Some(DEFAULT_HEARTBEAT_SECS);
        }
        Ok(Self {
            url: url.to_owned(),
            uri,
            ca: None,
        })
    }

    /// The broker `options` describe: the URL, with a CA file and a password file if given.
    pub fn new(options: &BrokerOptions) -> Result<Self> {
        let mut broker = Self::from_url(&options.url)?;
        if let Some(path) = &options.ca_file {
            let pem = std::fs::read_to_string(path)
                .map_err(|e| Error::Usage(format!("--amqp-ca-file {}: {e}", path.display())))?;
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
            broker.url = secret::url_with_password(
                &broker.url,
                &broker.uri.authority.userinfo.username,
                &password,
            );
            broker.uri.authority.userinfo.password = password;
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
        &self.uri.vhost
    }

    /// The user inboxctl connects as.
    pub fn username(&self) -> &str {
        &self.uri.authority.userinfo.username
    }

    /// The address MassTransit writes for a queue of this broker, `rabbitmq://host[:port]/[vhost/]queue`, escaped so
    /// that `replay` reads back exactly this queue (see [`address`]).
    pub fn queue_address(&self, queue: &str) -> String {
        let port = self.uri.authority.port;
        address::write(
            &self.uri.authority.host,
            (port != self.uri.scheme.default_port()).then_some(port),
            self.uri.scheme == lapin::uri::AMQPScheme::AMQPS,
            &self.uri.vhost,
            queue,
        )
    }

    /// Opens a connection, named so that `rabbitmqctl list_connections` shows who it is.
    pub async fn connect(&self, name: &str) -> Result<Connection> {
        let properties =
            ConnectionProperties::default().with_connection_name(name.to_owned().into());
        let uri = self.uri.clone();
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

/// Whether a broker error means "this entity does not exist" (a passive declare's 404).
pub fn is_not_found(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(e)
            if matches!(e.kind(), lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::NOTFOUND))
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(broker.uri.query.heartbeat, Some(DEFAULT_HEARTBEAT_SECS));
        let broker = Broker::from_url("amqp://127.0.0.1:5672/%2f?heartbeat=30").expect("valid");
        assert_eq!(broker.uri.query.heartbeat, Some(30));
    }

    #[test]
    fn names_are_validated() {
        assert!(validate_name("queue", "parcel-created-carrier").is_ok());
        assert!(validate_name("queue", "").is_err());
        assert!(validate_name("queue", &"q".repeat(256)).is_err());
        assert!(validate_name("queue", "a\u{1b}b").is_err());
    }
}
