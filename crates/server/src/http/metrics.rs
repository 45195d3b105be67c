//! Prometheus metrics on `--prometheus-port`, with rabbitmq_prometheus's names, labels and
//! endpoints, so RabbitMQ's Grafana dashboards (RabbitMQ-Overview, Quorum-Queues-Raft) read Warren:
//!
//! - `/metrics`: aggregated, one sample per metric for the node (queues summed), as
//!   rabbitmq_prometheus serves by default;
//! - `/metrics/per-object`: one sample per queue (labels `vhost`, `queue`) and per Raft group;
//! - `/metrics/detailed?family=F&vhost=V`: the `rabbitmq_detailed_` families asked for.
//!
//! Plus Warren's own (`warren_*`): the store's fsyncs, records, bytes and lost messages.
//! Written by hand in the text format (0.0.4): a scrape of 10,000 queues is one pass over them,
//! with no registry to keep in step with queues coming and going.

use std::fmt::Write;
use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use warren_broker::stats::{self, Counter};

use super::HttpContext;

pub fn router(ctx: Arc<HttpContext>) -> Router {
    Router::new()
        .route("/metrics", get(aggregated))
        .route("/metrics/per-object", get(per_object))
        .route("/metrics/detailed", get(detailed))
        .with_state(ctx)
}

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn aggregated(State(ctx): State<Arc<HttpContext>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], render(&ctx, Scope::Aggregated))
}

async fn per_object(State(ctx): State<Arc<HttpContext>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], render(&ctx, Scope::PerObject))
}

async fn detailed(State(ctx): State<Arc<HttpContext>>, RawQuery(query): RawQuery) -> impl IntoResponse {
    let (mut families, mut vhosts) = (Vec::new(), Vec::new());
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match &*k {
            "family" => families.push(v.into_owned()),
            "vhost" => vhosts.push(v.into_owned()),
            _ => {}
        }
    }
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], render_detailed(&ctx, &families, &vhosts))
}

#[derive(Clone, Copy, PartialEq)]
enum Scope {
    Aggregated,
    PerObject,
}

/// Writes one metric family: `# HELP`, `# TYPE` and its samples.
struct Out {
    text: String,
}

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# TYPE {name} {kind}\n# HELP {name} {help}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"");
                escape_label(&mut self.text, v);
                self.text.push('"');
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
    }

    /// A family with one unlabelled sample.
    fn single(&mut self, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

/// The text format's label escapes: backslash, double quote and newline.
fn escape_label(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// One queue's numbers, read once per scrape.
struct QueueSample {
    vhost: String,
    name: String,
    id: u64,
    ready: u64,
    unacked: u64,
    consumers: u64,
    /// Consumed messages kept for the queue's retention (`x-retention-seconds`).
    retained: u64,
    /// Delayed messages held for it (`x-delayed-message` exchanges).
    delayed: u64,
}

/// Every queue's numbers; `named`: with their names, sorted (per-object output), else without
/// (aggregated output only sums them: no allocation per queue).
fn queue_samples(ctx: &HttpContext, vhosts: &[String], named: bool) -> Vec<QueueSample> {
    let mut out = Vec::new();
    for v in ctx.broker.vhosts() {
        if !vhosts.is_empty() && !vhosts.contains(&v.name) {
            continue;
        }
        for q in v.queues() {
            if q.is_deleted() {
                continue;
            }
            out.push(QueueSample {
                vhost: if named { v.name.clone() } else { String::new() },
                name: if named { q.name.clone() } else { String::new() },
                id: q.id,
                ready: q.message_count() as u64,
                unacked: q.unacked_count(),
                consumers: q.consumer_count() as u64,
                retained: q.retention_stats().consumed,
                delayed: v.delayed_count(&q),
            });
        }
    }
    if named {
        out.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
    }
    out
}

fn render(ctx: &HttpContext, scope: Scope) -> String {
    let mut out = Out { text: String::with_capacity(16 << 10) };
    let queues = queue_samples(ctx, &[], scope == Scope::PerObject);
    let connections = ctx.connections.list();
    let channels: usize = connections.iter().map(|c| c.channels.lock().len()).sum();

    out.family("rabbitmq_identity_info", "untyped", "RabbitMQ node & cluster identity info");
    out.sample("rabbitmq_identity_info", &[("rabbitmq_node", &ctx.node_name), ("rabbitmq_cluster", &ctx.node_name), ("rabbitmq_cluster_permanent_id", &ctx.node_name)], 1);
    out.family("rabbitmq_build_info", "untyped", "RabbitMQ & Erlang/OTP version info");
    out.sample(
        "rabbitmq_build_info",
        &[("rabbitmq_version", super::mgmt::RABBITMQ_VERSION), ("prometheus_plugin_version", super::mgmt::RABBITMQ_VERSION), ("prometheus_client_version", "4.9.1"), ("erlang_version", "none"), ("warren_version", env!("CARGO_PKG_VERSION"))],
        1,
    );

    out.single("rabbitmq_connections", "gauge", "Connections currently open", connections.len());
    out.single("rabbitmq_channels", "gauge", "Channels currently open", channels);
    out.single("rabbitmq_queues", "gauge", "Queues available", queues.len());
    out.single("rabbitmq_consumers", "gauge", "Consumers currently connected", queues.iter().map(|q| q.consumers).sum::<u64>());

    let queue_families: [(&str, &str, fn(&QueueSample) -> u64); 6] = [
        ("rabbitmq_queue_messages_ready", "Messages ready to be delivered to consumers", |q| q.ready),
        ("rabbitmq_queue_messages_unacked", "Messages delivered to consumers but not yet acknowledged", |q| q.unacked),
        ("rabbitmq_queue_messages", "Sum of ready and unacknowledged messages - total queue depth", |q| q.ready + q.unacked),
        ("rabbitmq_queue_consumers", "Consumers on a queue", |q| q.consumers),
        ("warren_queue_messages_retained", "Consumed messages kept on disk for the queue's retention (x-retention-seconds)", |q| q.retained),
        ("warren_queue_messages_delayed", "Messages a delayed exchange holds for the queue until due (x-delay)", |q| q.delayed),
    ];
    for (name, help, value) in queue_families {
        out.family(name, "gauge", help);
        match scope {
            Scope::Aggregated => out.sample(name, &[], queues.iter().map(value).sum::<u64>()),
            Scope::PerObject => {
                for q in &queues {
                    out.sample(name, &[("vhost", &q.vhost), ("queue", &q.name)], value(q));
                }
            }
        }
    }

    let get = stats::get;
    let delivered = get(Counter::DeliveredConsumeManualAck) + get(Counter::DeliveredConsumeAutoAck) + get(Counter::DeliveredGetManualAck) + get(Counter::DeliveredGetAutoAck);
    for (name, help, value) in [
        ("rabbitmq_global_messages_received_total", "Total number of messages received from publishers", stats::received()),
        ("rabbitmq_global_messages_routed_total", "Total number of messages routed to queues or streams", get(Counter::Routed)),
        ("rabbitmq_global_messages_unroutable_dropped_total", "Total number of messages published as non-mandatory into an exchange and dropped as unroutable", get(Counter::Unroutable)),
        ("rabbitmq_global_messages_delivered_total", "Total number of messages delivered to consumers", delivered),
        ("rabbitmq_global_messages_delivered_consume_manual_ack_total", "Total number of messages delivered to consumers using basic.consume with manual acknowledgment", get(Counter::DeliveredConsumeManualAck)),
        ("rabbitmq_global_messages_delivered_consume_auto_ack_total", "Total number of messages delivered to consumers using basic.consume with automatic acknowledgment", get(Counter::DeliveredConsumeAutoAck)),
        ("rabbitmq_global_messages_delivered_get_manual_ack_total", "Total number of messages delivered to consumers using basic.get with manual acknowledgment", get(Counter::DeliveredGetManualAck)),
        ("rabbitmq_global_messages_delivered_get_auto_ack_total", "Total number of messages delivered to consumers using basic.get with automatic acknowledgment", get(Counter::DeliveredGetAutoAck)),
        ("rabbitmq_global_messages_redelivered_total", "Total number of messages redelivered to consumers", get(Counter::Redelivered)),
        ("rabbitmq_global_messages_acknowledged_total", "Total number of messages acknowledged by consumers", get(Counter::Acknowledged)),
    ] {
        out.single(name, "counter", help, value);
    }

    let limits = *ctx.limits.lock();
    let alarms = *ctx.alarms.borrow();
    out.single("rabbitmq_process_resident_memory_bytes", "gauge", "Memory used in bytes", crate::alarms::resident_memory().unwrap_or(0));
    out.single("rabbitmq_resident_memory_limit_bytes", "gauge", "Memory high watermark in bytes", limits.memory_bytes);
    out.single("rabbitmq_disk_space_available_bytes", "gauge", "Disk space available in bytes", crate::alarms::free_disk(&ctx.config.data_dir).unwrap_or(0));
    out.single("rabbitmq_disk_space_available_limit_bytes", "gauge", "Free disk space low watermark in bytes", limits.disk_free_bytes);
    out.single("rabbitmq_alarms_memory_used_watermark", "gauge", "is 1 if VM memory watermark alarm is in effect", alarms.memory as u8);
    out.single("rabbitmq_alarms_free_disk_space_watermark", "gauge", "is 1 if free disk space watermark alarm is in effect", alarms.disk as u8);
    out.single("rabbitmq_alarms_file_descriptor_limit", "gauge", "is 1 if file descriptor limit alarm is in effect", 0);
    out.single("rabbitmq_process_open_fds", "gauge", "Open file descriptors", ctx.open_files());
    out.single("rabbitmq_erlang_uptime_seconds", "gauge", "Node uptime", ctx.started.elapsed().as_secs_f64());

    raft_metrics(ctx, &queues, scope, &mut out);

    let s = ctx.broker.store().stats();
    out.single("warren_store_records_total", "counter", "Records appended to the write-ahead log", s.records);
    out.single("warren_store_batches_total", "counter", "Group commits (batches) written", s.batches);
    out.single("warren_store_fsyncs_total", "counter", "fsyncs of the write-ahead log", s.fsyncs);
    out.single("warren_store_written_bytes_total", "counter", "Bytes written to the write-ahead log", s.bytes_written);
    out.single("warren_store_wal_bytes", "gauge", "Bytes of write-ahead log on disk", s.wal_bytes);
    out.single("warren_store_queue_files_bytes", "gauge", "Bytes of per-queue files on disk", s.queue_bytes);
    out.single("warren_store_checkpoints_total", "counter", "Store checkpoints taken", s.checkpoints);
    out.single("warren_store_lost_messages_total", "counter", "Messages found lost at recovery (store files missing or cut short)", s.lost_messages);
    if let Some(tls) = &ctx.tls {
        out.single("warren_tls_certificate_expiry_timestamp_seconds", "gauge", "When the TLS listeners' certificate expires (notAfter, unix seconds)", tls.not_after());
    }
    out.text
}

/// The Raft groups this node is a member of (clustered): rabbitmq_prometheus's `rabbitmq_raft_*`
/// per quorum queue (summed when aggregated), and the metadata group's as Warren's own.
fn raft_metrics(ctx: &HttpContext, queues: &[QueueSample], scope: Scope, out: &mut Out) {
    let Some(cluster) = &ctx.cluster else { return };
    let status = cluster.local_status();
    let by_id: std::collections::HashMap<u64, &QueueSample> = queues.iter().map(|q| (q.id, q)).collect();
    let families: [(&str, &str, fn(&warren_cluster::node::GroupStatus) -> u64); 4] = [
        ("rabbitmq_raft_term_total", "Current Raft term number", |g| g.term),
        ("rabbitmq_raft_log_commit_index", "Raft log commit index", |g| g.committed.unwrap_or(0)),
        ("rabbitmq_raft_log_last_applied_index", "Raft log last applied index", |g| g.applied.unwrap_or(0)),
        ("rabbitmq_raft_log_last_written_index", "Raft log last written index", |g| g.last_log_index.unwrap_or(0)),
    ];
    for (name, help, value) in families {
        out.family(name, if name.ends_with("_total") { "counter" } else { "gauge" }, help);
        match scope {
            Scope::Aggregated => out.sample(name, &[], status.groups.iter().filter(|g| by_id.contains_key(&g.group)).map(value).sum::<u64>()),
            Scope::PerObject => {
                for g in &status.groups {
                    if let Some(q) = by_id.get(&g.group) {
                        out.sample(name, &[("vhost", &q.vhost), ("queue", &q.name)], value(g));
                    }
                }
            }
        }
    }
    out.family("warren_raft_apply_lag", "gauge", "Entries written to a group's log on this node and not applied yet");
    out.family("warren_raft_is_leader", "gauge", "1 where this node leads the group");
    let group_label = |g: u64| by_id.get(&g).map_or_else(|| (String::new(), format!("group-{g}")), |q| (q.vhost.clone(), q.name.clone()));
    match scope {
        Scope::Aggregated => {
            let lag: u64 = status.groups.iter().map(|g| g.last_log_index.unwrap_or(0).saturating_sub(g.applied.unwrap_or(0))).sum();
            out.sample("warren_raft_apply_lag", &[], lag);
            out.sample("warren_raft_is_leader", &[], status.groups.iter().filter(|g| g.state == "leader").count());
        }
        Scope::PerObject => {
            for g in &status.groups {
                let (vhost, queue) = group_label(g.group);
                let lag = g.last_log_index.unwrap_or(0).saturating_sub(g.applied.unwrap_or(0));
                out.sample("warren_raft_apply_lag", &[("vhost", &vhost), ("queue", &queue)], lag);
                out.sample("warren_raft_is_leader", &[("vhost", &vhost), ("queue", &queue)], (g.state == "leader") as u8);
            }
        }
    }
}

/// `/metrics/detailed`: the families asked for, per object, prefixed `rabbitmq_detailed_`.
fn render_detailed(ctx: &HttpContext, families: &[String], vhosts: &[String]) -> String {
    let mut out = Out { text: String::new() };
    let queues = queue_samples(ctx, vhosts, true);
    for family in families {
        match family.as_str() {
            "queue_coarse_metrics" => {
                let metrics: [(&str, &str, fn(&QueueSample) -> u64); 3] = [
                    ("rabbitmq_detailed_queue_messages_ready", "Messages ready to be delivered to consumers", |q| q.ready),
                    ("rabbitmq_detailed_queue_messages_unacked", "Messages delivered to consumers but not yet acknowledged", |q| q.unacked),
                    ("rabbitmq_detailed_queue_messages", "Sum of ready and unacknowledged messages - total queue depth", |q| q.ready + q.unacked),
                ];
                for (name, help, value) in metrics {
                    out.family(name, "gauge", help);
                    for q in &queues {
                        out.sample(name, &[("vhost", &q.vhost), ("queue", &q.name)], value(q));
                    }
                }
            }
            "queue_consumer_count" => {
                out.family("rabbitmq_detailed_queue_consumers", "gauge", "Consumers on a queue");
                for q in &queues {
                    out.sample("rabbitmq_detailed_queue_consumers", &[("vhost", &q.vhost), ("queue", &q.name)], q.consumers);
                }
            }
            _ => {}
        }
    }
    out.text
}
