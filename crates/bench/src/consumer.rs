//! A consumer: one connection consuming from its queues, measuring end-to-end latency from the
//! timestamp in each body, acking with `multiple` every N messages.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use warren_protocol::field::FieldTable;
use warren_protocol::frame::Frame;
use warren_protocol::method::*;

use crate::client::{self, Error, Uri};
use crate::stats::{now_ns, Stats};

pub struct ConsumerConfig {
    pub uri: Uri,
    pub id: usize,
    pub queues: Vec<String>,
    pub prefetch: u16,
    pub multi_ack_every: u64,
    pub auto_ack: bool,
    /// Messages to consume; 0: until `stop`.
    pub messages: u64,
    pub stop: tokio::sync::watch::Receiver<bool>,
}

pub async fn run(cfg: ConsumerConfig, stats: Arc<Stats>) -> Result<(), Error> {
    let (mut reader, mut writer) = client::connect(&cfg.uri, &format!("warren-bench consumer {}", cfg.id)).await?;
    if cfg.prefetch > 0 {
        client::call(&mut reader, &mut writer, Method::BasicQos(BasicQos { prefetch_size: 0, prefetch_count: cfg.prefetch, global: false })).await?;
    }
    for q in &cfg.queues {
        let m = Method::BasicConsume(BasicConsume {
            reserved_1: 0,
            queue: q.clone(),
            consumer_tag: String::new(),
            no_local: false,
            no_ack: cfg.auto_ack,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::new(),
        });
        writer.method(1, &m);
    }
    writer.flush().await?;
    let mut consumed: u64 = 0;
    let mut unacked: u64 = 0;
    let mut last_tag: u64 = 0;
    let mut body_left: u64 = 0;
    let mut first_chunk = false;
    let mut pending_lat: Vec<u64> = Vec::with_capacity(1024);
    loop {
        if cfg.messages > 0 && consumed >= cfg.messages {
            break;
        }
        if *cfg.stop.borrow() {
            break;
        }
        let mut stop = cfg.stop.clone();
        let frame = tokio::select! {
            f = reader.next() => f?,
            _ = stop.changed() => break,
        };
        let mut done = false;
        match frame {
            Frame::Method { method: Method::BasicDeliver(d), .. } => {
                last_tag = d.delivery_tag;
            }
            Frame::Method { method: Method::BasicCancel(_), .. } => break,
            Frame::Method { .. } | Frame::Heartbeat { .. } => {}
            Frame::Header { header, .. } => {
                body_left = header.body_size;
                first_chunk = true;
                done = body_left == 0;
            }
            Frame::Body { payload, .. } => {
                if first_chunk && payload.len() >= 8 {
                    let mut ts = [0u8; 8];
                    ts.copy_from_slice(&payload[..8]);
                    pending_lat.push(now_ns().saturating_sub(u64::from_le_bytes(ts)) / 1000);
                }
                first_chunk = false;
                body_left = body_left.saturating_sub(payload.len() as u64);
                done = body_left == 0;
            }
        }
        if done {
            consumed += 1;
            stats.counters.consumed.fetch_add(1, Ordering::Relaxed);
            if !cfg.auto_ack {
                unacked += 1;
                if unacked >= cfg.multi_ack_every.max(1) {
                    writer.method(1, &Method::BasicAck(BasicAck { delivery_tag: last_tag, multiple: true }));
                    unacked = 0;
                }
            }
            if pending_lat.len() >= 64 {
                flush_latencies(&stats, &mut pending_lat);
            }
            if !writer.buf.is_empty() {
                writer.flush().await?;
            }
        }
    }
    flush_latencies(&stats, &mut pending_lat);
    if unacked > 0 {
        writer.method(1, &Method::BasicAck(BasicAck { delivery_tag: last_tag, multiple: true }));
    }
    writer.method(0, &Method::ConnectionClose(ConnectionClose { reply_code: 200, reply_text: "bye".into(), class_id: 0, method_id: 0 }));
    let _ = writer.flush().await;
    Ok(())
}

/// Latencies are recorded in small batches, to keep the histogram lock off the per-message path.
fn flush_latencies(stats: &Stats, pending: &mut Vec<u64>) {
    if pending.is_empty() {
        return;
    }
    let mut h = stats.e2e.lock();
    for l in pending.drain(..) {
        h.record(l);
    }
}
