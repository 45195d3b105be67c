//! `warren bench --cmq URL`: the same tool driving CMQ's HTTP API (Warren's `/v2/index.php`, or
//! any CMQ 2.0 endpoint). Producers send BatchSendMessage (or SendMessage with `--batch 1`) on
//! keep-alive connections, each request answered once durable; consumers BatchReceiveMessage with
//! long polling and BatchDeleteMessage what they got. Every request is signed as Tencent's SDK
//! signs it (HmacSHA1). The HTTP/1.1 client is a few lines over a socket: one request at a time per
//! connection, `Content-Length` bodies, which is all this API uses.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use hdrhistogram::Histogram;
use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::BenchArgs;

type Error = String;

/// One keep-alive connection to the API.
struct Client {
    host: String,
    stream: BufReader<TcpStream>,
    secret_id: String,
    secret_key: String,
    nonce: u64,
}

impl Client {
    async fn connect(host: &str, secret_id: &str, secret_key: &str) -> Result<Client, Error> {
        let stream = TcpStream::connect(host).await.map_err(|e| format!("cannot connect to {host}: {e}"))?;
        let _ = stream.set_nodelay(true);
        Ok(Client { host: host.to_owned(), stream: BufReader::new(stream), secret_id: secret_id.into(), secret_key: secret_key.into(), nonce: first_nonce() })
    }

    /// Sends `Action` with `params` (signed) and returns the answer's JSON; a non-zero `code` other
    /// than `ok_codes` is an error.
    async fn call(&mut self, action: &str, params: &[(String, String)], ok_codes: &[i64]) -> Result<Value, Error> {
        self.nonce += 1;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let (nonce, timestamp) = (self.nonce.to_string(), now.to_string());
        let mut all: Vec<(&str, &str)> = vec![("Action", action), ("SecretId", &self.secret_id), ("Nonce", &nonce), ("Timestamp", &timestamp), ("SignatureMethod", "HmacSHA1")];
        all.extend(params.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        all.sort_by(|a, b| a.0.cmp(b.0));
        // The SDK's signature, hashed piece by piece (a batch's text is as long as its bodies).
        let mut mac = Hmac::<sha1::Sha1>::new_from_slice(self.secret_key.as_bytes()).map_err(|e| e.to_string())?;
        mac.update(b"POST");
        mac.update(self.host.as_bytes());
        mac.update(b"/v2/index.php?");
        for (i, (k, v)) in all.iter().enumerate() {
            if i > 0 {
                mac.update(b"&");
            }
            mac.update(k.replace('_', ".").as_bytes());
            mac.update(b"=");
            mac.update(v.as_bytes());
        }
        let signature = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
        all.push(("Signature", &signature));
        let form_len: usize = all.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        let mut form = String::with_capacity(form_len + form_len / 4);
        form_urlencoded::Serializer::new(&mut form).extend_pairs(all.iter());
        // Head and body in one write: one segment for a small request, not two.
        let mut request = format!("POST /v2/index.php HTTP/1.1\r\nHost: {}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n", self.host, form.len());
        request.push_str(&form);
        self.stream.get_mut().write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut line = String::new();
        let mut length = None;
        let mut status = 0;
        loop {
            line.clear();
            if self.stream.read_line(&mut line).await.map_err(|e| e.to_string())? == 0 {
                return Err("the server closed the connection".into());
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some(rest) = l.strip_prefix("HTTP/1.1 ") {
                status = rest.get(..3).and_then(|s| s.parse().ok()).unwrap_or(0);
            } else if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse::<usize>().ok();
                }
            }
        }
        let mut answer = vec![0; length.ok_or("an answer without Content-Length")?];
        self.stream.read_exact(&mut answer).await.map_err(|e| e.to_string())?;
        if status != 200 {
            return Err(format!("HTTP {status}: {}", String::from_utf8_lossy(&answer)));
        }
        let v: Value = serde_json::from_slice(&answer).map_err(|e| format!("an answer that is not JSON: {e}"))?;
        let code = v["code"].as_i64().unwrap_or(-1);
        if code != 0 && !ok_codes.contains(&code) {
            return Err(format!("{action}: code {code}: {}", v["message"]));
        }
        Ok(v)
    }
}

#[derive(Default)]
struct Totals {
    sent: AtomicU64,
    received: AtomicU64,
    send_latency_us: Mutex<Option<Histogram<u64>>>,
}

/// Runs the CMQ workload of `args` against `url` (http://HOST:PORT).
pub async fn run(args: &BenchArgs, url: &str) -> Result<u8, Error> {
    let host = url.strip_prefix("http://").ok_or("--cmq takes http://HOST:PORT")?.trim_end_matches('/').to_owned();
    let batch = args.batch.clamp(1, 16);
    let mut setup = Client::connect(&host, &args.secret_id, &args.secret_key).await?;
    let mut create = vec![("queueName".to_string(), args.queue.clone()), ("maxMsgSize".into(), "1048576".into())];
    if let Some(kind) = &args.queue_type {
        create.push(("queueType".into(), kind.clone()));
    }
    setup.call("CreateQueue", &create, &[4460]).await?;
    let totals = Arc::new(Totals::default());
    *totals.send_latency_us.lock() = Histogram::new_with_bounds(1, 60_000_000, 3).ok();
    let stop = Arc::new(AtomicBool::new(false));
    let body: String = "x".repeat(args.size.max(1));
    let limit = args.pmessages.unwrap_or(0);
    let mut tasks = Vec::new();
    for _ in 0..args.producers {
        let (host, totals, stop, body, queue) = (host.clone(), totals.clone(), stop.clone(), body.clone(), args.queue.clone());
        let (id, key) = (args.secret_id.clone(), args.secret_key.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = Client::connect(&host, &id, &key).await?;
            let mut params = vec![("queueName".to_string(), queue)];
            if batch == 1 {
                params.push(("msgBody".into(), body));
            } else {
                params.extend((1..=batch).map(|i| (format!("msgBody.{i}"), body.clone())));
            }
            let action = if batch == 1 { "SendMessage" } else { "BatchSendMessage" };
            let mut sent = 0;
            while !stop.load(Ordering::Relaxed) && (limit == 0 || sent < limit) {
                let started = Instant::now();
                c.call(action, &params, &[]).await?;
                if let Some(h) = totals.send_latency_us.lock().as_mut() {
                    let _ = h.record(started.elapsed().as_micros().max(1) as u64);
                }
                sent += batch as u64;
                totals.sent.fetch_add(batch as u64, Ordering::Relaxed);
            }
            Ok::<(), Error>(())
        }));
    }
    for _ in 0..args.consumers {
        let (host, totals, stop, queue) = (host.clone(), totals.clone(), stop.clone(), args.queue.clone());
        let (id, key) = (args.secret_id.clone(), args.secret_key.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = Client::connect(&host, &id, &key).await?;
            let receive = [("queueName".to_string(), queue.clone()), ("numOfMsg".into(), "16".into()), ("pollingWaitSeconds".into(), "1".into())];
            while !stop.load(Ordering::Relaxed) {
                let got = c.call("BatchReceiveMessage", &receive, &[7000]).await?;
                let Some(list) = got["msgInfoList"].as_array() else { continue };
                let mut delete = vec![("queueName".to_string(), queue.clone())];
                for (i, m) in list.iter().enumerate() {
                    delete.push((format!("receiptHandle.{}", i + 1), m["receiptHandle"].as_str().unwrap_or_default().to_owned()));
                }
                c.call("BatchDeleteMessage", &delete, &[]).await?;
                totals.received.fetch_add(list.len() as u64, Ordering::Relaxed);
            }
            Ok::<(), Error>(())
        }));
    }
    let started = Instant::now();
    let duration = Duration::from_secs_f64(args.time.unwrap_or(10.0));
    let (mut last_sent, mut last_received, mut last) = (0, 0, started);
    // With --pmessages the run ends once every message is sent and (with consumers) received.
    let total = limit.div_ceil(batch as u64) * batch as u64 * args.producers as u64;
    let complete = |t: &Totals| limit > 0 && t.sent.load(Ordering::Relaxed) >= total && (args.consumers == 0 || t.received.load(Ordering::Relaxed) >= total);
    while started.elapsed() < duration && !tasks.iter().all(|t| t.is_finished()) && !complete(&totals) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if last.elapsed() < Duration::from_secs_f64(args.progress_every.max(0.1)) || args.progress_every == 0.0 {
            continue;
        }
        let (s, r) = (totals.sent.load(Ordering::Relaxed), totals.received.load(Ordering::Relaxed));
        let dt = last.elapsed().as_secs_f64();
        report!("time {:.1}s, sent {:.0} msg/s, received+deleted {:.0} msg/s", started.elapsed().as_secs_f64(), (s - last_sent) as f64 / dt, (r - last_received) as f64 / dt);
        (last_sent, last_received, last) = (s, r, Instant::now());
    }
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let mut failed = None;
    for t in tasks {
        match tokio::time::timeout(Duration::from_secs(10), t).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => failed = Some(e),
            Ok(Err(e)) => failed = Some(e.to_string()),
            Err(_) => failed = Some("a client did not stop within 10 s".into()),
        }
    }
    let (sent, received) = (totals.sent.load(Ordering::Relaxed), totals.received.load(Ordering::Relaxed));
    let latency = totals.send_latency_us.lock().take();
    let pct = |q: f64| latency.as_ref().map_or(0, |h| h.value_at_quantile(q));
    let summary = serde_json::json!({
        "api": "cmq",
        "batch": batch,
        "size": args.size,
        "producers": args.producers,
        "consumers": args.consumers,
        "seconds": elapsed,
        "sent": sent,
        "received": received,
        "send_rate": sent as f64 / elapsed,
        "receive_rate": received as f64 / elapsed,
        "send_request_latency_us": {"p50": pct(0.5), "p95": pct(0.95), "p99": pct(0.99), "max": pct(1.0)},
    });
    println!("{}", serde_json::to_string_pretty(&summary).unwrap_or_default());
    if let Some(path) = &args.json {
        std::fs::write(path, summary.to_string()).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(e) = failed {
        return Err(e);
    }
    // Exit 3 (as the AMQP mode) when --pmessages was asked and not everything arrived.
    Ok(if limit > 0 && !complete(&totals) { 3 } else { 0 })
}

/// A random first `Nonce` for a client (then counted up): clients sending the same request in the
/// same second must still differ, or the broker refuses the copy as a replay.
fn first_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new().build_hasher().finish() >> 1
}
