//! `warren bench`: an AMQP 0-9-1 load generator in the spirit of RabbitMQ's PerfTest, for Warren or
//! RabbitMQ alike. Producers and consumers are connections of their own, run on a small tokio
//! runtime; messages carry a send timestamp, so end-to-end latency is measured, and publisher-confirm
//! latency too, both into HDR histograms. See docs/bench.md.

mod client;
mod consumer;
mod producer;
mod stats;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use warren_protocol::field::{FieldTable, FieldValue};
use warren_protocol::method::*;

use client::Uri;
use stats::{cpu_seconds, Stats};

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Broker to load, e.g. amqp://guest:guest@127.0.0.1:5672/%2F.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2F")]
    pub uri: String,
    #[arg(long, default_value_t = 1)]
    pub producers: usize,
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Message body size in bytes (at least 16: a timestamp and a sequence number lead the body).
    #[arg(long, default_value_t = 1000)]
    pub size: usize,
    /// Publish persistent messages (delivery-mode 2).
    #[arg(long)]
    pub persistent: bool,
    /// Publisher confirms with at most N unconfirmed messages per producer (0: no confirms).
    #[arg(long, default_value_t = 0)]
    pub confirm: u32,
    /// basic.qos prefetch per consumer (0: unlimited).
    #[arg(long, default_value_t = 0)]
    pub prefetch: u16,
    /// Ack with multiple=true every N messages.
    #[arg(long, default_value_t = 1)]
    pub multi_ack_every: u64,
    /// Consume with no-ack.
    #[arg(long)]
    pub auto_ack: bool,
    /// Messages per second per producer (0: unlimited).
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Run for this many seconds.
    #[arg(long)]
    pub time: Option<f64>,
    /// Messages per producer; the run ends once they are all confirmed and consumed.
    #[arg(long)]
    pub pmessages: Option<u64>,
    /// Messages per consumer (consume-only runs).
    #[arg(long)]
    pub cmessages: Option<u64>,
    #[arg(long, default_value = "warren-bench")]
    pub queue: String,
    /// Spread over N queues named QUEUE-0 .. QUEUE-(N-1): each producer publishes to all of them in turn,
    /// consumers share them out.
    #[arg(long, default_value_t = 1)]
    pub queues: usize,
    /// Publish to this exchange (declared with --exchange-type, each queue bound to it with its name as
    /// the routing key) instead of the default exchange.
    #[arg(long, default_value = "")]
    pub exchange: String,
    #[arg(long, default_value = "direct")]
    pub exchange_type: String,
    #[arg(long, default_value = "classic")]
    pub queue_type: String,
    /// Extra queue arguments, k=v,... (integers become longs).
    #[arg(long, default_value = "")]
    pub queue_args: String,
    /// Do not declare anything (queues exist already).
    #[arg(long)]
    pub predeclared: bool,
    /// Write the summary as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Seconds between progress lines (0: none).
    #[arg(long, default_value_t = 1.0)]
    pub progress_every: f64,
}

/// Runs the benchmark; the exit code says whether it completed as asked.
pub fn run(args: BenchArgs) -> std::process::ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("warren bench: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(bench(args)) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(3),
        Err(e) => {
            eprintln!("warren bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn queue_names(args: &BenchArgs) -> Vec<String> {
    if args.queues <= 1 {
        vec![args.queue.clone()]
    } else {
        (0..args.queues).map(|i| format!("{}-{i}", args.queue)).collect()
    }
}

fn queue_arguments(args: &BenchArgs) -> Result<FieldTable, client::Error> {
    let mut t = FieldTable::new();
    if args.queue_type != "classic" {
        t.insert("x-queue-type".into(), FieldValue::LongString(args.queue_type.clone().into()));
    }
    for kv in args.queue_args.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| format!("--queue-args: expected k=v, got {kv}"))?;
        let value = match v.parse::<i64>() {
            Ok(n) => FieldValue::I64(n),
            Err(_) => FieldValue::LongString(v.to_string().into()),
        };
        t.insert(k.to_string(), value);
    }
    Ok(t)
}

async fn setup(uri: &Uri, args: &BenchArgs, queues: &[String]) -> Result<(), client::Error> {
    let (mut r, mut w) = client::connect(uri, "warren-bench setup").await?;
    let arguments = queue_arguments(args)?;
    if !args.exchange.is_empty() {
        let m = Method::ExchangeDeclare(ExchangeDeclare { exchange: args.exchange.clone(), kind: args.exchange_type.clone(), durable: true, ..Default::default() });
        client::call(&mut r, &mut w, m).await?;
    }
    for q in queues {
        let m = Method::QueueDeclare(QueueDeclare { queue: q.clone(), durable: true, arguments: arguments.clone(), ..Default::default() });
        client::call(&mut r, &mut w, m).await?;
        if !args.exchange.is_empty() {
            let m = Method::QueueBind(QueueBind { queue: q.clone(), exchange: args.exchange.clone(), routing_key: q.clone(), ..Default::default() });
            client::call(&mut r, &mut w, m).await?;
        }
    }
    w.method(0, &Method::ConnectionClose(ConnectionClose { reply_code: 200, reply_text: "bye".into(), class_id: 0, method_id: 0 }));
    w.flush().await?;
    Ok(())
}

async fn bench(args: BenchArgs) -> Result<bool, client::Error> {
    if args.size < 16 && (args.producers > 0) {
        return Err("--size must be at least 16 (timestamp and sequence number)".into());
    }
    let uri = Uri::parse(&args.uri)?;
    let queues = queue_names(&args);
    if !args.predeclared {
        setup(&uri, &args, &queues).await?;
    }
    let stats = Arc::new(Stats::new());
    let stop_producers = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let cpu_start = cpu_seconds();
    let started = Instant::now();
    stats::epoch();

    let mut consumers = Vec::new();
    for id in 0..args.consumers {
        let mine: Vec<String> = if args.consumers >= queues.len() {
            vec![queues[id % queues.len()].clone()]
        } else {
            queues.iter().skip(id).step_by(args.consumers).cloned().collect()
        };
        let cfg = consumer::ConsumerConfig {
            uri: uri.clone(),
            id,
            queues: mine,
            prefetch: args.prefetch,
            multi_ack_every: args.multi_ack_every,
            auto_ack: args.auto_ack,
            messages: args.cmessages.unwrap_or(0),
            stop: stop_rx.clone(),
        };
        consumers.push(tokio::spawn(consumer::run(cfg, stats.clone())));
    }
    // With a fanout exchange each message reaches every queue; otherwise one.
    let copies = if args.exchange_type == "fanout" && !args.exchange.is_empty() { queues.len() as u64 } else { 1 };
    let routing_keys = Arc::new(queues.clone());
    let mut producers = Vec::new();
    for id in 0..args.producers {
        let cfg = producer::ProducerConfig {
            uri: uri.clone(),
            id,
            routing_keys: routing_keys.clone(),
            exchange: args.exchange.clone(),
            size: args.size,
            persistent: args.persistent,
            confirm: args.confirm,
            rate: args.rate,
            messages: args.pmessages.unwrap_or(0),
            stop: stop_producers.clone(),
        };
        producers.push(tokio::spawn(producer::run(cfg, stats.clone())));
    }

    let deadline = args.time.map(|t| started + Duration::from_secs_f64(t));
    let expected_consumed = match (args.pmessages, args.cmessages) {
        (_, Some(c)) => Some(c * args.consumers as u64),
        (Some(p), None) if args.consumers > 0 => Some(p * args.producers as u64 * copies),
        _ => None,
    };
    let mut last = (Instant::now(), stats.counters.get());
    let every = Duration::from_secs_f64(args.progress_every.max(0.1));
    let mut errors = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = Instant::now();
        if args.progress_every > 0.0 && now - last.0 >= every {
            progress(&stats, started, &mut last);
        }
        let producers_done = producers.iter().all(|p| p.is_finished());
        let consumers_done = consumers.iter().all(|c| c.is_finished());
        let consumed = stats.counters.consumed.load(Ordering::Relaxed);
        if deadline.is_some_and(|d| now >= d) {
            break;
        }
        if deadline.is_none() && producers_done && (args.consumers == 0 || consumers_done || expected_consumed.is_some_and(|e| consumed >= e)) {
            break;
        }
        if producers_done && consumers_done {
            break;
        }
        // Producers finished: give consumers up to 30 s to drain what was sent.
        if producers_done && args.producers > 0 && expected_consumed.is_some() && deadline.is_none() {
            static DRAIN_START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
            if now - *DRAIN_START.get_or_init(Instant::now) > Duration::from_secs(30) {
                break;
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    stop_producers.store(true, Ordering::Relaxed);
    for p in producers {
        match tokio::time::timeout(Duration::from_secs(70), p).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => errors.push(format!("producer: {e}")),
            Ok(Err(e)) => errors.push(format!("producer task: {e}")),
            Err(_) => errors.push("a producer did not finish".into()),
        }
    }
    let _ = stop_tx.send(true);
    for c in consumers {
        match tokio::time::timeout(Duration::from_secs(10), c).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => errors.push(format!("consumer: {e}")),
            Ok(Err(e)) => errors.push(format!("consumer task: {e}")),
            Err(_) => errors.push("a consumer did not finish".into()),
        }
    }
    let cpu = cpu_seconds() - cpu_start;
    let summary = Summary::new(&args, &stats, elapsed, cpu);
    summary.print();
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&summary.json())?)?;
    }
    for e in &errors {
        eprintln!("warren bench: error: {e}");
    }
    let mut ok = errors.is_empty();
    if let Some(p) = args.pmessages {
        let want = p * args.producers as u64;
        if summary.sent != want {
            eprintln!("warren bench: sent {} of {want} messages", summary.sent);
            ok = false;
        }
        if args.confirm > 0 && summary.confirmed + summary.nacked != want {
            eprintln!("warren bench: {} of {want} messages were confirmed ({} nacked)", summary.confirmed, summary.nacked);
            ok = false;
        }
    }
    if let Some(e) = expected_consumed {
        if args.consumers > 0 && summary.consumed < e {
            eprintln!("warren bench: consumed {} of {e} messages", summary.consumed);
            ok = false;
        }
    }
    Ok(ok)
}

fn progress(stats: &Stats, started: Instant, last: &mut (Instant, [u64; 5])) {
    let now = Instant::now();
    let c = stats.counters.get();
    let dt = (now - last.0).as_secs_f64().max(1e-9);
    let rate = |i: usize| (c[i] - last.1[i]) as f64 / dt;
    let (cp50, cp99) = {
        let mut h = stats.confirm.lock();
        let r = (h.interval.value_at_quantile(0.5), h.interval.value_at_quantile(0.99));
        h.interval.reset();
        r
    };
    let (ep50, ep99) = {
        let mut h = stats.e2e.lock();
        let r = (h.interval.value_at_quantile(0.5), h.interval.value_at_quantile(0.99));
        h.interval.reset();
        r
    };
    eprintln!(
        "{:6.1}s  sent {:>8.0}/s  confirmed {:>8.0}/s  consumed {:>8.0}/s  in flight {:>7}  confirm p50/p99 {}/{}  e2e p50/p99 {}/{}",
        started.elapsed().as_secs_f64(),
        rate(0),
        rate(1),
        rate(4),
        c[0].saturating_sub(c[1] + c[2]),
        fmt_us(cp50),
        fmt_us(cp99),
        fmt_us(ep50),
        fmt_us(ep99),
    );
    *last = (now, c);
}

fn fmt_us(us: u64) -> String {
    if us >= 10_000 {
        format!("{:.0}ms", us as f64 / 1000.0)
    } else if us >= 1000 {
        format!("{:.1}ms", us as f64 / 1000.0)
    } else {
        format!("{us}µs")
    }
}

struct Summary {
    elapsed: f64,
    sent: u64,
    confirmed: u64,
    nacked: u64,
    returned: u64,
    consumed: u64,
    size: usize,
    confirm: [u64; 6],
    e2e: [u64; 6],
    cpu: f64,
}

impl Summary {
    fn new(args: &BenchArgs, stats: &Stats, elapsed: f64, cpu: f64) -> Summary {
        let [sent, confirmed, nacked, returned, consumed] = stats.counters.get();
        let q = |h: &hdrhistogram::Histogram<u64>| {
            if h.is_empty() {
                return [0; 6];
            }
            [0.5, 0.95, 0.99, 0.999].map(|p| h.value_at_quantile(p)).into_iter().chain([h.max(), h.len()]).collect::<Vec<_>>().try_into().unwrap_or([0; 6])
        };
        let confirm = q(&stats.confirm.lock().total);
        let e2e = q(&stats.e2e.lock().total);
        Summary { elapsed, sent, confirmed, nacked, returned, consumed, size: args.size, confirm, e2e, cpu }
    }

    fn rate(&self, n: u64) -> f64 {
        n as f64 / self.elapsed.max(1e-9)
    }

    fn print(&self) {
        let mb = |n: u64| self.rate(n) * self.size as f64 / 1e6;
        println!("warren bench: {:.1} s", self.elapsed);
        println!("  sent      {:>10}  {:>9.0} msg/s  {:>7.1} MB/s", self.sent, self.rate(self.sent), mb(self.sent));
        println!("  confirmed {:>10}  {:>9.0} msg/s  (nacked {}, returned {})", self.confirmed, self.rate(self.confirmed), self.nacked, self.returned);
        println!("  consumed  {:>10}  {:>9.0} msg/s  {:>7.1} MB/s", self.consumed, self.rate(self.consumed), mb(self.consumed));
        let line = |name: &str, v: &[u64; 6]| {
            if v[5] > 0 {
                println!(
                    "  {name} latency p50 {}  p95 {}  p99 {}  p99.9 {}  max {}",
                    fmt_us(v[0]),
                    fmt_us(v[1]),
                    fmt_us(v[2]),
                    fmt_us(v[3]),
                    fmt_us(v[4])
                );
            }
        };
        line("confirm", &self.confirm);
        line("end-to-end", &self.e2e);
        let msgs = (self.sent + self.consumed).max(1);
        println!("  client CPU {:.2} s ({:.2} µs per message sent or consumed)", self.cpu, self.cpu * 1e6 / msgs as f64);
    }

    fn json(&self) -> serde_json::Value {
        let msgs = (self.sent + self.consumed).max(1);
        serde_json::json!({
            "elapsed_s": self.elapsed,
            "sent": self.sent, "confirmed": self.confirmed, "nacked": self.nacked,
            "returned": self.returned, "consumed": self.consumed,
            "send_rate": self.rate(self.sent), "confirm_rate": self.rate(self.confirmed),
            "consume_rate": self.rate(self.consumed),
            "confirm_p50_us": self.confirm[0], "confirm_p95_us": self.confirm[1], "confirm_p99_us": self.confirm[2],
            "confirm_p999_us": self.confirm[3], "confirm_max_us": self.confirm[4],
            "e2e_p50_us": self.e2e[0], "e2e_p95_us": self.e2e[1], "e2e_p99_us": self.e2e[2],
            "e2e_p999_us": self.e2e[3], "e2e_max_us": self.e2e[4],
            "client_cpu_s": self.cpu, "client_cpu_us_per_msg": self.cpu * 1e6 / msgs as f64,
        })
    }
}
