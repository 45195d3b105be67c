//! The management API's message rates. Every [`SAMPLE_EVERY`] (RabbitMQ's default
//! `collect_statistics_interval`) a task samples the node's message counters and queue totals,
//! keeping [`KEPT`] samples (10 minutes) for `/api/overview`'s rates and chart samples, and each
//! queue's counters (`QueueStats::sample`) for its `message_stats`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tokio::sync::watch;
use warren_broker::stats::{self, Counter, QueueStats};
use warren_broker::Broker;

pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// 10 minutes of samples: the UI's longest chart, and RabbitMQ's `basic` retention of 600 s.
const KEPT: usize = 120;

/// The node-wide series, in the order of [`Sample::values`]: message counters, then queue totals.
const COUNTERS: [&str; 9] = ["publish", "deliver", "deliver_no_ack", "get", "get_no_ack", "deliver_get", "redeliver", "ack", "drop_unroutable"];
const LENGTHS: [&str; 3] = ["messages", "messages_ready", "messages_unacknowledged"];

#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    /// Milliseconds since the Unix epoch, as RabbitMQ's samples carry.
    timestamp_ms: u64,
    counters: [u64; COUNTERS.len()],
    lengths: [u64; LENGTHS.len()],
}

/// The node's recent samples, newest last.
#[derive(Default)]
pub struct Rates {
    samples: parking_lot::Mutex<VecDeque<Sample>>,
}

impl Rates {
    /// Samples the node's counters, its queues' totals and each queue's counters.
    pub fn sample(&self, broker: &Broker) {
        let now = Instant::now();
        let (mut ready, mut unacked) = (0u64, 0u64);
        for v in broker.vhosts() {
            for q in v.queues() {
                ready += q.message_count() as u64;
                unacked += q.unacked_count();
                q.stats.sample(now);
            }
        }
        let get = stats::get;
        let (deliver, deliver_no_ack) = (get(Counter::DeliveredConsumeManualAck), get(Counter::DeliveredConsumeAutoAck));
        let (get_ack, get_no_ack) = (get(Counter::DeliveredGetManualAck), get(Counter::DeliveredGetAutoAck));
        let sample = Sample {
            at: now,
            timestamp_ms: warren_broker::now_ms(),
            counters: [
                stats::received(),
                deliver,
                deliver_no_ack,
                get_ack,
                get_no_ack,
                deliver + deliver_no_ack + get_ack + get_no_ack,
                get(Counter::Redelivered),
                get(Counter::Acknowledged),
                get(Counter::Unroutable),
            ],
            lengths: [ready + unacked, ready, unacked],
        };
        let mut samples = self.samples.lock();
        if samples.len() == KEPT {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// `/api/overview`'s `message_stats` (totals, and their `_details`).
    pub fn message_stats(&self, window: Option<Window>) -> Value {
        let samples = self.samples.lock();
        let mut out = Map::new();
        for (i, name) in COUNTERS.iter().enumerate() {
            let Some(last) = samples.back() else { break };
            out.insert((*name).to_owned(), last.counters[i].into());
            out.insert(format!("{name}_details"), details(&samples, |s| s.counters[i], window));
        }
        Value::Object(out)
    }

    /// The `_details` of the queue totals: `messages`, `messages_ready`, `messages_unacknowledged`.
    pub fn length_details(&self, window: Option<Window>) -> [Value; LENGTHS.len()] {
        let samples = self.samples.lock();
        std::array::from_fn(|i| details(&samples, |s| s.lengths[i], window))
    }
}

/// Which samples an answer carries: RabbitMQ's `msg_rates_age`/`msg_rates_incr` (counters) and
/// `lengths_age`/`lengths_incr` (queue totals), in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub age: Duration,
    pub every: Duration,
}

impl Window {
    /// The window a query asks for with `{prefix}_age` and `{prefix}_incr`; none without them, or
    /// with values that are not positive whole seconds.
    pub fn from_query(query: &std::collections::HashMap<String, String>, prefix: &str) -> Option<Window> {
        let secs = |key: String| query.get(&key).and_then(|v| v.parse::<u64>().ok()).filter(|s| *s > 0);
        let age = secs(format!("{prefix}_age"))?;
        let every = secs(format!("{prefix}_incr"))?;
        Some(Window { age: Duration::from_secs(age.min(86_400)), every: Duration::from_secs(every) })
    }
}

/// `{"rate": r}` with the change per second between the last two samples; with a window, also
/// `samples` (newest first, as RabbitMQ orders them), `avg` and `avg_rate` over it.
fn details(samples: &VecDeque<Sample>, value: impl Fn(&Sample) -> u64, window: Option<Window>) -> Value {
    let rate_between = |old: &Sample, new: &Sample| {
        let secs = new.at.saturating_duration_since(old.at).as_secs_f64();
        if secs > 0.0 {
            (value(new) as f64 - value(old) as f64) / secs
        } else {
            0.0
        }
    };
    let n = samples.len();
    let rate = if n >= 2 { rate_between(&samples[n - 2], &samples[n - 1]) } else { 0.0 };
    let mut out = json!({ "rate": rate });
    if let (Some(window), Some(newest)) = (window, samples.back()) {
        let stride = (window.every.as_secs() / SAMPLE_EVERY.as_secs()).max(1) as usize;
        let chosen: Vec<&Sample> =
            samples.iter().rev().filter(|s| newest.at.saturating_duration_since(s.at) <= window.age).step_by(stride).collect();
        let listed: Vec<Value> = chosen.iter().map(|s| json!({"sample": value(s), "timestamp": s.timestamp_ms})).collect();
        let avg = if chosen.is_empty() { 0.0 } else { chosen.iter().map(|s| value(s) as f64).sum::<f64>() / chosen.len() as f64 };
        let avg_rate = match (chosen.first(), chosen.last()) {
            (Some(new), Some(old)) if chosen.len() >= 2 => rate_between(old, new),
            _ => 0.0,
        };
        out["samples"] = listed.into();
        out["avg"] = avg.into();
        out["avg_rate"] = avg_rate.into();
    }
    out
}

/// A queue's `message_stats` (RabbitMQ's names), from its counters and last sampled rates.
pub fn queue_message_stats(stats: &QueueStats) -> Value {
    let counts = stats.counts();
    let rates = stats.rates();
    json!({
        "publish": counts.published, "publish_details": {"rate": rates.published},
        "deliver_get": counts.delivered, "deliver_get_details": {"rate": rates.delivered},
        "redeliver": counts.redelivered, "redeliver_details": {"rate": rates.redelivered},
        "ack": counts.acked, "ack_details": {"rate": rates.acked},
    })
}

/// Samples every [`SAMPLE_EVERY`] until `shutdown`.
pub async fn run(rates: Arc<Rates>, broker: Arc<Broker>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => rates.sample(&broker),
            _ = shutdown.changed() => return,
        }
    }
}
