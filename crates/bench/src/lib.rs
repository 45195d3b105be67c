//! `warren bench`: an AMQP 0-9-1 load generator in the spirit of RabbitMQ's PerfTest, for Warren or
//! RabbitMQ alike. Producers and consumers are connections of their own, each one tokio task, on a
//! small runtime (one thread by default: the broker under test usually shares the machine). Messages
//! carry their send time, so end-to-end latency is measured, and publisher-confirm latency too, both
//! into HDR histograms. The client speaks AMQP through the workspace codec (`warren-protocol`) with
//! hand-rolled hot paths, so it costs well under a microsecond of CPU per message. See docs/bench.md.

#[macro_use]
pub mod output;

mod client;
mod cmq;
mod consumer;
mod producer;
mod stats;
pub mod tls;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use tokio::task::JoinHandle;
use warren_protocol::field::{FieldTable, FieldValue};
use warren_protocol::method::*;

use client::{Conn, Error, Uri};
use stats::{cpu_seconds, Counts, Stats};

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Broker to load: amqp://user:pass@host:port/vhost (vhost percent-encoded: %2F is "/"), or
    /// amqps:// for TLS (port 5671 by default).
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2F")]
    pub uri: String,
    /// With amqps://: CA certificates (PEM) the broker's certificate must chain to, for the URI's
    /// host; without it any certificate is accepted (as PerfTest does).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Publishing connections.
    #[arg(long, default_value_t = 1)]
    pub producers: usize,
    /// Consuming connections.
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Message body size in bytes. The body starts with the send time (8 bytes) and a sequence
    /// number (8 bytes); end-to-end latency needs at least 8.
    #[arg(long, default_value_t = 1000)]
    pub size: usize,
    /// Publish persistent messages (delivery-mode 2).
    #[arg(long)]
    pub persistent: bool,
    /// Publisher confirms, with at most N unconfirmed messages per producer (0: no confirms).
    #[arg(long, default_value_t = 0)]
    pub confirm: u32,
    /// basic.qos prefetch count per consumer (0: unlimited).
    #[arg(long, default_value_t = 0)]
    pub prefetch: u16,
    /// Ack with multiple=true every N messages (1: ack each message).
    #[arg(long, default_value_t = 1)]
    pub multi_ack_every: u64,
    /// Consume with no-ack.
    #[arg(long)]
    pub auto_ack: bool,
    /// Messages per second per producer (0: unlimited).
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Run for this many seconds (at most).
    #[arg(long)]
    pub time: Option<f64>,
    /// Messages per producer; the run ends once they are all sent, confirmed (with --confirm) and
    /// consumed (with consumers). 0: no limit.
    #[arg(long)]
    pub pmessages: Option<u64>,
    /// Messages per consumer (for consume-only runs); 0: no limit.
    #[arg(long)]
    pub cmessages: Option<u64>,
    /// Queue name.
    #[arg(long, default_value = "warren-bench")]
    pub queue: String,
    /// With N > 1, queues QUEUE-0 .. QUEUE-(N-1): producers and consumers are spread over them round
    /// robin (with fewer producers or consumers than queues, each takes several, in turn).
    #[arg(long, default_value_t = 1)]
    pub queues: usize,
    /// Publish to this exchange, routing key = queue name; unless --predeclared it is declared
    /// (durable, of --exchange-type) and each queue is bound to it with its name as the key.
    /// "": the default exchange.
    #[arg(long, default_value = "")]
    pub exchange: String,
    /// Type of the exchange declared for --exchange (direct, fanout, topic, headers, or
    /// x-delayed-message: a delayed exchange routing as direct).
    #[arg(long, default_value = "direct")]
    pub exchange_type: String,
    /// Publish with header `x-delay` = N (for a delayed exchange); end-to-end latency is then
    /// counted from the send time plus N (the lateness), and a delivery before that as `early`,
    /// both on the wall clock (as brokers count delays) rather than the monotonic one.
    #[arg(long, default_value_t = 0)]
    pub delay_ms: u32,
    /// x-queue-type of the declared queues (not sent unless given).
    #[arg(long, value_parser = ["classic", "quorum", "stream"])]
    pub queue_type: Option<String>,
    /// Extra queue arguments, k=v,... (integers are sent as longs, true/false as booleans, the rest
    /// as strings), e.g. x-max-length=100000,x-overflow=reject-publish.
    #[arg(long, default_value = "")]
    pub queue_args: String,
    /// Declare the queues durable (--durable false: transient).
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub durable: bool,
    /// Declare nothing: the queues (and exchange, and bindings) exist already.
    #[arg(long)]
    pub predeclared: bool,
    /// Publish with mandatory=true (unroutable messages come back and are counted as returned).
    #[arg(long)]
    pub mandatory: bool,
    /// Write the summary as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Seconds between progress lines on stderr (0: none).
    #[arg(long, default_value_t = 1.0)]
    pub progress_every: f64,
    /// Drive CMQ's HTTP API at this URL (http://HOST:PORT, Warren's management port) instead of
    /// AMQP: producers BatchSendMessage, consumers BatchReceiveMessage + BatchDeleteMessage, on
    /// keep-alive connections; --queue, --queue-type, --size, --time, --pmessages, --json apply.
    #[arg(long)]
    pub cmq: Option<String>,
    /// With --cmq: messages per send request (1: SendMessage; at most 16).
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// With --cmq: the SecretId (a user name).
    #[arg(long, default_value = "guest")]
    pub secret_id: String,
    /// With --cmq: the SecretKey (the user's password).
    #[arg(long, default_value = "guest")]
    pub secret_key: String,
    /// Client threads (1: a current-thread runtime; the broker usually needs the other cores).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
}

/// Exit codes: success; a connection or setup failed; the arguments are wrong; the run did not
/// complete (with --pmessages/--cmessages: not everything confirmed or consumed).
const EXIT_ERROR: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_INCOMPLETE: u8 = 3;

/// How long a producer waits for outstanding confirms once it has stopped sending.
const CONFIRM_DRAIN: Duration = Duration::from_secs(30);
/// With --pmessages: how long consumers may receive nothing, once producers are done, before the
/// run gives up on them.
const CONSUME_STALL: Duration = Duration::from_secs(10);

/// Runs the benchmark; the exit code says whether it completed as asked.
pub fn run(mut args: BenchArgs) -> std::process::ExitCode {
    if let Err(e) = validate(&mut args) {
        report!("warren bench: {e}");
        return std::process::ExitCode::from(EXIT_USAGE);
    }
    let runtime = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads).thread_name("warren-bench").enable_all().build()
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            report!("warren bench: cannot start the runtime: {e}");
            return std::process::ExitCode::from(EXIT_ERROR);
        }
    };
    let code = match runtime.block_on(bench(args)) {
        Ok(code) => code,
        Err(e) => {
            report!("warren bench: error: {e}");
            EXIT_ERROR
        }
    };
    // Tasks still stuck on a dead connection must not hold the exit up.
    runtime.shutdown_timeout(Duration::from_secs(1));
    std::process::ExitCode::from(code)
}

fn validate(args: &mut BenchArgs) -> Result<(), String> {
    if args.producers == 0 && args.consumers == 0 {
        return Err("nothing to do: --producers 0 and --consumers 0".into());
    }
    if args.queues == 0 {
        return Err("--queues must be at least 1".into());
    }
    if !(args.rate >= 0.0 && args.rate.is_finite()) {
        return Err("--rate must be a number of messages per second, 0 for no limit".into());
    }
    if let Some(t) = args.time {
        if !(t > 0.0 && t.is_finite()) {
            return Err("--time must be a positive number of seconds".into());
        }
    }
    if !(args.progress_every >= 0.0 && args.progress_every.is_finite()) {
        return Err("--progress-every must be a number of seconds, 0 for none".into());
    }
    // 0 means "no limit", as in PerfTest.
    args.pmessages = args.pmessages.filter(|n| *n > 0);
    args.cmessages = args.cmessages.filter(|n| *n > 0);
    args.multi_ack_every = args.multi_ack_every.max(1);
    if !args.auto_ack && args.prefetch > 0 && args.multi_ack_every > args.prefetch as u64 {
        report!(
            "warren bench: --multi-ack-every {} is more than --prefetch {}: consumers would stall; acking every {}",
            args.multi_ack_every, args.prefetch, args.prefetch
        );
        args.multi_ack_every = args.prefetch as u64;
    }
    if args.size < 8 && args.consumers > 0 && args.producers > 0 {
        report!("warren bench: --size {} has no room for the send time: no end-to-end latency", args.size);
    }
    queue_arguments(args)?;
    Uri::parse(&args.uri).map_err(|e| e.to_string())?;
    tls::configure(args.tls_ca.as_deref()).map_err(|e| e.to_string())?;
    Ok(())
}

fn queue_names(args: &BenchArgs) -> Vec<String> {
    if args.queues <= 1 {
        vec![args.queue.clone()]
    } else {
        (0..args.queues).map(|i| format!("{}-{i}", args.queue)).collect()
    }
}

/// Connection `id` of `n` gets these queues: queue `id % q` when there are at least as many
/// connections as queues, else every n-th queue from `id`.
fn share(queues: &[String], id: usize, n: usize) -> Vec<String> {
    if n >= queues.len() {
        vec![queues[id % queues.len()].clone()]
    } else {
        queues.iter().skip(id).step_by(n).cloned().collect()
    }
}

fn queue_arguments(args: &BenchArgs) -> Result<FieldTable, String> {
    let mut t = FieldTable::new();
    if let Some(kind) = &args.queue_type {
        t.insert("x-queue-type".into(), FieldValue::LongString(kind.clone().into()));
    }
    for kv in args.queue_args.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| format!("--queue-args: expected key=value, got {kv:?}"))?;
        let value = if let Ok(n) = v.parse::<i64>() {
            FieldValue::I64(n)
        } else if let Ok(b) = v.parse::<bool>() {
            FieldValue::Bool(b)
        } else {
            FieldValue::LongString(v.to_string().into())
        };
        t.insert(k.trim().to_string(), value);
    }
    Ok(t)
}

/// With an exchange that copies a message to every bound queue, each message is consumed that many
/// times.
fn copies(args: &BenchArgs, queues: usize) -> u64 {
    if !args.exchange.is_empty() && matches!(args.exchange_type.as_str(), "fanout" | "headers") {
        queues as u64
    } else {
        1
    }
}

async fn setup(uri: &Uri, args: &BenchArgs, queues: &[String]) -> Result<(), Error> {
    let mut c = Conn::open(uri, "warren-bench setup").await?;
    let arguments = queue_arguments(args)?;
    // amq.* exchanges exist already and may not be declared (RabbitMQ refuses with 403).
    if !args.exchange.is_empty() && !args.exchange.starts_with("amq.") {
        let mut arguments = warren_protocol::field::FieldTable::new();
        if args.exchange_type == "x-delayed-message" {
            arguments.insert("x-delayed-type".to_string(), warren_protocol::field::FieldValue::LongString("direct".into()));
        }
        let m = ExchangeDeclare { exchange: args.exchange.clone(), kind: args.exchange_type.clone(), durable: true, arguments, ..Default::default() };
        c.call(Method::ExchangeDeclare(m)).await.map_err(|e| format!("declaring exchange {:?}: {e}", args.exchange))?;
    }
    for q in queues {
        let m = QueueDeclare { queue: q.clone(), durable: args.durable, arguments: arguments.clone(), ..Default::default() };
        c.call(Method::QueueDeclare(m)).await.map_err(|e| format!("declaring queue {q:?}: {e}"))?;
        if !args.exchange.is_empty() {
            let m = QueueBind { queue: q.clone(), exchange: args.exchange.clone(), routing_key: q.clone(), ..Default::default() };
            c.call(Method::QueueBind(m)).await.map_err(|e| format!("binding queue {q:?} to {:?}: {e}", args.exchange))?;
        }
    }
    c.close().await;
    Ok(())
}

struct Task {
    what: String,
    handle: Option<JoinHandle<Result<(), Error>>>,
}

impl Task {
    /// Collects the result if the task has finished; an error is returned as a sentence.
    async fn reap(&mut self, wait: Duration) -> Option<Result<(), String>> {
        let h = self.handle.as_mut()?;
        if wait.is_zero() && !h.is_finished() {
            return None;
        }
        let r = match tokio::time::timeout(wait.max(Duration::from_millis(1)), &mut *h).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(format!("{}: {e}", self.what)),
            Ok(Err(e)) => Err(format!("{}: the task failed: {e}", self.what)),
            Err(_) if wait.is_zero() => return None,
            Err(_) => {
                h.abort();
                Err(format!("{}: did not finish within {} s of being told to stop", self.what, wait.as_secs()))
            }
        };
        self.handle = None;
        Some(r)
    }

    fn done(&self) -> bool {
        self.handle.is_none()
    }
}

async fn bench(args: BenchArgs) -> Result<u8, Error> {
    if let Some(url) = &args.cmq {
        return Ok(cmq::run(&args, url).await?);
    }
    let uri = Uri::parse(&args.uri)?;
    let queues = queue_names(&args);
    if !args.predeclared {
        setup(&uri, &args, &queues).await?;
    }
    let stats = Arc::new(Stats::new());
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        // The first Ctrl-C stops the run (with a summary); a second one exits at once.
        tokio::spawn(async move {
            while tokio::signal::ctrl_c().await.is_ok() {
                if flag.swap(true, Ordering::Relaxed) {
                    report!("warren bench: interrupted twice: exiting without a summary");
                    std::process::exit(130);
                }
                report!("warren bench: stopping (Ctrl-C again to exit at once)");
            }
        });
    }
    let (stop_producers, producer_stop) = tokio::sync::watch::channel(false);
    let (stop_consumers, consumer_stop) = tokio::sync::watch::channel(false);
    let mut errors: Vec<String> = Vec::new();

    // Consumers first, so that producers start on consumers that are ready.
    let ready = Arc::new(AtomicUsize::new(0));
    let mut consumers: Vec<Task> = (0..args.consumers)
        .map(|id| {
            let cfg = consumer::ConsumerConfig {
                uri: uri.clone(),
                id,
                queues: share(&queues, id, args.consumers),
                prefetch: args.prefetch,
                multi_ack_every: args.multi_ack_every,
                auto_ack: args.auto_ack,
                messages: args.cmessages.unwrap_or(0),
                stop: consumer_stop.clone(),
                ready: ready.clone(),
                delay_ns: u64::from(args.delay_ms) * 1_000_000,
            };
            Task { what: format!("consumer {id}"), handle: Some(tokio::spawn(consumer::run(cfg, stats.clone()))) }
        })
        .collect();
    let wait_start = Instant::now();
    while ready.load(Ordering::Relaxed) < args.consumers && !interrupted.load(Ordering::Relaxed) {
        for c in &mut consumers {
            if let Some(Err(e)) = c.reap(Duration::ZERO).await {
                errors.push(e);
            }
        }
        if consumers.iter().any(Task::done) {
            break;
        }
        if wait_start.elapsed() > Duration::from_secs(60) {
            errors.push("consumers did not start consuming within 60 s".into());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let cpu_start = cpu_seconds();
    let started = Instant::now();
    let started_ns = stats::now_ns();
    let copies = copies(&args, queues.len());
    let mut producers: Vec<Task> = Vec::new();
    if errors.is_empty() {
        producers = (0..args.producers)
            .map(|id| {
                let cfg = producer::ProducerConfig {
                    uri: uri.clone(),
                    id,
                    routing_keys: share(&queues, id, args.producers),
                    exchange: args.exchange.clone(),
                    size: args.size,
                    persistent: args.persistent,
                    mandatory: args.mandatory,
                    confirm: args.confirm,
                    rate: args.rate,
                    messages: args.pmessages.unwrap_or(0),
                    stop: producer_stop.clone(),
                    drain: CONFIRM_DRAIN,
                    delay_ms: args.delay_ms,
                };
                Task { what: format!("producer {id}"), handle: Some(tokio::spawn(producer::run(cfg, stats.clone()))) }
            })
            .collect();
    }
    if args.time.is_none() && args.pmessages.is_none() && args.cmessages.is_none() {
        report!("warren bench: no --time, --pmessages or --cmessages: running until interrupted (Ctrl-C)");
    }

    let deadline = args.time.map(|t| started + Duration::from_secs_f64(t));
    let every = Duration::from_secs_f64(args.progress_every.max(0.05));
    let mut progress = Progress { at: started, counts: Counts::default() };
    // When consumption last moved, for giving up on consumers that stopped receiving.
    let mut last_consumed = (0u64, Instant::now());
    let mut producers_done_at: Option<Instant> = None;
    let mut stalled = false;
    let end: Instant;
    loop {
        // The coordinator wakes 20 times a second: the end of a run that completes is taken from
        // `Stats::last_ns`, not from when this loop notices.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = Instant::now();
        if args.progress_every > 0.0 && now - progress.at >= every {
            progress.print(&stats, started, &args, copies);
        }
        for t in producers.iter_mut().chain(consumers.iter_mut()) {
            if let Some(Err(e)) = t.reap(Duration::ZERO).await {
                report!("warren bench: error: {e}");
                errors.push(e);
            }
        }
        if !errors.is_empty() || interrupted.load(Ordering::Relaxed) || deadline.is_some_and(|d| now >= d) {
            end = now;
            break;
        }
        let c = stats.counters.get();
        if c.consumed != last_consumed.0 {
            last_consumed = (c.consumed, now);
        }
        let producers_done = producers.iter().all(Task::done);
        let consumers_done = consumers.iter().all(Task::done);
        if producers_done && producers_done_at.is_none() {
            producers_done_at = Some(now);
        }
        if producers_done && consumers_done {
            end = now;
            break;
        }
        if producers_done && args.producers > 0 && args.cmessages.is_none() {
            // Producers sent their --pmessages: done once the consumers have it all.
            if args.consumers == 0 || c.consumed >= c.sent * copies {
                end = now;
                break;
            }
            let quiet_since = last_consumed.1.max(producers_done_at.unwrap_or(now));
            if now - quiet_since > CONSUME_STALL {
                report!(
                    "warren bench: consumers received nothing for {} s with {} of {} messages in: giving up",
                    CONSUME_STALL.as_secs(),
                    c.consumed,
                    c.sent * copies
                );
                stalled = true;
                end = now;
                break;
            }
        }
    }
    // The measured interval ends when the run's last message was dealt with (for a run that completed)
    // or now (time up, interrupted, failed).
    let completed = errors.is_empty() && !stalled && !interrupted.load(Ordering::Relaxed) && deadline.is_none_or(|d| end < d);
    let last_ns = stats.last_ns.load(Ordering::Relaxed);
    let elapsed = if completed && last_ns > started_ns {
        Duration::from_nanos(last_ns - started_ns).min(end - started)
    } else {
        end - started
    };
    let at_end = stats.counters.get();

    let _ = stop_producers.send(true);
    for p in &mut producers {
        if let Some(Err(e)) = p.reap(CONFIRM_DRAIN + Duration::from_secs(15)).await {
            errors.push(e);
        }
    }
    let _ = stop_consumers.send(true);
    for c in &mut consumers {
        if let Some(Err(e)) = c.reap(Duration::from_secs(15)).await {
            errors.push(e);
        }
    }
    let cpu = cpu_seconds() - cpu_start;
    let summary = Summary::new(&args, &stats, elapsed.as_secs_f64(), at_end, stats.counters.get(), cpu);
    // A reader that went away (`| head -1`) does not fail the run; see output.rs.
    output::stdout(&summary.render(&args)).map_err(|e| format!("cannot write the summary: {e}"))?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&summary.json())? + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }

    // Errors were printed as they happened; repeat them after the summary so they are not missed.
    let mut failures: Vec<String> = errors.iter().map(|e| format!("error: {e}")).collect();
    let mut incomplete = Vec::new();
    let t = summary.total;
    if let Some(p) = args.pmessages {
        let want = p * args.producers as u64;
        if t.sent != want {
            incomplete.push(format!("sent {} of the {want} messages asked for", t.sent));
        }
        if args.confirm > 0 && t.confirmed != t.sent {
            incomplete.push(format!(
                "only {} of the {} messages sent were confirmed ({} nacked, {} never confirmed)",
                t.confirmed,
                t.sent,
                t.nacked,
                t.sent.saturating_sub(t.confirmed + t.nacked)
            ));
        }
        if args.consumers > 0 && args.cmessages.is_none() && t.consumed < t.sent * copies {
            incomplete.push(format!("consumers received {} of the {} messages sent", t.consumed, t.sent * copies));
        }
    }
    if let Some(cm) = args.cmessages {
        let want = cm * args.consumers as u64;
        if t.consumed < want {
            incomplete.push(format!("consumers received {} of the {want} messages asked for", t.consumed));
        }
    }
    if interrupted.load(Ordering::Relaxed) {
        report!("warren bench: interrupted");
    }
    failures.extend(incomplete.iter().map(|e| format!("incomplete: {e}")));
    for f in &failures {
        report!("warren bench: {f}");
    }
    Ok(if !errors.is_empty() {
        EXIT_ERROR
    } else if !incomplete.is_empty() {
        EXIT_INCOMPLETE
    } else {
        0
    })
}

struct Progress {
    at: Instant,
    counts: Counts,
}

impl Progress {
    fn print(&mut self, stats: &Stats, started: Instant, args: &BenchArgs, copies: u64) {
        let now = Instant::now();
        let c = stats.counters.get();
        let dt = (now - self.at).as_secs_f64().max(1e-9);
        let rate = |a: u64, b: u64| (a - b) as f64 / dt;
        let confirm = stats.confirm.lock().take_interval();
        let e2e = stats.e2e.lock().take_interval();
        let lat = |v: Option<(u64, u64)>| v.map_or_else(|| "-".to_string(), |(a, b)| format!("{}/{}", fmt_us(a), fmt_us(b)));
        // In flight: unconfirmed with confirms; otherwise sent but not yet consumed.
        let in_flight = if args.confirm > 0 {
            c.sent.saturating_sub(c.confirmed + c.nacked).to_string()
        } else if args.producers > 0 && args.consumers > 0 {
            (c.sent * copies).saturating_sub(c.consumed).to_string()
        } else {
            "-".into()
        };
        report!(
            "{:6.1}s  sent {:>8.0}/s  confirmed {:>8.0}/s  consumed {:>8.0}/s  in flight {:>7}  confirm p50/p99 {}  e2e p50/p99 {}",
            (now - started).as_secs_f64(),
            rate(c.sent, self.counts.sent),
            rate(c.confirmed, self.counts.confirmed),
            rate(c.consumed, self.counts.consumed),
            in_flight,
            lat(confirm),
            lat(e2e),
        );
        *self = Progress { at: now, counts: c };
    }
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

/// p50, p95, p99, p99.9, max, count (µs).
type Percentiles = [u64; 6];

struct Summary {
    elapsed: f64,
    /// Counts at the end of the measured interval (rates are these over `elapsed`).
    at_end: Counts,
    /// Final counts, including confirms and deliveries that came in while stopping.
    total: Counts,
    size: usize,
    confirm: Percentiles,
    e2e: Percentiles,
    cpu: f64,
}

impl Summary {
    fn new(args: &BenchArgs, stats: &Stats, elapsed: f64, at_end: Counts, total: Counts, cpu: f64) -> Summary {
        let q = |h: &hdrhistogram::Histogram<u64>| -> Percentiles {
            if h.is_empty() {
                return [0; 6];
            }
            let p = |q: f64| h.value_at_quantile(q);
            [p(0.5), p(0.95), p(0.99), p(0.999), h.max(), h.len()]
        };
        let confirm = q(&stats.confirm.lock().total);
        let e2e = q(&stats.e2e.lock().total);
        Summary { elapsed, at_end, total, size: args.size, confirm, e2e, cpu }
    }

    fn rate(&self, n: u64) -> f64 {
        n as f64 / self.elapsed.max(1e-9)
    }

    /// MB/s of bodies for `n` messages of --size.
    fn mb(&self, n: u64) -> f64 {
        self.rate(n) * self.size as f64 / 1e6
    }

    /// MB/s of bodies consumed, counted as they came (whatever size their producer used).
    fn consumed_mb(&self) -> f64 {
        self.rate(self.at_end.consumed_bytes) / 1e6
    }

    fn cpu_per_msg_us(&self) -> Option<f64> {
        let n = self.total.sent + self.total.consumed;
        (n > 0).then(|| self.cpu * 1e6 / n as f64)
    }

    /// The summary printed at the end of a run.
    fn render(&self, args: &BenchArgs) -> String {
        let (t, e) = (self.total, self.at_end);
        let mut out = format!(
            "warren bench: {:.2} s, {} producer(s), {} consumer(s){}{}{}\n",
            self.elapsed,
            args.producers,
            args.consumers,
            if args.producers > 0 { format!(", {}-byte messages", args.size) } else { String::new() },
            if args.persistent { ", persistent" } else { "" },
            if args.confirm > 0 { format!(", confirms ({} in flight)", args.confirm) } else { String::new() },
        );
        if args.producers > 0 {
            out += &format!("  sent      {:>11}  {:>10.0} msg/s  {:>8.1} MB/s\n", t.sent, self.rate(e.sent), self.mb(e.sent));
        }
        if args.confirm > 0 {
            out += &format!(
                "  confirmed {:>11}  {:>10.0} msg/s  {:>8.1} MB/s  nacked {}\n",
                t.confirmed,
                self.rate(e.confirmed),
                self.mb(e.confirmed),
                t.nacked
            );
        }
        if args.consumers > 0 {
            out += &format!("  consumed  {:>11}  {:>10.0} msg/s  {:>8.1} MB/s\n", t.consumed, self.rate(e.consumed), self.consumed_mb());
        }
        out += &format!("  returned {}, redelivered {}, early {}\n", t.returned, t.redelivered, t.early);
        for (name, v) in [("confirm latency", &self.confirm), ("end-to-end latency", &self.e2e)] {
            if v[5] > 0 {
                out += &format!(
                    "  {name:<19} p50 {}  p95 {}  p99 {}  p99.9 {}  max {}\n",
                    fmt_us(v[0]),
                    fmt_us(v[1]),
                    fmt_us(v[2]),
                    fmt_us(v[3]),
                    fmt_us(v[4])
                );
            }
        }
        out += &format!(
            "  client CPU {:.2} s ({:.0}% of one core): {} µs per message sent or consumed\n",
            self.cpu,
            100.0 * self.cpu / self.elapsed.max(1e-9),
            self.cpu_per_msg_us().map_or_else(|| "-".to_string(), |v| format!("{v:.2}"))
        );
        out
    }

    fn json(&self) -> serde_json::Value {
        let (t, e) = (self.total, self.at_end);
        serde_json::json!({
            "elapsed_s": self.elapsed,
            "size": self.size,
            "sent": t.sent, "confirmed": t.confirmed, "nacked": t.nacked,
            "returned": t.returned, "consumed": t.consumed, "redelivered": t.redelivered, "early": t.early,
            "send_rate": self.rate(e.sent), "confirm_rate": self.rate(e.confirmed), "consume_rate": self.rate(e.consumed),
            "send_mb_s": self.mb(e.sent), "confirm_mb_s": self.mb(e.confirmed), "consume_mb_s": self.consumed_mb(),
            "confirm_p50_us": self.confirm[0], "confirm_p95_us": self.confirm[1], "confirm_p99_us": self.confirm[2],
            "confirm_p999_us": self.confirm[3], "confirm_max_us": self.confirm[4],
            "e2e_p50_us": self.e2e[0], "e2e_p95_us": self.e2e[1], "e2e_p99_us": self.e2e[2],
            "e2e_p999_us": self.e2e[3], "e2e_max_us": self.e2e[4],
            "client_cpu_s": self.cpu, "client_cpu_us_per_msg": self.cpu_per_msg_us(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(line: &str) -> BenchArgs {
        let mut a = Cli::try_parse_from(std::iter::once("bench").chain(line.split_whitespace())).unwrap().args;
        validate(&mut a).unwrap();
        a
    }

    #[test]
    fn defaults_and_flags() {
        let a = parse("");
        assert_eq!((a.producers, a.consumers, a.size, a.confirm, a.prefetch, a.multi_ack_every), (1, 1, 1000, 0, 0, 1));
        assert_eq!((a.queue.as_str(), a.queues, a.exchange.as_str(), a.durable, a.threads), ("warren-bench", 1, "", true, 1));
        assert_eq!(a.uri, "amqp://guest:guest@127.0.0.1:5672/%2F");
        assert!(parse("--durable").durable);
        assert!(!parse("--durable false").durable);
        assert!(!parse("--durable=false --persistent").durable);
        assert_eq!(parse("--pmessages 0").pmessages, None);
        assert_eq!(parse("--prefetch 10 --multi-ack-every 100").multi_ack_every, 10);
        assert_eq!(parse("--auto-ack --prefetch 10 --multi-ack-every 100").multi_ack_every, 100);
    }

    #[test]
    fn queue_arguments_are_typed() {
        let a = parse("--queue-type quorum --queue-args x-max-length=10,x-overflow=reject-publish,x-single-active-consumer=true");
        let t = queue_arguments(&a).unwrap();
        assert_eq!(t.get("x-queue-type"), Some(&FieldValue::LongString("quorum".into())));
        assert_eq!(t.get("x-max-length"), Some(&FieldValue::I64(10)));
        assert_eq!(t.get("x-overflow"), Some(&FieldValue::LongString("reject-publish".into())));
        assert_eq!(t.get("x-single-active-consumer"), Some(&FieldValue::Bool(true)));
        assert!(queue_arguments(&parse("")).unwrap().is_empty());
        let mut bad = parse("");
        bad.queue_args = "novalue".into();
        assert!(validate(&mut bad).is_err());
    }

    #[test]
    fn queues_are_shared_round_robin() {
        let q: Vec<String> = (0..4).map(|i| format!("q-{i}")).collect();
        assert_eq!(share(&q, 5, 8), vec!["q-1"]);
        assert_eq!(share(&q, 1, 2), vec!["q-1", "q-3"]);
        assert_eq!(share(&q, 0, 1), q);
        // Every queue is someone's.
        for n in 1..10 {
            let mut all: Vec<String> = (0..n).flat_map(|i| share(&q, i, n)).collect();
            all.sort();
            all.dedup();
            assert_eq!(all, q, "{n} connections");
        }
    }
}
