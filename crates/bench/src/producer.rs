//! A producer: one connection publishing as fast as its confirm window (and `--rate`) allow, messages
//! written to the socket in batches; a second task on the same connection reads confirms.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::sync::Notify;
use warren_protocol::frame::{self, Frame};
use warren_protocol::method::*;

use crate::client::{self, Error, Reader, Uri};
use crate::stats::{now_ns, Stats};

pub struct ProducerConfig {
    pub uri: Uri,
    pub id: usize,
    /// Routing keys to publish with, round robin (the queue names, for the default exchange).
    pub routing_keys: Arc<Vec<String>>,
    pub exchange: String,
    pub size: usize,
    pub persistent: bool,
    /// Most unconfirmed messages in flight; 0: no confirms.
    pub confirm: u32,
    /// Messages per second; 0: as fast as possible.
    pub rate: f64,
    /// Messages to send; 0: until `stop`.
    pub messages: u64,
    pub stop: Arc<AtomicBool>,
}

/// Unconfirmed messages, by delivery tag: tag `base + i` was sent at `sent_ns[i]` (0 once confirmed).
struct InFlight {
    base: u64,
    sent_ns: VecDeque<u64>,
    outstanding: u64,
    closed: Option<String>,
}

/// Most messages written per socket write.
const BATCH: usize = 200;

pub async fn run(cfg: ProducerConfig, stats: Arc<Stats>) -> Result<(), Error> {
    let (mut reader, mut writer) = client::connect(&cfg.uri, &format!("warren-bench producer {}", cfg.id)).await?;
    let confirms = cfg.confirm > 0;
    if confirms {
        match client::call(&mut reader, &mut writer, Method::ConfirmSelect(ConfirmSelect { nowait: false })).await? {
            Method::ConfirmSelectOk(_) => {}
            other => return Err(format!("expected confirm.select-ok, got {}", other.name()).into()),
        }
    }
    let inflight = Arc::new(Mutex::new(InFlight { base: 1, sent_ns: VecDeque::new(), outstanding: 0, closed: None }));
    let space = Arc::new(Notify::new());
    let acks = tokio::spawn(read_confirms(reader, inflight.clone(), space.clone(), stats.clone()));

    // Pre-encoded frames: one basic.publish per routing key, the content header, the properties.
    let props: &[u8] = if cfg.persistent { &[0x10, 0x00, 0x02] } else { &[0x00, 0x00] };
    let publishes: Vec<Bytes> = cfg
        .routing_keys
        .iter()
        .map(|rk| {
            let mut b = BytesMut::new();
            let m = Method::BasicPublish(BasicPublish { reserved_1: 0, exchange: cfg.exchange.clone(), routing_key: rk.clone(), mandatory: false, immediate: false });
            frame::write_method(&mut b, 1, &m);
            b.freeze()
        })
        .collect();
    // The content header frame (an empty body writes no body frame); the body size patched in.
    let mut header = BytesMut::new();
    frame::write_content(&mut header, 1, 60, props, &[], 0);
    header[11..19].copy_from_slice(&(cfg.size as u64).to_be_bytes());
    let header = header.freeze();
    let body_frame_max = (client_frame_max() - 8) as usize;
    let padding = vec![0u8; cfg.size];

    let start = Instant::now();
    let mut seq: u64 = 0;
    let mut next_tag: u64 = 1;
    let mut rr = cfg.id % publishes.len().max(1);
    while !cfg.stop.load(Ordering::Relaxed) && (cfg.messages == 0 || seq < cfg.messages) {
        let mut n = BATCH;
        if cfg.messages > 0 {
            n = n.min((cfg.messages - seq) as usize);
        }
        if cfg.rate > 0.0 {
            let due = (start.elapsed().as_secs_f64() * cfg.rate) as u64 + 1;
            if due <= seq {
                let wait = Duration::from_secs_f64((seq + 1) as f64 / cfg.rate) .saturating_sub(start.elapsed());
                tokio::time::sleep(wait.min(Duration::from_millis(100))).await;
                continue;
            }
            n = n.min((due - seq) as usize);
        }
        if confirms {
            loop {
                let notified = space.notified();
                let (outstanding, closed) = {
                    let f = inflight.lock();
                    (f.outstanding, f.closed.clone())
                };
                if let Some(why) = closed {
                    return Err(why.into());
                }
                if outstanding < cfg.confirm as u64 {
                    n = n.min((cfg.confirm as u64 - outstanding) as usize);
                    break;
                }
                if cfg.stop.load(Ordering::Relaxed) {
                    n = 0;
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
            }
            if n == 0 {
                break;
            }
        }
        let buf = &mut writer.buf;
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let ts = now_ns();
            buf.extend_from_slice(&publishes[rr]);
            rr = (rr + 1) % publishes.len();
            buf.extend_from_slice(&header);
            let mut body_head = [0u8; 16];
            body_head[..8].copy_from_slice(&ts.to_le_bytes());
            body_head[8..].copy_from_slice(&seq.to_le_bytes());
            write_body(buf, cfg.size, &body_head, &padding, body_frame_max);
            times.push(ts);
            seq += 1;
        }
        if confirms {
            let mut f = inflight.lock();
            f.sent_ns.extend(times.iter().copied());
            f.outstanding += n as u64;
        }
        next_tag += n as u64;
        stats.counters.sent.fetch_add(n as u64, Ordering::Relaxed);
        writer.flush().await?;
    }
    // Wait for the last confirms (at most 60 s).
    if confirms {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let notified = space.notified();
            let (outstanding, closed) = {
                let f = inflight.lock();
                (f.outstanding, f.closed.clone())
            };
            if outstanding == 0 || Instant::now() > deadline {
                break;
            }
            if let Some(why) = closed {
                return Err(why.into());
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }
    let _ = next_tag;
    acks.abort();
    writer.method(0, &Method::ConnectionClose(ConnectionClose { reply_code: 200, reply_text: "bye".into(), class_id: 0, method_id: 0 }));
    let _ = writer.flush().await;
    Ok(())
}

fn client_frame_max() -> u32 {
    131_072
}

/// Body frames for one message: `head` (timestamp, seq), then zero padding, split at the frame size.
fn write_body(buf: &mut BytesMut, size: usize, head: &[u8; 16], padding: &[u8], max: usize) {
    let mut written = 0;
    while written < size || (size == 0 && written == 0) {
        if size == 0 {
            return;
        }
        let chunk = (size - written).min(max);
        buf.put_u8(3);
        buf.put_u16(1);
        buf.put_u32(chunk as u32);
        let mut left = chunk;
        if written < head.len() {
            let h = (head.len() - written).min(left);
            buf.extend_from_slice(&head[written..written + h]);
            left -= h;
        }
        buf.extend_from_slice(&padding[..left]);
        buf.put_u8(0xCE);
        written += chunk;
    }
}

async fn read_confirms(mut reader: Reader, inflight: Arc<Mutex<InFlight>>, space: Arc<Notify>, stats: Arc<Stats>) {
    loop {
        let frame = match reader.next().await {
            Ok(f) => f,
            Err(e) => {
                inflight.lock().closed = Some(e.to_string());
                space.notify_waiters();
                return;
            }
        };
        let (tag, multiple, nack) = match frame {
            Frame::Method { method: Method::BasicAck(a), .. } => (a.delivery_tag, a.multiple, false),
            Frame::Method { method: Method::BasicNack(n), .. } => (n.delivery_tag, n.multiple, true),
            Frame::Method { method: Method::BasicReturn(_), .. } => {
                stats.counters.returned.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            _ => continue,
        };
        let now = now_ns();
        let mut lat = Vec::new();
        {
            let mut f = inflight.lock();
            let from = if multiple { f.base } else { tag };
            for t in from..=tag {
                let Some(i) = t.checked_sub(f.base) else { continue };
                if let Some(slot) = f.sent_ns.get_mut(i as usize) {
                    if *slot != 0 {
                        lat.push(now.saturating_sub(*slot) / 1000);
                        *slot = 0;
                        f.outstanding -= 1;
                    }
                }
            }
            while f.sent_ns.front() == Some(&0) {
                f.sent_ns.pop_front();
                f.base += 1;
            }
        }
        let n = lat.len() as u64;
        if nack {
            stats.counters.nacked.fetch_add(n, Ordering::Relaxed);
        } else {
            stats.counters.confirmed.fetch_add(n, Ordering::Relaxed);
        }
        {
            let mut h = stats.confirm.lock();
            for l in lat {
                h.record(l);
            }
        }
        space.notify_waiters();
    }
}
