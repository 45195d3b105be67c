//! The HTTP side of a node: the management API (RabbitMQ's, `mgmt`), CMQ's API (`cmq`) and the web
//! UI (`ui`) on `--http-port`, and Prometheus metrics (`metrics`) on `--prometheus-port`. One axum
//! router per port, served on the server's runtime.
//!
//! Limits every route has, whatever the client: a request body of at most [`MAX_BODY_BYTES`]
//! (`DefaultBodyLimit`), JSON nested at most 128 deep (serde_json's recursion limit), request
//! headers read within [`HEADER_READ_TIMEOUT`] (a client trickling them is dropped), and at most
//! [`MAX_HTTP_CONNECTIONS`] connections at once (one request at a time each: HTTP/1.1). A handler
//! never holds more than its answer in memory.

pub mod auth;
pub mod cmq;
pub mod error;
pub mod fields;
pub mod list;
pub mod metrics;
pub mod mgmt;
pub mod rates;
pub mod ui;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::DefaultBodyLimit;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;
use warren_broker::Broker;
use warren_cluster::ClusterNode;

use crate::alarms::{AlarmState, Limits};
use crate::config::Config;
use crate::connection::registry::ConnectionRegistry;

/// The largest request body read (definitions of a few thousand queues fit).
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// A client must send a request's headers within this.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a count of open files is reused (`HttpContext::open_files`).
const OPEN_FILES_EVERY: Duration = Duration::from_secs(5);
/// Connections served at once per port; more wait in the kernel's accept queue.
pub const MAX_HTTP_CONNECTIONS: usize = 512;

/// What the HTTP handlers read: the broker, the node's configuration and state.
pub struct HttpContext {
    pub broker: Arc<Broker>,
    pub config: Config,
    /// A cluster member's node (None: a single node).
    pub cluster: Option<ClusterNode>,
    pub connections: Arc<ConnectionRegistry>,
    pub alarms: watch::Receiver<AlarmState>,
    /// The alarms' thresholds (reloaded on SIGHUP).
    pub limits: Arc<parking_lot::Mutex<Limits>>,
    pub started: Instant,
    /// This node's name as the API shows it (`warren@HOST` or `warren@node-ID`).
    pub node_name: String,
    /// The CMQ API's state: leases of received messages, its publisher session.
    pub cmq: cmq::Cmq,
    /// Message rates, sampled by `rates::run`.
    pub rates: Arc<rates::Rates>,
    /// Failed logins (Basic and CMQ signatures), shared with AMQP (`login_guard`).
    pub logins: Arc<crate::login_guard::LoginGuard>,
    /// The TLS configuration of the node's TLS listeners (its certificate's expiry is a metric).
    pub tls: Option<Arc<crate::tls::Tls>>,
    /// The open file descriptor count and when it was taken (`open_files`).
    open_files: parking_lot::Mutex<Option<(Instant, u64)>>,
}

impl HttpContext {
    pub fn new(
        broker: Arc<Broker>,
        config: Config,
        cluster: Option<ClusterNode>,
        connections: Arc<ConnectionRegistry>,
        alarms: watch::Receiver<AlarmState>,
        limits: Arc<parking_lot::Mutex<Limits>>,
        logins: Arc<crate::login_guard::LoginGuard>,
        tls: Option<Arc<crate::tls::Tls>>,
    ) -> Arc<HttpContext> {
        let node_name = match config.cluster() {
            Some(settings) => format!("warren@node-{}", settings.node_id),
            None => format!("warren@{}", hostname()),
        };
        Arc::new(HttpContext { broker, config, cluster, connections, alarms, limits, started: Instant::now(), node_name, cmq: cmq::Cmq::default(), rates: Default::default(), logins, tls, open_files: Default::default() })
    }

    /// This process's open file descriptors, counted at most every 5 s: counting them lists
    /// /proc/self/fd, which with a file per queue segment is 10 ms at 10,000 queues.
    pub fn open_files(&self) -> u64 {
        let mut cached = self.open_files.lock();
        match *cached {
            Some((at, n)) if at.elapsed() < OPEN_FILES_EVERY => n,
            _ => {
                let n = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
                *cached = Some((Instant::now(), n));
                n
            }
        }
    }

    /// The name of node `id` of the cluster (this node's own name without a cluster).
    pub fn node_name_of(&self, id: u64) -> String {
        match &self.cluster {
            Some(_) => format!("warren@node-{id}"),
            None => self.node_name.clone(),
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).ok().filter(|h| !h.is_empty()).unwrap_or_else(|| "localhost".to_owned())
}

/// How long one basic.get of the API may wait for its queue (a read from disk, a quorum queue's
/// commit).
const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// Takes ready messages off `queue` onto `channel` (basic.get with acks, for the API's own
/// channels: `/api/queues/.../get`, CMQ's receive) while `more()` says so and the queue has some.
/// An error says why the queue could not be asked; what was taken before it stays on the channel.
pub async fn get_ready(queue: &Arc<warren_broker::Queue>, channel: &warren_broker::Channel, mut more: impl FnMut() -> bool) -> Result<(), String> {
    use warren_broker::Got;
    while more() {
        match queue.get(channel, false) {
            Got::Message => {}
            Got::Empty => break,
            Got::Later(wait) => {
                if tokio::time::timeout(GET_TIMEOUT, queue.wait_for(wait)).await.is_err() {
                    return Err(format!("queue '{}' did not answer within {} s", queue.name, GET_TIMEOUT.as_secs()));
                }
                // Asked again: the head is there now.
            }
            Got::Failed(text) => return Err(text),
        }
    }
    Ok(())
}

/// Whether the store reaches `ticket` (what the caller wrote is on disk) within `within`.
pub async fn durable_within(store: &warren_store::Store, ticket: warren_store::SyncTicket, within: Duration) -> bool {
    let mut durable = store.durable();
    let reached = matches!(tokio::time::timeout(within, durable.wait_for(|at| *at >= ticket)).await, Ok(Ok(_)));
    reached
}

/// Binds the HTTP listener (`what` names it in the error).
pub async fn bind(addr: SocketAddr, what: &str) -> Result<TcpListener, String> {
    TcpListener::bind(addr).await.map_err(|e| format!("cannot listen for {what} on {addr}: {e}"))
}

/// The management port's router: RabbitMQ's API under `/api`, CMQ's at `/v2/index.php`.
pub fn management_router(ctx: Arc<HttpContext>) -> Router {
    Router::new()
        .nest("/api", mgmt::router(ctx.clone()))
        .route(cmq::PATH, axum::routing::get(cmq::handle).post(cmq::handle).with_state(ctx.clone()))
        .merge(ui::router())
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .fallback(error::not_found)
}

/// The Prometheus port's router.
pub fn metrics_router(ctx: Arc<HttpContext>) -> Router {
    metrics::router(ctx).layer(DefaultBodyLimit::max(64 << 10)).fallback(error::not_found)
}

/// The peer of the request's connection (the auth checks loopback-only users against it).
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub SocketAddr);

/// `/api/users/` is `/api/users`, as RabbitMQ's API takes both (rabbit-hole asks with the slash).
fn without_trailing_slash<B>(request: &mut hyper::Request<B>) {
    let path = request.uri().path();
    if path.len() > 1 && path.ends_with('/') {
        let trimmed = path.trim_end_matches('/');
        let new = match request.uri().query() {
            Some(q) => format!("{}?{q}", if trimmed.is_empty() { "/" } else { trimmed }),
            None => (if trimmed.is_empty() { "/" } else { trimmed }).to_owned(),
        };
        if let Ok(uri) = new.parse() {
            *request.uri_mut() = uri;
        }
    }
}

/// What the server does to each request before its router sees it.
pub fn prepare<B>(request: &mut hyper::Request<B>, peer: SocketAddr) {
    request.extensions_mut().insert(Peer(peer));
    without_trailing_slash(request);
}

/// The management port's router on a standalone broker opened in `data_dir`, with no listener:
/// what the HTTP fuzz target (`fuzz/fuzz_targets/http_api.rs`) sends its requests to, after
/// [`prepare`]. Must be called within a tokio runtime.
pub fn standalone_router(data_dir: &std::path::Path) -> Result<Router, String> {
    let config = Config { data_dir: data_dir.to_owned(), ..Config::default() };
    let options = crate::server::broker_options(&config, Default::default(), warren_broker::DEFAULT_NODE_BODY_BYTES);
    let (broker, report) = Broker::open(data_dir, options).map_err(|e| e.to_string())?;
    let (raft_logs, _) = warren_cluster::RaftLogs::open_discarding_damaged(broker.store().clone(), &report.store_queues, &[]).map_err(|e| e.to_string())?;
    broker.set_quorum_host(crate::server::standalone_quorum_groups(&config, raft_logs));
    let (_, alarms) = watch::channel(AlarmState::default());
    let limits = Arc::new(parking_lot::Mutex::new(Limits::from_config(&config)));
    let logins = Arc::new(crate::login_guard::LoginGuard::new(config.login_failures_before_delay, config.login_delay_max_ms));
    let ctx = HttpContext::new(broker, config, None, Arc::new(ConnectionRegistry::default()), alarms, limits, logins, None);
    Ok(management_router(ctx))
}

/// Serves `router` on `listener` until `shutdown`, then lets requests in flight finish.
/// `write_timeout`: a client that does not read its answer for this long is dropped (the
/// configuration's `write-timeout`, as for AMQP), so that clients that never read cannot hold
/// every connection slot. With `tls`, each connection is TLS first (its handshake within
/// `HEADER_READ_TIMEOUT`, under the port's connection slot).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    write_timeout: Duration,
    tls: Option<Arc<crate::tls::Tls>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(MAX_HTTP_CONNECTIONS));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit { Ok(p) => p, Err(_) => break },
            _ = shutdown.changed() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.changed() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let _ = stream.set_nodelay(true);
        let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
        stream.set_write_timeout(Some(write_timeout));
        let stream = Box::pin(stream);
        let router = router.clone();
        let stop = shutdown.clone();
        let acceptor = tls.as_ref().map(|tls| tls.http_acceptor());
        connections.spawn(async move {
            let _permit = permit;
            match acceptor {
                None => serve_connection(stream, peer, router, stop).await,
                Some(acceptor) => match tokio::time::timeout(HEADER_READ_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => serve_connection(stream, peer, router, stop).await,
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "HTTPS: TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "HTTPS: TLS handshake not completed in time"),
                },
            }
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(Duration::from_secs(5), async { while connections.join_next().await.is_some() {} }).await;
}

/// One HTTP/1.1 connection, until it closes or the server stops.
async fn serve_connection<S>(stream: S, peer: SocketAddr, router: Router, mut stop: watch::Receiver<bool>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
        prepare(&mut request, peer);
        router.clone().oneshot(request)
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
        }
    }
}
