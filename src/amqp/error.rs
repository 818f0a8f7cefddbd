//! The broker's errors as the rest of inboxctl sees them: the AMQP client's error type stays in this room.

use crate::error::Error;

/// An error of the AMQP client: a channel or the connection closed by the broker (with its reason), or lost.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct BrokerError(#[from] pub(super) lapin::Error);

impl BrokerError {
    /// The connection's input or output failed (the broker went away, the network broke).
    pub fn is_io_error(&self) -> bool {
        self.0.is_io_error()
    }

    /// The broker refused something and closed the channel with its reason (a permission, an exclusive queue of
    /// another connection): the connection itself lives on.
    pub fn is_refusal(&self) -> bool {
        self.0.is_amqp_soft_error()
    }

    /// The broker refused for want of a permission (`ACCESS_REFUSED` on a queue or an exchange).
    pub fn is_access_refused(&self) -> bool {
        matches!(
            self.0.kind(),
            lapin::ErrorKind::ProtocolError(e)
                if matches!(e.kind(), lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::ACCESSREFUSED))
        )
    }

    /// What to do about it, when there is something to say: the permission to grant.
    pub fn fix(&self) -> Option<&'static str> {
        self.is_access_refused().then_some(
            "grant the user the permission with `rabbitmqctl set_permissions` (docs/security.md lists what each \
             command needs)",
        )
    }
}

impl From<lapin::Error> for Error {
    fn from(error: lapin::Error) -> Self {
        Error::Broker(BrokerError(error))
    }
}
