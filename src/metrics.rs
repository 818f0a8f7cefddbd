//! `--metrics-addr`: the process's metrics in Prometheus' text format (version 0.0.4) on `/metrics`, and `/health`,
//! which says whether PostgreSQL and RabbitMQ are reachable (200 when all it depends on is, 503 otherwise, with a JSON
//! object of each dependency's state).
//!
//! The metrics are kept and written by `prometheus-client`, one registry per process: what `consume` exports is in
//! [`consume`] (its counters, read from the run's counts at each scrape, and the histograms of its processing time and
//! of its claims' wait, fed as it goes), what `cleanup --every` exports in [`cleanup`]. axum on hyper serves them, one
//! response per connection, a bounded number of connections for a bounded time each ([`listener`]), until the
//! shutdown token is cancelled.

pub mod cleanup;
pub mod consume;
mod listener;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::future::BoxFuture;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// What `/health` checks: each dependency with whether it is reachable now.
pub trait Health: Send + Sync + 'static {
    fn check(&self) -> BoxFuture<'_, Vec<(&'static str, bool)>>;
}

/// The buckets of every histogram of durations, in seconds: from half a millisecond (a claim that waited for nobody, a
/// duplicate) to ten seconds (a copy that waited on a slow attempt, a message retried), each about 2–2.5 times the one
/// before.
pub const SECONDS_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The label of every per-consumer metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ConsumerLabel {
    pub consumer_type: String,
}

/// The label set of a family's only sample.
pub(crate) const UNLABELLED: [(&str, &str); 0] = [];

/// A family a collector writes at scrape time, with a sample per label set. With no sample (no label value yet), its
/// HELP and TYPE lines alone.
pub(crate) fn encode_family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    samples: impl IntoIterator<Item = (L, M)>,
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, metric) in samples {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Binds `addr` now (so a bad address, or one in use, is an error at start) and serves `/metrics` from `registry` and
/// `/health` from `health` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
    health: Arc<dyn Health>,
    shutdown: CancellationToken,
) -> Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Usage(format!("--metrics-addr {addr}: {e}")))?;
    tracing::info!(%addr, "serving /metrics and /health");
    let exposed = Arc::new(Exposed { registry, health });
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health_check))
        .fallback(elsewhere)
        .method_not_allowed_fallback(elsewhere)
        .layer(axum::middleware::map_response(close_connection))
        .with_state(exposed);
    tokio::spawn(async move {
        let served = axum::serve(listener::Bounded::new(listener), app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::warn!(error = %e, "serving /metrics and /health failed");
        }
    });
    Ok(())
}

struct Exposed {
    registry: Registry,
    health: Arc<dyn Health>,
}

async fn metrics(State(exposed): State<Arc<Exposed>>) -> Response {
    let mut body = String::new();
    match prometheus_text::encode(&mut body, &exposed.registry) {
        Ok(()) => (
            [(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)],
            body,
        )
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "writing the metrics failed");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

async fn health_check(State(exposed): State<Arc<Exposed>>) -> Response {
    let checks = exposed.health.check().await;
    let healthy = checks.iter().all(|(_, up)| *up);
    let body = format!(
        "{{{}}}\n",
        checks
            .iter()
            .map(|(name, up)| format!("\"{name}\":\"{}\"", if *up { "up" } else { "down" }))
            .collect::<Vec<_>>()
            .join(",")
    );
    let status = match healthy {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn elsewhere(method: Method) -> Response {
    match method {
        Method::GET => (StatusCode::NOT_FOUND, "try /metrics or /health\n").into_response(),
        _ => (StatusCode::METHOD_NOT_ALLOWED, "GET only\n").into_response(),
    }
}

/// One response per connection: nothing is left open between scrapes.
async fn close_connection(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Whether PostgreSQL answers within two seconds.
pub async fn database_up(pool: &sqlx::PgPool) -> bool {
    crate::db::answers_within(pool, Duration::from_secs(2)).await
}
