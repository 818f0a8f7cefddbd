//! The bench's errors: inboxctl's, and a tool the peer mode needs (Node.js and npm) that is missing or failed.

use inboxctl::error::exit;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Inboxctl(#[from] inboxctl::Error),

    /// A tool the bench needs (the peer's Node.js and npm) is missing or failed.
    #[error("{0}")]
    Tool(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn usage(message: impl Into<String>) -> Self {
        Error::Inboxctl(inboxctl::Error::Usage(message.into()))
    }

    pub fn topology(message: impl Into<String>) -> Self {
        Error::Inboxctl(inboxctl::Error::Topology(message.into()))
    }

    /// The exit code a process ending with this error returns: inboxctl's, and 69 for a missing tool.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Inboxctl(e) => e.exit_code(),
            Error::Tool(_) => exit::UNAVAILABLE,
        }
    }

    /// Prints `error: …` to stderr as inboxctl does: without passwords or control characters.
    pub fn report(&self) {
        match self {
            Error::Inboxctl(e) => inboxctl::report(e),
            Error::Tool(text) => eprintln!(
                "error: {}",
                inboxctl::sanitize::multiline(&inboxctl::redact::text(text))
            ),
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Inboxctl(e.into())
    }
}

impl From<lapin::Error> for Error {
    fn from(e: lapin::Error) -> Self {
        Error::Inboxctl(e.into())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Inboxctl(e.into())
    }
}
