//! The metrics port's listener, bounded: at most [`MAX_CONNECTIONS`] at once, each for at most [`CONNECTION_LIFETIME`],
//! and its request read within [`REQUEST_WAIT`]: a slot held by a client that sends nothing is free again soon, so
//! that a few dozen silent sockets cannot keep a health probe (a second, typically) from being answered.
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
/// The longest a connection may take to send its request's head (reads fail past it until the head's blank line has
/// come, or the response begun): a scraper sends it at once. Not past the head: the handler's own time (the health
/// look's, up to 2 s) is not the client's, and hyper reads on meanwhile, to see a client that went away.
pub(super) const REQUEST_WAIT: Duration = Duration::from_secs(2);

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
            request_by: Some(Box::pin(tokio::time::sleep(REQUEST_WAIT))),
            tail: [0; 3],
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
    /// Until the request's head has come (or the response begun): when it must have come by.
    request_by: Option<Pin<Box<Sleep>>>,
    /// The last bytes read, to see the head's end (`\r\n\r\n`) across two reads.
    tail: [u8; 3],
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
        if let Some(by) = self.request_by.as_mut()
            && by.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no request in time",
            )));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if self.request_by.is_some() && buf.filled().len() > before {
            let mut seen = self.tail.to_vec();
            seen.extend_from_slice(&buf.filled()[before..]);
            if seen.windows(4).any(|w| w == b"\r\n\r\n") {
                self.request_by = None;
            }
            let last = &seen[seen.len() - 3..];
            self.tail.copy_from_slice(last);
        }
        read
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
        self.request_by = None;
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
