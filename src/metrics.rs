//! `--metrics-addr`: the process's counters in Prometheus' text format on `/metrics`, and `/health`, which says
//! whether PostgreSQL and RabbitMQ are reachable (200 when all it depends on is, 503 otherwise).
//!
//! A few lines of HTTP/1.1 over a TCP listener are all this needs, so it takes no web framework.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// What a process exports.
pub trait Exporter: Send + Sync + 'static {
    /// The exposition text of every metric.
    fn metrics(&self) -> String;
    /// Each dependency with whether it is reachable now.
    fn health(&self) -> BoxFuture<'_, Vec<(&'static str, bool)>>;
}

/// One metric family in Prometheus' text format, with a sample per label value.
pub struct Family<'a> {
    pub name: &'a str,
    pub help: &'a str,
    pub kind: &'a str,
}

impl Family<'_> {
    pub fn write(&self, out: &mut String, samples: &[(Option<(&str, &str)>, f64)]) {
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        for (label, value) in samples {
            match label {
                Some((key, v)) => {
                    let _ = writeln!(
                        out,
                        "{}{{{key}=\"{}\"}} {value}",
                        self.name,
                        escape_label(v)
                    );
                }
                None => {
                    let _ = writeln!(out, "{} {value}", self.name);
                }
            }
        }
    }
}

/// A label value as the text format wants it: backslash, double quote and newline escaped.
pub fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Binds `addr` now (so a bad address is an error at start) and serves until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    exporter: Arc<dyn Exporter>,
    shutdown: CancellationToken,
) -> Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Usage(format!("--metrics-addr {addr}: {e}")))?;
    tracing::info!(%addr, "serving /metrics and /health");
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = listener.accept() => {
                    if let Ok((stream, _)) = accepted {
                        let exporter = Arc::clone(&exporter);
                        tokio::spawn(async move {
                            let _ = tokio::time::timeout(Duration::from_secs(10), answer(stream, exporter)).await;
                        });
                    }
                }
            }
        }
    });
    Ok(())
}

async fn answer(mut stream: TcpStream, exporter: Arc<dyn Exporter>) -> std::io::Result<()> {
    let mut request = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&request);
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let path = path.split('?').next().unwrap_or_default();
    let (status, content_type, body) = match (method, path) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            exporter.metrics(),
        ),
        ("GET", "/health") => {
            let checks = exporter.health().await;
            let healthy = checks.iter().all(|(_, up)| *up);
            let body = format!(
                "{{{}}}\n",
                checks
                    .iter()
                    .map(|(name, up)| format!("\"{name}\":\"{}\"", if *up { "up" } else { "down" }))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            (
                if healthy {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                },
                "application/json",
                body,
            )
        }
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "try /metrics or /health\n".to_owned(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n".to_owned(),
        ),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// Whether PostgreSQL answers within two seconds.
pub async fn database_up(pool: &sqlx::PgPool) -> bool {
    let ping = crate::db::ping(pool);
    matches!(
        tokio::time::timeout(Duration::from_secs(2), ping).await,
        Ok(Ok(1))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_written_in_the_text_format() {
        let mut out = String::new();
        Family {
            name: "inbox_duplicates_discarded_total",
            help: "Copies discarded.",
            kind: "counter",
        }
        .write(&mut out, &[(Some(("consumer_type", "a\"b\\c\nd")), 3.0)]);
        assert_eq!(
            out,
            "# HELP inbox_duplicates_discarded_total Copies discarded.\n\
             # TYPE inbox_duplicates_discarded_total counter\n\
             inbox_duplicates_discarded_total{consumer_type=\"a\\\"b\\\\c\\nd\"} 3\n"
        );
    }
}
