//! A loopback TCP proxy that a test cuts and restores, for a server's outage without touching the server, or whose
//! connections it silences, for connections that die without a word.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A loopback TCP proxy to `upstream` that a test can cut (every connection dropped, new ones refused by closing
/// them at once) and restore, or whose open connections it can silence ([`Proxy::silence`]).
pub struct Proxy {
    pub port: u16,
    state: Arc<Mutex<ProxyState>>,
    task: tokio::task::JoinHandle<()>,
}

struct ProxyState {
    open: bool,
    connections: Vec<Relayed>,
}

/// One connection through the proxy: its relay, and whether it is silenced.
struct Relayed {
    task: tokio::task::AbortHandle,
    silent: Arc<AtomicBool>,
}

impl Proxy {
    pub async fn start(upstream: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(ProxyState {
            open: true,
            connections: Vec::new(),
        }));
        let upstream = upstream.to_owned();
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                // Held from the look at `open` to the connection's registration: a cut in between would miss it.
                let mut s = shared.lock().unwrap();
                if !s.open {
                    drop(inbound);
                    continue;
                }
                let upstream = upstream.clone();
                let silent = Arc::new(AtomicBool::new(false));
                let relayed = Arc::clone(&silent);
                let handle = tokio::spawn(async move {
                    if let Ok(outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = inbound.set_nodelay(true);
                        let _ = outbound.set_nodelay(true);
                        let (in_read, in_write) = inbound.into_split();
                        let (out_read, out_write) = outbound.into_split();
                        tokio::join!(
                            relay(in_read, out_write, &relayed),
                            relay(out_read, in_write, &relayed)
                        );
                    }
                });
                s.connections.retain(|c| !c.task.is_finished());
                s.connections.push(Relayed {
                    task: handle.abort_handle(),
                    silent,
                });
            }
        });
        Self { port, state, task }
    }

    /// Drops every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        let mut s = self.state.lock().unwrap();
        s.open = false;
        for c in s.connections.drain(..) {
            c.task.abort();
        }
    }

    /// Every connection open now passes nothing more, either way, and stays open — neither end hears a close — as
    /// when a host is lost or a network cut: what was sent is swallowed, and an answer never comes. New connections
    /// go through as before.
    pub fn silence(&self) {
        for c in &self.state.lock().unwrap().connections {
            c.silent.store(true, Ordering::SeqCst);
        }
    }

    /// A URL to the database `name` of the local PostgreSQL through this proxy (the proxy started to port 5432).
    pub fn postgres_url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    pub fn restore(&self) {
        self.state.lock().unwrap().open = true;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

/// Copies one direction of a connection until either end closes it, or, once `silent`, holds both ends open and
/// passes nothing (an end closing included).
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    silent: &AtomicBool,
) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let read = from.read(&mut buf).await;
        if silent.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown().await;
}
