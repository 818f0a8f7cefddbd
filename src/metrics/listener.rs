//! The metrics port's listener, bounded: at most [`MAX_CONNECTIONS`] at once, each for at most [`CONNECTION_LIFETIME`].
//! axum serves with no timeout on reading a request, so a client that opens sockets and sends nothing (or half a
//! request) would hold each for ever, until the process ran out of file descriptors — and with them the consumer's
//! next connection to PostgreSQL or RabbitMQ.

use std::future::Future as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

/// Connections served at once; more wait in the kernel's backlog until one ends.
const MAX_CONNECTIONS: usize = 32;
/// The longest a connection lasts: a scrape or a health look takes milliseconds (one response per connection).
pub(super) const CONNECTION_LIFETIME: Duration = Duration::from_secs(10);

pub(super) struct Bounded {
    listener: TcpListener,
    slots: Arc<Semaphore>,
}

impl Bounded {
    pub(super) fn new(listener: TcpListener) -> Self {
        Self {
            listener,
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
        }
    }
}

impl axum::serve::Listener for Bounded {
    type Io = Deadlined;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // The semaphore is never closed: a permit always comes, once a connection ends.
        let permit = Arc::clone(&self.slots).acquire_owned().await.ok();
        let (io, addr) = axum::serve::Listener::accept(&mut self.listener).await;
        let io = Deadlined {
            io,
            deadline: Box::pin(tokio::time::sleep(CONNECTION_LIFETIME)),
            _slot: permit,
        };
        (io, addr)
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// A connection that fails its reads and writes once its lifetime is over (hyper then closes it), holding its slot
/// until it is dropped.
pub(super) struct Deadlined {
    io: TcpStream,
    deadline: Pin<Box<Sleep>>,
    _slot: Option<OwnedSemaphorePermit>,
}

impl Deadlined {
    /// Past its lifetime: an error. Polling the deadline also wakes a read waiting on a silent client when it ends.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        self.deadline.as_mut().poll(cx).is_ready().then(|| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the connection outlived its time",
            )
        })
    }
}

impl AsyncRead for Deadlined {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(e) = self.expired(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Deadlined {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(e) = self.expired(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
