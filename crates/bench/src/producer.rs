//! A producer: one connection, one task, publishing as fast as its confirm window, `--rate` and the
//! socket allow. Messages are copied from a pre-encoded template (basic.publish, content header and
//! body frames) with the timestamp and sequence number patched in, as many as the window allows into
//! one buffer, written with one socket write; confirms are read on the same task, in place, between
//! writes. Nothing is allocated per message.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;
use warren_protocol::constants::{CLASS_BASIC, FRAME_METHOD, FRAME_OVERHEAD};
use warren_protocol::frame;
use warren_protocol::method::*;
use warren_protocol::properties::BasicProperties;

use crate::client::{self, closed_by_broker, Conn, Error, Next, Uri};
use crate::stats::{now_ns, wall_ns, Counters, Stats};

pub struct ProducerConfig {
    pub uri: Uri,
    pub id: usize,
    /// Routing keys to publish with, in turn (this producer's queues, for the default exchange).
    pub routing_keys: Vec<String>,
    pub exchange: String,
    pub size: usize,
    pub persistent: bool,
    pub mandatory: bool,
    /// Most unconfirmed messages in flight; 0: no confirms.
    pub confirm: u32,
    /// Messages per second; 0: as fast as possible.
    pub rate: f64,
    /// Messages to send; 0: until `stop`.
    pub messages: u64,
    pub stop: watch::Receiver<bool>,
    /// After the last message, how long to wait for outstanding confirms.
    pub drain: Duration,
    /// Header `x-delay` on every message (0: none).
    pub delay_ms: u32,
}

/// Most bytes of messages encoded into one socket write (without confirms; with confirms the window
/// bounds a batch too).
const BATCH_BYTES: usize = 4 << 20;

/// `sent_ns` marks a confirmed slot with this.
const DONE: u64 = u64::MAX;

/// One message, encoded: basic.publish, the content header, the body frames. The timestamp and the
/// sequence number go at `head_at` (the first bytes of the first body frame's payload).
struct Template {
    bytes: Vec<u8>,
    head_at: usize,
    head_len: usize,
}

fn templates(cfg: &ProducerConfig, frame_max: u32) -> Vec<Template> {
    let mut props = BytesMut::new();
    let headers = (cfg.delay_ms > 0).then(|| {
        let mut h = warren_protocol::field::FieldTable::new();
        h.insert("x-delay".to_string(), warren_protocol::field::FieldValue::I64(i64::from(cfg.delay_ms)));
        h
    });
    let p = BasicProperties { delivery_mode: Some(if cfg.persistent { 2 } else { 1 }), headers, ..Default::default() };
    p.encode(&mut props);
    let body = vec![0u8; cfg.size];
    cfg.routing_keys
        .iter()
        .map(|rk| {
            let mut b = BytesMut::with_capacity(cfg.size + 256);
            let publish = BasicPublish {
                reserved_1: 0,
                exchange: cfg.exchange.clone(),
                routing_key: rk.clone(),
                mandatory: cfg.mandatory,
                immediate: false,
            };
            frame::write_method(&mut b, 1, &Method::BasicPublish(publish));
            let content_at = b.len();
            frame::write_content(&mut b, 1, CLASS_BASIC, &props, &body, frame_max);
            // The header frame: envelope (7), class, weight (4), body size (8), properties, frame end.
            let first_body_frame = (frame_max.saturating_sub(FRAME_OVERHEAD) as usize).max(1);
            let head_len = cfg.size.min(16).min(first_body_frame);
            let head_at = if head_len == 0 { 0 } else { content_at + 7 + 12 + props.len() + 1 + 7 };
            Template { bytes: b.to_vec(), head_at, head_len }
        })
        .collect()
}

/// Unconfirmed messages: delivery tag `base + i` was sent at `sent_ns[i]` (`DONE` once confirmed).
struct Window {
    base: u64,
    sent_ns: VecDeque<u64>,
    outstanding: u64,
}

impl Window {
    /// Settles `tag` (and every earlier tag, if `multiple`), pushing each one's latency in ns;
    /// returns how many were settled.
    fn settle(&mut self, tag: u64, multiple: bool, now: u64, lat: &mut Vec<u64>) -> u64 {
        let mut n = 0;
        if multiple {
            while self.base <= tag {
                let Some(t) = self.sent_ns.pop_front() else { break };
                self.base += 1;
                if t != DONE {
                    lat.push(now.saturating_sub(t));
                    n += 1;
                }
            }
        } else if tag >= self.base {
            if let Some(slot) = self.sent_ns.get_mut((tag - self.base) as usize) {
                if *slot != DONE {
                    lat.push(now.saturating_sub(*slot));
                    *slot = DONE;
                    n += 1;
                }
            }
            while self.sent_ns.front() == Some(&DONE) {
                self.sent_ns.pop_front();
                self.base += 1;
            }
        }
        self.outstanding -= n;
        n
    }
}

pub async fn run(mut cfg: ProducerConfig, stats: Arc<Stats>) -> Result<(), Error> {
    let mut conn = Conn::open(&cfg.uri, &format!("warren-bench producer {}", cfg.id)).await?;
    let confirms = cfg.confirm > 0;
    if confirms {
        match conn.call(Method::ConfirmSelect(ConfirmSelect { nowait: false })).await? {
            Method::ConfirmSelectOk(_) => {}
            other => return Err(format!("expected confirm.select-ok, got {}", other.name()).into()),
        }
    }
    let templates = templates(&cfg, conn.frame_max);
    let per_msg = templates.iter().map(|t| t.bytes.len()).max().unwrap_or(1);
    let batch_cap = (BATCH_BYTES / per_msg).max(1) as u64;
    let mut wbuf: Vec<u8> = Vec::with_capacity(per_msg * batch_cap.min(if confirms { cfg.confirm as u64 } else { u64::MAX }) as usize);
    let mut wpos = 0;
    let mut window = Window { base: 1, sent_ns: VecDeque::with_capacity(cfg.confirm as usize), outstanding: 0 };
    let mut lat: Vec<u64> = Vec::with_capacity(1024);
    let mut reply = BytesMut::new();
    let mut seq: u64 = 0;
    let mut rr = 0;
    let mut done_sending = *cfg.stop.borrow();
    let mut drain_until: Option<Instant> = None;
    let mut need = 0;
    let mut blocked = false;
    let frame_max = conn.frame_max;
    let start = Instant::now();

    let result: Result<(), Error> = async {
        let (mut rh, mut wh) = conn.stream.split();
        loop {
            if wpos == wbuf.len() && !done_sending {
                wbuf.clear();
                wpos = 0;
                let mut n: u64 = batch_cap;
                if cfg.messages > 0 {
                    n = n.min(cfg.messages - seq);
                }
                if confirms {
                    n = n.min(cfg.confirm as u64 - window.outstanding);
                }
                if cfg.rate > 0.0 {
                    let due = (start.elapsed().as_secs_f64() * cfg.rate) as u64 + 1;
                    n = n.min(due.saturating_sub(seq));
                }
                // One timestamp for the batch: its messages go out in the same socket write.
                let ts = if n > 0 { now_ns() } else { 0 };
                // In the body: the wall clock's time for delayed messages (see `wall_ns`).
                let body_ts = if n > 0 && cfg.delay_ms > 0 { wall_ns() } else { ts };
                for _ in 0..n {
                    let t = &templates[rr];
                    rr += 1;
                    if rr == templates.len() {
                        rr = 0;
                    }
                    let at = wbuf.len();
                    wbuf.extend_from_slice(&t.bytes);
                    let mut head = [0u8; 16];
                    head[..8].copy_from_slice(&body_ts.to_le_bytes());
                    head[8..].copy_from_slice(&seq.to_le_bytes());
                    wbuf[at + t.head_at..at + t.head_at + t.head_len].copy_from_slice(&head[..t.head_len]);
                    if confirms {
                        window.sent_ns.push_back(ts);
                    }
                    seq += 1;
                }
                if confirms {
                    window.outstanding += n;
                }
                Counters::add(&stats.counters.sent, n);
                if cfg.messages > 0 && seq >= cfg.messages {
                    done_sending = true;
                }
            }
            let writing = wpos < wbuf.len();
            if done_sending && !writing {
                if window.outstanding == 0 {
                    stats.mark(now_ns());
                    return Ok(());
                }
                let until = *drain_until.get_or_insert_with(|| Instant::now() + cfg.drain);
                if Instant::now() >= until {
                    report!(
                        "warren bench: producer {}: {} messages still unconfirmed {} s after the last was sent",
                        cfg.id,
                        window.outstanding,
                        cfg.drain.as_secs()
                    );
                    return Ok(());
                }
            }
            // With --rate and nothing due yet: when the next message is.
            let rate_wait = (cfg.rate > 0.0 && !done_sending && !writing && (!confirms || window.outstanding < cfg.confirm as u64))
                .then(|| start + Duration::from_secs_f64(seq as f64 / cfg.rate));
            tokio::select! {
                biased;
                r = rh.read(conn.rb.spare(need)) => {
                    let n = r?;
                    if n == 0 {
                        return Err("the broker closed the socket".into());
                    }
                    conn.rb.filled_by(n);
                    let now = now_ns();
                    let (mut confirmed, mut nacked, mut returned) = (0, 0, 0);
                    loop {
                        match client::next_frame(conn.rb.filled(), frame_max)? {
                            Next::Need(total) => {
                                need = total - conn.rb.filled().len();
                                break;
                            }
                            Next::Frame(f, len) => {
                                if f.kind == FRAME_METHOD {
                                    match Method::decode(f.payload)? {
                                        Method::BasicAck(a) => confirmed += window.settle(a.delivery_tag, a.multiple, now, &mut lat),
                                        Method::BasicNack(a) => nacked += window.settle(a.delivery_tag, a.multiple, now, &mut lat),
                                        Method::BasicReturn(_) => returned += 1,
                                        Method::ConnectionBlocked(b) => {
                                            if !blocked {
                                                report!("warren bench: producer {}: the broker blocked the connection: {}", cfg.id, b.reason);
                                            }
                                            blocked = true;
                                        }
                                        Method::ConnectionUnblocked(_) => blocked = false,
                                        Method::ChannelFlow(fl) => {
                                            frame::write_method(&mut reply, 1, &Method::ChannelFlowOk(ChannelFlowOk { active: fl.active }));
                                        }
                                        m => {
                                            if let Some(why) = closed_by_broker(&m) {
                                                let ok = match m {
                                                    Method::ConnectionClose(_) => (0, Method::ConnectionCloseOk(ConnectionCloseOk {})),
                                                    _ => (1, Method::ChannelCloseOk(ChannelCloseOk {})),
                                                };
                                                if wpos == wbuf.len() {
                                                    frame::write_method(&mut reply, ok.0, &ok.1);
                                                    let _ = wh.write_all(&reply).await;
                                                }
                                                return Err(why.into());
                                            }
                                        }
                                    }
                                }
                                conn.rb.consume(len);
                            }
                        }
                    }
                    if !lat.is_empty() {
                        stats.confirm.lock().record_ns(&lat);
                        lat.clear();
                    }
                    Counters::add(&stats.counters.confirmed, confirmed);
                    Counters::add(&stats.counters.nacked, nacked);
                    Counters::add(&stats.counters.returned, returned);
                    // channel.flow-ok goes out between batches (never inside a message's frames).
                    if !reply.is_empty() && !writing {
                        wh.write_all(&reply).await?;
                        reply.clear();
                    }
                }
                r = wh.write(&wbuf[wpos..]), if writing => {
                    let n = r?;
                    if n == 0 {
                        return Err("the socket stopped accepting writes".into());
                    }
                    wpos += n;
                }
                _ = tokio::time::sleep_until(rate_wait.unwrap_or(start)), if rate_wait.is_some() => {}
                _ = cfg.stop.changed(), if !done_sending => {
                    done_sending = true;
                }
                _ = tokio::time::sleep_until(drain_until.unwrap_or(start)), if drain_until.is_some() => {}
            }
        }
    }
    .await;
    match result {
        Ok(()) => {
            conn.close().await;
            Ok(())
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{next_frame, ReadBuf};
    use warren_protocol::constants::{FRAME_BODY, FRAME_HEADER};

    fn cfg(size: usize) -> ProducerConfig {
        ProducerConfig {
            uri: Uri::parse("amqp://h").unwrap(),
            id: 0,
            routing_keys: vec!["q-0".into(), "queue-1".into()],
            exchange: String::new(),
            size,
            persistent: true,
            mandatory: false,
            confirm: 0,
            rate: 0.0,
            messages: 0,
            stop: watch::channel(false).1,
            drain: Duration::from_secs(1),
            delay_ms: 0,
        }
    }

    /// The template is what the codec itself would write, and the head lands at the body's start.
    #[test]
    fn template_is_a_publish_with_its_content() {
        for (size, frame_max) in [(1000, 131_072), (0, 131_072), (10, 4096), (10_000, 4096), (16, 4096)] {
            for t in templates(&cfg(size), frame_max) {
                let mut bytes = t.bytes.clone();
                bytes[t.head_at..t.head_at + t.head_len].copy_from_slice(&[0xAB; 16][..t.head_len]);
                let mut rest = &bytes[..];
                let mut frames = vec![];
                while !rest.is_empty() {
                    let Next::Frame(f, len) = next_frame(rest, frame_max).unwrap() else { panic!("partial") };
                    frames.push((f.kind, f.payload.to_vec()));
                    rest = &rest[len..];
                }
                let Method::BasicPublish(p) = Method::decode(&frames[0].1).unwrap() else { panic!() };
                assert!(p.routing_key == "q-0" || p.routing_key == "queue-1");
                assert_eq!(frames[1].0, FRAME_HEADER);
                assert_eq!(u64::from_be_bytes(frames[1].1[4..12].try_into().unwrap()), size as u64);
                let props = BasicProperties::decode(&frames[1].1[12..]).unwrap();
                assert_eq!(props.delivery_mode, Some(2));
                let body: Vec<u8> = frames[2..].iter().inspect(|f| assert_eq!(f.0, FRAME_BODY)).flat_map(|f| f.1.clone()).collect();
                assert_eq!(body.len(), size);
                assert!(body[..t.head_len].iter().all(|b| *b == 0xAB));
                assert!(body[t.head_len..].iter().all(|b| *b == 0));
            }
        }
        let _ = ReadBuf::new(1);
    }

    #[test]
    fn window_settles_single_multiple_and_out_of_order() {
        let mut w = Window { base: 1, sent_ns: (0..10).map(|i| i * 100).collect(), outstanding: 10 };
        let mut lat = vec![];
        assert_eq!(w.settle(3, false, 1000, &mut lat), 1);
        assert_eq!(lat, vec![800]);
        assert_eq!(w.base, 1);
        assert_eq!(w.settle(3, false, 1000, &mut lat), 0, "an ack twice counts once");
        assert_eq!(w.settle(5, true, 1000, &mut lat), 4);
        assert_eq!(w.base, 6);
        assert_eq!(w.settle(2, true, 1000, &mut lat), 0);
        assert_eq!(w.settle(6, false, 1000, &mut lat), 1);
        assert_eq!(w.base, 7);
        assert_eq!(w.settle(100, true, 1000, &mut lat), 4);
        assert_eq!((w.outstanding, w.sent_ns.len()), (0, 0));
        assert_eq!(lat.len(), 10);
    }
}
