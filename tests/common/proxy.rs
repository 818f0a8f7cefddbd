//! A loopback TCP proxy that a test cuts and restores, for a server's outage without touching the server.

use std::sync::{Arc, Mutex};

/// A loopback TCP proxy to `upstream` that a test can cut (every connection dropped, new ones refused by closing
/// them at once) and restore.
pub struct Proxy {
    pub port: u16,
    state: Arc<Mutex<ProxyState>>,
    task: tokio::task::JoinHandle<()>,
}

struct ProxyState {
    open: bool,
    connections: Vec<tokio::task::AbortHandle>,
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
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                if !shared.lock().unwrap().open {
                    drop(inbound);
                    continue;
                }
                let upstream = upstream.clone();
                let handle = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                let mut s = shared.lock().unwrap();
                s.connections.retain(|h| !h.is_finished());
                s.connections.push(handle.abort_handle());
            }
        });
        Self { port, state, task }
    }

    /// Drops every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        let mut s = self.state.lock().unwrap();
        s.open = false;
        for c in s.connections.drain(..) {
            c.abort();
        }
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
