//! A consumer: one connection, one task, consuming from its queues. Deliveries are parsed in place
//! from the read buffer (basic.deliver's delivery tag, the header's body size, the body's timestamp:
//! no allocation per message; other methods go through the codec); end-to-end latency comes from the
//! timestamp in each body; acks go out with `multiple` every N messages, once per socket read.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use warren_protocol::constants::{CLASS_BASIC, FRAME_BODY, FRAME_HEADER, FRAME_METHOD};
use warren_protocol::field::FieldTable;
use warren_protocol::frame;
use warren_protocol::method::*;

use crate::client::{self, closed_by_broker, method_ids, Conn, Error, Next, Uri};
use crate::stats::{now_ns, Counters, Stats};

pub struct ConsumerConfig {
    pub uri: Uri,
    pub id: usize,
    pub queues: Vec<String>,
    pub prefetch: u16,
    pub multi_ack_every: u64,
    pub auto_ack: bool,
    /// Messages to consume; 0: until `stop`.
    pub messages: u64,
    pub stop: watch::Receiver<bool>,
    /// Incremented once consuming has started (every basic.consume-ok is in).
    pub ready: Arc<AtomicUsize>,
    /// Messages were published with this delay: latency counts from the send time plus it.
    pub delay_ns: u64,
}

/// basic.deliver's delivery tag and redelivered bit, read in place: class, method, consumer tag
/// (short string), delivery tag, bits.
fn deliver_in_place(payload: &[u8]) -> Option<(u64, bool)> {
    let tag_len = *payload.get(4)? as usize;
    let at = 5 + tag_len;
    let tag = u64::from_be_bytes(payload.get(at..at + 8)?.try_into().ok()?);
    let redelivered = payload.get(at + 8)? & 1 == 1;
    Some((tag, redelivered))
}

/// Where a delivery is between its frames.
#[derive(Default)]
struct Delivery {
    tag: u64,
    /// basic.deliver seen, content not complete yet.
    open: bool,
    header_seen: bool,
    body_size: u64,
    body_left: u64,
    first_chunk: bool,
    sent_ns: Option<u64>,
}

pub async fn run(mut cfg: ConsumerConfig, stats: Arc<Stats>) -> Result<(), Error> {
    let mut conn = Conn::open(&cfg.uri, &format!("warren-bench consumer {}", cfg.id)).await?;
    if cfg.prefetch > 0 {
        match conn.call(Method::BasicQos(BasicQos { prefetch_size: 0, prefetch_count: cfg.prefetch, global: false })).await? {
            Method::BasicQosOk(_) => {}
            other => return Err(format!("expected basic.qos-ok, got {}", other.name()).into()),
        }
    }
    // All the basic.consumes at once; their consume-oks are picked out of the stream by the loop below
    // (with several queues, deliveries from the first may arrive before the last consume-ok).
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
        frame::write_method(&mut conn.wb, 1, &m);
    }
    conn.stream.write_all(&conn.wb).await?;
    conn.wb.clear();
    let mut pending_oks = cfg.queues.len();

    let every = cfg.multi_ack_every.max(1);
    let multiple = every > 1;
    let mut wbuf = BytesMut::with_capacity(4096);
    let mut wpos = 0;
    let mut lat: Vec<u64> = Vec::with_capacity(4096);
    let mut d = Delivery::default();
    let mut consumed: u64 = 0;
    let mut bytes: u64 = 0;
    let mut unacked: u64 = 0;
    let mut last_tag: u64 = 0;
    let mut need = 0;
    let mut done = *cfg.stop.borrow();
    let frame_max = conn.frame_max;

    let result: Result<(), Error> = async {
        let (mut rh, mut wh) = conn.stream.split();
        while !done {
            let writing = wpos < wbuf.len();
            tokio::select! {
                biased;
                r = rh.read(conn.rb.spare(need)) => {
                    let n = r?;
                    if n == 0 {
                        return Err("the broker closed the socket".into());
                    }
                    conn.rb.filled_by(n);
                    // Delayed messages carry the wall clock's send time (`stats::wall_ns`).
                    let now = if cfg.delay_ns > 0 { crate::stats::wall_ns() } else { now_ns() };
                    let (before, before_bytes, mut redelivered) = (consumed, bytes, 0);
                    loop {
                        let (f, len) = match client::next_frame(conn.rb.filled(), frame_max)? {
                            Next::Need(total) => {
                                need = total - conn.rb.filled().len();
                                break;
                            }
                            Next::Frame(f, len) => (f, len),
                        };
                        let mut complete = false;
                        match f.kind {
                            FRAME_METHOD => {
                                if method_ids(f.payload) == (CLASS_BASIC, 60) {
                                    let (tag, redo) = deliver_in_place(f.payload).ok_or("a truncated basic.deliver")?;
                                    d = Delivery { tag, open: true, ..Default::default() };
                                    redelivered += redo as u64;
                                } else {
                                    match Method::decode(f.payload)? {
                                        Method::BasicConsumeOk(_) => {
                                            pending_oks = pending_oks.saturating_sub(1);
                                            if pending_oks == 0 {
                                                cfg.ready.fetch_add(1, Ordering::Relaxed);
                                            }
                                        }
                                        Method::BasicCancel(c) => {
                                            return Err(format!("the broker cancelled consumer {} (queue deleted?)", c.consumer_tag).into());
                                        }
                                        Method::ChannelFlow(fl) => {
                                            frame::write_method(&mut wbuf, 1, &Method::ChannelFlowOk(ChannelFlowOk { active: fl.active }));
                                        }
                                        m => {
                                            if let Some(why) = closed_by_broker(&m) {
                                                let ok = match m {
                                                    Method::ConnectionClose(_) => (0, Method::ConnectionCloseOk(ConnectionCloseOk {})),
                                                    _ => (1, Method::ChannelCloseOk(ChannelCloseOk {})),
                                                };
                                                frame::write_method(&mut wbuf, ok.0, &ok.1);
                                                let _ = wh.write_all(&wbuf[wpos..]).await;
                                                return Err(why.into());
                                            }
                                        }
                                    }
                                }
                            }
                            FRAME_HEADER if d.open && !d.header_seen => {
                                let size = f.payload.get(4..12).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes);
                                d.body_left = size.ok_or("a truncated content header")?;
                                d.body_size = d.body_left;
                                d.header_seen = true;
                                d.first_chunk = true;
                                complete = d.body_left == 0;
                            }
                            FRAME_BODY if d.open && d.header_seen => {
                                if d.first_chunk {
                                    if let Some(ts) = f.payload.get(..8) {
                                        d.sent_ns = Some(u64::from_le_bytes(ts.try_into().unwrap_or_default()));
                                    }
                                    d.first_chunk = false;
                                }
                                d.body_left = d.body_left.saturating_sub(f.payload.len() as u64);
                                complete = d.body_left == 0;
                            }
                            FRAME_HEADER | FRAME_BODY => return Err("content frames outside a delivery".into()),
                            _ => {} // heartbeat
                        }
                        conn.rb.consume(len);
                        if complete {
                            d.open = false;
                            consumed += 1;
                            bytes += d.body_size;
                            last_tag = d.tag;
                            if let Some(due) = d.sent_ns.map(|ts| ts + cfg.delay_ns) {
                                if due <= now {
                                    lat.push(now - due);
                                } else if cfg.delay_ns > 0 {
                                    Counters::add(&stats.counters.early, 1);
                                }
                            }
                            if !cfg.auto_ack {
                                unacked += 1;
                                if unacked >= every {
                                    frame::write_basic_ack(&mut wbuf, 1, last_tag, multiple);
                                    unacked = 0;
                                }
                            }
                            if cfg.messages > 0 && consumed >= cfg.messages {
                                // What else has arrived is left unacked: the broker requeues it at close.
                                done = true;
                                break;
                            }
                        }
                    }
                    if !lat.is_empty() {
                        stats.e2e.lock().record_ns(&lat);
                        lat.clear();
                    }
                    if consumed > before {
                        Counters::add(&stats.counters.consumed, consumed - before);
                        Counters::add(&stats.counters.consumed_bytes, bytes - before_bytes);
                        stats.mark(now);
                    }
                    Counters::add(&stats.counters.redelivered, redelivered);
                }
                r = wh.write(&wbuf[wpos..]), if writing => {
                    let n = r?;
                    if n == 0 {
                        return Err("the socket stopped accepting writes".into());
                    }
                    wpos += n;
                    if wpos == wbuf.len() {
                        wbuf.clear();
                        wpos = 0;
                    }
                }
                _ = cfg.stop.changed() => done = true,
            }
        }
        // Ack what is left, then everything goes out before connection.close.
        if !cfg.auto_ack && unacked > 0 {
            frame::write_basic_ack(&mut wbuf, 1, last_tag, true);
        }
        wh.write_all(&wbuf[wpos..]).await?;
        Ok(())
    }
    .await;
    if pending_oks > 0 && result.is_ok() {
        cfg.ready.fetch_add(1, Ordering::Relaxed);
    }
    result?;
    conn.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deliver_parsed_in_place_matches_the_codec() {
        let mut out = BytesMut::new();
        frame::write_basic_deliver(&mut out, 1, "amq.ctag-xyz", 123_456_789, true, "ex", "rk", &[0, 0], b"body", 131_072);
        let client::Next::Frame(f, _) = client::next_frame(&out, 0).unwrap() else { panic!() };
        assert_eq!(method_ids(f.payload), (CLASS_BASIC, 60));
        assert_eq!(deliver_in_place(f.payload), Some((123_456_789, true)));
        let Method::BasicDeliver(m) = Method::decode(f.payload).unwrap() else { panic!() };
        assert_eq!((m.delivery_tag, m.redelivered), (123_456_789, true));
        for cut in 0..f.payload.len() {
            let ok = deliver_in_place(&f.payload[..cut]);
            assert!(ok.is_none() || cut > 5 + 12 + 8, "cut {cut}");
        }
    }
}
