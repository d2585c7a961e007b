//! The operator's HTTP endpoint on `--metrics-listen`: `/metrics` (Prometheus), `/healthz`
//! (the process answers) and `/readyz` (it should get traffic).
//!
//! It is a side door, so it is small and bounded: at most [`CONNECTIONS_MAX`] connections,
//! no keep-alive, GET or HEAD only, request heads of at most [`REQUEST_HEAD_BYTES_MAX`] read
//! within [`HEADER_READ_TIMEOUT`], and every connection closed after [`CONNECTION_TIME_MAX`].
//! One more connection than the maximum closes the *oldest* open one rather than being
//! turned away: an answer takes milliseconds, so the oldest is almost always a socket left
//! idle, and refusing the newcomer would let a few idle sockets, refilled as they time out,
//! keep every probe of `/healthz` out for good. A connection that has sent nothing yet goes
//! before one that has sent bytes of its request ([`Open`]): a probe halfway through its
//! request line is not the one a flood of refilled idle sockets closes. It starts before recovery, so a load balancer sees the
//! process alive (`/healthz` 200) but not ready (`/readyz` 503) while the WAL replays.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::scrape::Scrape;

/// Most HTTP connections at once; scrapers and probes need a handful.
pub const CONNECTIONS_MAX: usize = 16;
/// Most bytes of a request head (hyper's smallest read buffer is 8 KiB).
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 * 1024;
/// Longest a connection may take to send its request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest any one connection stays open, its answer included.
pub const CONNECTION_TIME_MAX: Duration = Duration::from_secs(30);

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CLASSIC_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Serves the endpoint on `listener` until `stop` is cancelled.
pub async fn serve(listener: TcpListener, scrape: Scrape, stop: CancellationToken) {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(scrape.clone()));
    let registry = Arc::new(registry);
    let open = Arc::new(Open::default());
    let mut accepted_count: u64 = 0;
    let tracker = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stop.cancelled() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Over the limit the oldest connection goes (see the module docs).
        accepted_count += 1;
        let (place, evicted) = Open::admit(&open, accepted_count);
        let (registry, scrape, stop) = (Arc::clone(&registry), scrape.clone(), stop.clone());
        tracker.spawn(async move {
            // Sent something: no longer the first to make way (bounded by the head timeout).
            let mut byte = [0u8];
            let first_byte = tokio::time::timeout(HEADER_READ_TIMEOUT, stream.peek(&mut byte));
            tokio::select! {
                sent = first_byte => match sent {
                    Ok(Ok(n)) if n > 0 => place.talked(),
                    _ => return, // silent past the head timeout, closed, or failed
                },
                () = stop.cancelled() => return,
                () = evicted.cancelled() => return,
            }
            let service = hyper::service::service_fn(move |request| {
                let answer = answer(&request, &registry, &scrape);
                async move { Ok::<_, Infallible>(answer) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(REQUEST_HEAD_BYTES_MAX)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = tokio::time::timeout(CONNECTION_TIME_MAX, connection) => {}
                () = stop.cancelled() => {}
                () = evicted.cancelled() => {}
            }
            drop(place);
        });
    }
    // Each connection ends at `stop` too; none outlives the server's state.
    tracker.close();
    tracker.wait().await;
}

/// The open connections by age, each with what closes it and whether it has sent bytes.
/// Past [`CONNECTIONS_MAX`], a newcomer closes the oldest silent one, or else the oldest.
#[derive(Default)]
struct Open {
    inner: std::sync::Mutex<std::collections::BTreeMap<u64, (CancellationToken, bool)>>,
}

/// A connection's entry in [`Open`], removed when dropped.
struct OpenPlace {
    open: Arc<Open>,
    id: u64,
}

impl Open {
    /// Connection `id`'s place and what closes it; makes room first if all are taken.
    fn admit(open: &Arc<Open>, id: u64) -> (OpenPlace, CancellationToken) {
        let mut inner = open.inner.lock().expect("metrics connections poisoned");
        if inner.len() >= CONNECTIONS_MAX {
            let silent = inner.iter().find(|(_, (_, talked))| !talked);
            let victim = silent.or(inner.iter().next()).map(|(id, _)| *id);
            if let Some((token, _)) = victim.and_then(|id| inner.remove(&id)) {
                token.cancel();
            }
        }
        let token = CancellationToken::new();
        inner.insert(id, (token.clone(), false));
        let place = OpenPlace {
            open: Arc::clone(open),
            id,
        };
        (place, token)
    }
}

impl OpenPlace {
    /// Notes that the connection has sent bytes.
    fn talked(&self) {
        let mut inner = self
            .open
            .inner
            .lock()
            .expect("metrics connections poisoned");
        if let Some((_, talked)) = inner.get_mut(&self.id) {
            *talked = true;
        }
    }
}

impl Drop for OpenPlace {
    fn drop(&mut self) {
        let mut inner = self
            .open
            .inner
            .lock()
            .expect("metrics connections poisoned");
        inner.remove(&self.id);
    }
}

fn answer(
    request: &Request<Incoming>,
    registry: &Registry,
    scrape: &Scrape,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD only\n".into());
    }
    match request.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => match scrape.readiness() {
            Ok(body) => text(StatusCode::OK, format!("{body}\n")),
            Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
        },
        "/metrics" => metrics(
            registry,
            scrape.executor().is_some(),
            wants_openmetrics(request),
        ),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /metrics, /healthz or /readyz\n".into(),
        ),
    }
}

/// Whether the client asked for OpenMetrics (Prometheus does); others get the classic text
/// format, which `promtool check metrics` and older tools read.
fn wants_openmetrics(request: &Request<Incoming>) -> bool {
    request
        .headers()
        .get_all(hyper::header::ACCEPT)
        .iter()
        .any(|v| {
            v.to_str()
                .is_ok_and(|v| v.contains("application/openmetrics-text"))
        })
}

/// OpenMetrics text as the classic Prometheus text format (0.0.4): a counter's HELP and TYPE
/// name its samples' `_total` name, and there is no `# EOF`.
pub fn to_classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines().filter(|l| *l != "# EOF") {
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find(|p| line.starts_with(*p));
        match meta {
            Some(prefix) => {
                let rest = &line[prefix.len()..];
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let suffix = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                out.push_str(&format!("{prefix}{name}{suffix} {tail}\n"));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

fn metrics(registry: &Registry, recovered: bool, openmetrics: bool) -> Response<Full<Bytes>> {
    if !recovered {
        let why = "not ready: recovering from the WAL\n";
        return text(StatusCode::SERVICE_UNAVAILABLE, why.into());
    }
    let mut body = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut body, registry) {
        let why = format!("cannot encode the metrics: {e}\n");
        return text(StatusCode::INTERNAL_SERVER_ERROR, why);
    }
    let (body, content_type) = if openmetrics {
        (body, OPENMETRICS)
    } else {
        (to_classic_text(&body), CLASSIC_TEXT)
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    let content_type = hyper::header::HeaderValue::from_static(content_type);
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, content_type);
    response
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}
