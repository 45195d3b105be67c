//! `warren server`: opens the broker, listens for AMQP connections, runs housekeeping, and
//! shuts down cleanly on SIGTERM/SIGINT.

use crate::config::Config;
use crate::connection::{self, ServerContext, Transport};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::watch;
use crate::alarms::{self, AlarmState, Limits};
use warren_broker::queue::body_memory::NodeBodies;
use warren_broker::{Broker, BrokerOptions};
use warren_store::{StoreOptions, SyncPolicy};

/// The node id of a node without peers (its quorum queues' groups have it as their only voter).
const STANDALONE_NODE_ID: u64 = 0;

/// How often message TTL and queue expiry are checked.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_millis(100);

/// How often the store's activity is logged (only when there was some).
const STORE_STATS_INTERVAL: Duration = Duration::from_secs(10);

/// Logs the store's rates (messages, fsyncs, bytes) over the last interval, for operators and benchmarks.
struct StoreActivity {
    last: warren_store::StoreStats,
    at: std::time::Instant,
}

impl StoreActivity {
    fn new(stats: warren_store::StoreStats) -> Self {
        StoreActivity { last: stats, at: std::time::Instant::now() }
    }

    fn maybe_log(&mut self, now: warren_store::StoreStats) {
        let secs = self.at.elapsed().as_secs_f64();
        if secs < STORE_STATS_INTERVAL.as_secs_f64() {
            return;
        }
        let d = |a: u64, b: u64| a.saturating_sub(b) as f64 / secs;
        if now.records != self.last.records {
            tracing::info!(
                records_per_s = d(now.records, self.last.records) as u64,
                batches_per_s = d(now.batches, self.last.batches) as u64,
                fsyncs_per_s = d(now.fsyncs, self.last.fsyncs) as u64,
                mb_written_per_s = (d(now.bytes_written, self.last.bytes_written) / 1e6) as u64,
                checkpoints = now.checkpoints - self.last.checkpoints,
                wal_mb = now.wal_bytes >> 20,
                queue_files_mb = now.queue_bytes >> 20,
                "store activity"
            );
        }
        self.last = now;
        self.at = std::time::Instant::now();
    }
}

/// The listeners that speak TLS first, open when `tls-cert` and `tls-key` are set.
struct TlsListeners {
    amqp: TcpListener,
    http: TcpListener,
    metrics: TcpListener,
}

/// Re-reads the configuration (file, environment, flags) on SIGHUP.
pub type Reload = Box<dyn Fn() -> Result<Config, crate::config::ConfigError> + Send + Sync>;

/// The broker's options from the node's configuration.
pub fn broker_options(config: &Config, store: StoreOptions, quorum_body_bytes: u64) -> BrokerOptions {
    BrokerOptions {
        default_vhost: config.default_vhost.clone(),
        default_user: config.default_user.clone(),
        default_pass: config.default_pass.clone(),
        loopback_users: config.loopback_users.clone(),
        store,
        quorum_body_bytes,
    }
}

/// The quorum queues' groups of a node outside any cluster: each on this node alone.
pub fn standalone_quorum_groups(config: &Config, raft_logs: Arc<warren_cluster::RaftLogs>) -> Arc<crate::quorum::QuorumGroups> {
    let node_addr = warren_cluster::NodeAddr { cluster_addr: String::new(), amqp_addr: config.amqp_addr().to_string() };
    crate::quorum::QuorumGroups::new(raft_logs, STANDALONE_NODE_ID, node_addr)
}

/// The first start records the default user and vhost (`Broker::bootstrap_auth`): standalone at
/// once; in a cluster once the metadata group commits it (retried until then; meanwhile the
/// configured default user is the only one). Nothing to do on later starts.
fn bootstrap_users(broker: &Arc<Broker>, clustered: bool) -> Result<(), String> {
    if broker.auth_initialized() {
        return Ok(());
    }
    if !clustered {
        return broker.bootstrap_auth().map_err(|e| format!("cannot record the default user and vhost: {e}"));
    }
    let broker = broker.clone();
    tokio::spawn(async move {
        let mut failures = 0u32;
        while let Err(e) = broker.bootstrap_auth() {
            failures += 1;
            if failures % 10 == 0 {
                tracing::warn!(error = %e, "the metadata group has not recorded the default user and vhost yet; retrying");
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    });
    Ok(())
}

pub async fn run(mut config: Config, reload: Reload) -> Result<(), Box<dyn std::error::Error>> {
    // Installed before anything else: a SIGTERM, SIGINT or SIGHUP that comes during recovery or just
    // after the listener binds is then handled, instead of killing the process (their default action).
    let stop_signals = ShutdownSignals::install().map_err(|e| format!("cannot handle SIGTERM/SIGINT: {e}"))?;
    let hangup = signal(SignalKind::hangup()).map_err(|e| format!("cannot handle SIGHUP: {e}"))?;
    let store = StoreOptions {
        segment_size: config.segment_size,
        sync: match config.sync_interval_ms() {
            0 => SyncPolicy::EveryBatch,
            ms => SyncPolicy::IntervalMs(ms),
        },
        recovery_mode: config.recovery_mode,
        ..StoreOptions::default()
    };
    if config.sync_interval_ms() > 0 {
        tracing::warn!(
            interval_ms = config.sync_interval_ms(),
            "fsync runs on an interval: confirms wait up to one interval longer, and a machine crash can lose messages accepted but not yet confirmed"
        );
    }
    // The real disk, unless a test asked for the power-loss simulator (`powercut`).
    let (disk, data_dir) = crate::powercut::disk(&config.data_dir)?;
    config.data_dir = data_dir;
    let limits = Limits::from_config(&config);
    let (broker, report) = Broker::open_on(&config.data_dir, broker_options(&config, store, quorum_body_bytes(&limits)), disk)?;
    tracing::info!(
        queues = report.queues,
        messages = report.messages,
        dropped = report.dropped,
        elapsed_ms = report.elapsed_ms as u64,
        "recovered state from {}",
        config.data_dir.display()
    );
    if !report.lost.is_empty() {
        let messages: u64 = report.lost.iter().map(|(_, n)| n).sum();
        tracing::error!(
            queues = report.lost.len(),
            messages,
            "messages were lost with store files that are missing or cut short (see the errors above); the rest was recovered"
        );
    }
    if !report.kept_aside.is_empty() {
        let messages: u64 = report.kept_aside.iter().map(|(_, n)| n).sum();
        tracing::error!(
            queues = report.kept_aside.len(),
            messages,
            "messages of queues missing from the metadata log are kept aside in the store (see the errors above); nothing was deleted"
        );
    }

    // The Raft logs of this node's groups (quorum queues; the metadata group when clustered), in the WAL.
    // A member of a cluster rebuilds from the other members the groups whose log it lost part of;
    // a single node has no one to ask (what it lost is reported above).
    let lost_queues: Vec<u64> = if config.cluster().is_some() { report.lost.iter().map(|(queue, _)| *queue).collect() } else { Vec::new() };
    let (raft_logs, rebuild) = warren_cluster::RaftLogs::open_discarding_damaged(broker.store().clone(), &report.store_queues, &lost_queues)
        .map_err(|e| format!("cannot open the Raft logs: {e}"))?;
    // A cluster member (with --peers): the cluster port, the failure detector, the metadata group.
    let cluster = match config.cluster() {
        Some(settings) => Some(crate::cluster::start(&config, settings, &raft_logs, &rebuild, &broker).await?),
        None => None,
    };
    // Quorum queues: each its own Raft group (`quorum`), on this node alone or on members of the cluster.
    let quorum_groups = match (&cluster, config.cluster()) {
        (Some(node), Some(settings)) => {
            let peers = settings.peers.iter().map(|(id, _)| *id).collect();
            crate::quorum::QuorumGroups::clustered(raft_logs.clone(), node.clone(), peers)
        }
        _ => standalone_quorum_groups(&config, raft_logs.clone()),
    };
    broker.set_quorum_host(quorum_groups.clone());
    // Delayed messages due while the node was down leave now.
    broker.start_delays();
    if let Some(node) = &cluster {
        // Classic queues across the nodes: publishes and consumers of other nodes, deliveries to ours.
        let _ = quorum_groups.classic.set(crate::classic_home::ClassicHome::start(Arc::downgrade(&broker), node.clone()));
        // `warren ctl remove-node` and `grow` record quorum queues' members through the broker.
        crate::queue_members::QueueMembersAdmin::install(&broker, node, &quorum_groups);
    }

    let listener = TcpListener::bind(config.amqp_addr()).await.map_err(|e| {
        format!("cannot listen for AMQP on {}: {e}", config.amqp_addr())
    })?;
    let http_listener = crate::http::bind(config.http_addr(), "the management API (HTTP)").await?;
    let metrics_listener = crate::http::bind(config.prometheus_addr(), "Prometheus metrics (HTTP)").await?;
    // With a certificate: AMQPS, HTTPS and the metrics over TLS, beside the plain ports.
    let tls = match config.tls() {
        Some(settings) => Some(crate::tls::Tls::load(&settings).map_err(|e| format!("cannot set up TLS: {e}"))?),
        None => None,
    };
    let tls_listeners = match &tls {
        Some(_) => Some(TlsListeners {
            amqp: TcpListener::bind(config.amqps_addr())
                .await
                .map_err(|e| format!("cannot listen for AMQP over TLS on {}: {e}", config.amqps_addr()))?,
            http: crate::http::bind(config.https_addr(), "the management API (HTTPS)").await?,
            metrics: crate::http::bind(config.prometheus_tls_addr(), "Prometheus metrics (HTTPS)").await?,
        }),
        None => None,
    };
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let limits = Arc::new(parking_lot::Mutex::new(limits));
    let (alarm_tx, alarm_rx) = watch::channel(AlarmState::default());
    let alarm_monitor = tokio::spawn(alarms::monitor(config.data_dir.clone(), broker.store().clone(), limits.clone(), alarm_tx, shutdown_rx.clone()));
    let reloader = tokio::spawn(reload_on_sighup(hangup, reload, limits.clone(), broker.quorum_bodies(), tls.clone(), shutdown_rx.clone()));
    let registry = Arc::new(connection::registry::ConnectionRegistry::default());
    let logins = Arc::new(crate::login_guard::LoginGuard::new(config.login_failures_before_delay, config.login_delay_max_ms));
    // A connection whose user, permission or vhost is removed closes (every node applies the change).
    let closing = registry.clone();
    broker.on_auth_change(Box::new(move |change| closing.close_for(change)));
    bootstrap_users(&broker, cluster.is_some())?;
    let ctx = Arc::new(ServerContext {
        broker: broker.clone(),
        config: config.clone(),
        alarms: alarm_rx.clone(),
        slots: connection::ConnectionSlots::new(config.max_connections),
        registry: registry.clone(),
        handshakes: crate::login_guard::HandshakeSlots::new(config.max_handshakes as usize, config.max_handshakes_per_source as usize),
        logins: logins.clone(),
        tls: tls.clone(),
        cluster: cluster.clone(),
    });
    tracing::info!("accepting AMQP 0-9-1 connections on {}", listener.local_addr()?);
    let http = crate::http::HttpContext::new(broker.clone(), config.clone(), cluster.clone(), registry.clone(), alarm_rx.clone(), limits.clone(), logins.clone(), tls.clone());
    if let Some(classic) = quorum_groups.classic.get() {
        // The other nodes' management APIs ask this one for its part of cluster-wide answers.
        classic.set_management(crate::http::mgmt::peers::service(&http));
    }
    tracing::info!("serving the management API on http://{}", http_listener.local_addr()?);
    tracing::info!("serving Prometheus metrics on http://{}/metrics", metrics_listener.local_addr()?);
    let write_timeout = Duration::from_secs(config.write_timeout as u64);
    let mut http_servers = tokio::task::JoinSet::new();
    let management = crate::http::management_router(http.clone());
    let metrics = crate::http::metrics_router(http.clone());
    http_servers.spawn(crate::http::serve(http_listener, management.clone(), write_timeout, None, shutdown_rx.clone()));
    http_servers.spawn(crate::http::serve(metrics_listener, metrics.clone(), write_timeout, None, shutdown_rx.clone()));
    let amqps_listener = match tls_listeners {
        Some(TlsListeners { amqp, http: https, metrics: metrics_tls }) => {
            tracing::info!("accepting AMQP 0-9-1 connections over TLS on {}", amqp.local_addr()?);
            tracing::info!("serving the management API on https://{}", https.local_addr()?);
            tracing::info!("serving Prometheus metrics on https://{}/metrics", metrics_tls.local_addr()?);
            http_servers.spawn(crate::http::serve(https, management, write_timeout, tls.clone(), shutdown_rx.clone()));
            http_servers.spawn(crate::http::serve(metrics_tls, metrics, write_timeout, tls.clone(), shutdown_rx.clone()));
            Some(amqp)
        }
        None => None,
    };
    let rate_sampler = tokio::spawn(crate::http::rates::run(http.rates.clone(), broker.clone(), shutdown_rx.clone()));

    let housekeeping = {
        let broker = broker.clone();
        let mut shutdown = shutdown_rx.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(HOUSEKEEPING_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut stats = StoreActivity::new(broker.store().stats());
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        broker.tick();
                        stats.maybe_log(broker.store().stats());
                    }
                    _ = shutdown.changed() => return,
                }
            }
        })
    };

    let mut connections = tokio::task::JoinSet::new();
    let mut refused_handshakes = crate::login_guard::RefusedHandshakes::default();
    use crate::login_guard::NoSlot;
    let signal = stop_signals.received();
    tokio::pin!(signal);
    let removed = async {
        match &cluster {
            Some(node) => crate::cluster::removed_from_cluster(node.clone(), quorum_groups.clone()).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(removed);
    let mut removed_from_cluster = false;
    loop {
        let amqps_accept = async {
            match &amqps_listener {
                Some(l) => l.accept().await.map(|(stream, peer)| (stream, peer, Transport::Tls)),
                None => std::future::pending().await,
            }
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted.map(|(stream, peer)| (stream, peer, Transport::Plain)),
            accepted = amqps_accept => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            _ = &mut signal => break,
            _ = &mut removed => {
                removed_from_cluster = true;
                break;
            }
        };
        match accepted {
            Ok((stream, peer, transport)) => match ctx.handshakes.take(peer.ip()) {
                Ok(handshake) => {
                    connections.spawn(connection::serve(stream, transport, peer, ctx.clone(), handshake));
                }
                // Past its source's share: it waits, unread, for one of its source's slots.
                Err(NoSlot::Source(_)) => match ctx.handshakes.wait_place() {
                    Ok(place) => {
                        let ctx = ctx.clone();
                        connections.spawn(async move {
                            let deadline = tokio::time::Instant::now() + Duration::from_secs(ctx.config.handshake_timeout as u64);
                            if let Some(handshake) = ctx.handshakes.wait_for(peer.ip(), deadline, place).await {
                                connection::serve(stream, transport, peer, ctx, handshake).await;
                            }
                        });
                    }
                    Err(full) => refused_handshakes.note(peer, full),
                },
                // Closed at once: a source holding silent handshakes must not lock the others out.
                Err(full) => refused_handshakes.note(peer, full),
            },
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    tracing::info!("shutting down: closing connections");
    drop(listener);
    drop(amqps_listener);
    let _ = shutdown_tx.send(true);
    registry.shut_down();
    let _ = tokio::time::timeout(Duration::from_secs(6), async {
        while http_servers.join_next().await.is_some() {}
        let _ = rate_sampler.await;
    })
    .await;
    let drained = tokio::time::timeout(Duration::from_secs(10), async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("some connections did not close within 10 s");
    }
    housekeeping.abort();
    alarm_monitor.abort();
    reloader.abort();
    quorum_groups.shutdown().await;
    if let Some(node) = &cluster {
        node.shutdown().await;
    }
    broker.close();
    tracing::info!("stopped");
    match (removed_from_cluster, config.cluster()) {
        (true, Some(settings)) => Err(format!(
            "node {id} was removed from the cluster (`warren ctl remove-node {id}`): no member replicates to it, so its \
             topology and queues here are stale, and it stopped. To bring it back, delete its data directory ({dir}), start \
             it, and run `warren ctl add-node {id} {addr}` on a member",
            id = settings.node_id,
            dir = config.data_dir.display(),
            addr = settings.peers.iter().find(|(id, _)| *id == settings.node_id).map_or_else(|| settings.listen.to_string(), |(_, addr)| addr.clone()),
        )
        .into()),
        _ => Ok(()),
    }
}

/// On SIGHUP, re-reads the configuration and applies what can change while running: the alarm limits
/// and, derived from the memory limit, the quorum replicas' budget for bodies.
async fn reload_on_sighup(
    mut hup: Signal,
    reload: Reload,
    limits: Arc<parking_lot::Mutex<Limits>>,
    quorum_bodies: Arc<NodeBodies>,
    tls: Option<Arc<crate::tls::Tls>>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = hup.recv() => {}
            _ = shutdown.changed() => return,
        }
        match reload() {
            Ok(config) => {
                let new = Limits::from_config(&config);
                quorum_bodies.set_limit(quorum_body_bytes(&new));
                tracing::info!(memory_limit = new.memory_bytes, disk_free_limit = new.disk_free_bytes,
                    quorum_body_limit = quorum_bodies.limit(),
                    "configuration reloaded (SIGHUP): alarm limits applied; other changes but the TLS files need a restart");
                *limits.lock() = new;
                // New connections take the new certificate; open ones keep theirs. A listener
                // opens or closes only with a restart.
                match (&tls, config.tls()) {
                    (Some(tls), Some(settings)) => match tls.reload(&settings) {
                        Ok(()) => tracing::info!(certificate = %settings.cert.display(), not_after = tls.not_after(), "TLS certificate reloaded (SIGHUP)"),
                        Err(e) => tracing::error!("TLS reload (SIGHUP) failed, keeping the current certificate: {e}"),
                    },
                    (None, Some(_)) => tracing::warn!("tls-cert is now set: the TLS listeners open at the next restart"),
                    (Some(_), None) => tracing::warn!("tls-cert is no longer set: the TLS listeners keep the current certificate until a restart"),
                    (None, None) => {}
                }
            }
            Err(e) => tracing::error!("configuration reload (SIGHUP) failed, keeping the current one: {e}"),
        }
    }
}

/// The memory this node's quorum replicas may hold message bodies in, together: a quarter of the
/// memory alarm's limit, so that held bodies alone never raise it (`warren_broker::queue::body_memory`).
/// Past it, bodies are only in the store and are read back to be delivered. Test-only:
/// `WARREN_TEST_BODY_BUDGET_BYTES` (tests of reading back want a small budget).
fn quorum_body_bytes(limits: &Limits) -> u64 {
    warren_store::test_hooks::var("WARREN_TEST_BODY_BUDGET_BYTES").and_then(|v| v.parse().ok()).unwrap_or(limits.memory_bytes / 4)
}

/// SIGTERM and SIGINT, which stop the server cleanly.
struct ShutdownSignals {
    term: Signal,
    int: Signal,
}

impl ShutdownSignals {
    fn install() -> std::io::Result<Self> {
        Ok(ShutdownSignals { term: signal(SignalKind::terminate())?, int: signal(SignalKind::interrupt())? })
    }

    /// Completes when either signal has come (also one that came before this was first polled).
    async fn received(mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}
