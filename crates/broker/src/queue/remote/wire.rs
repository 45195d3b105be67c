//! What nodes send each other about classic queues (`Rpc::Classic`): the requests, their answers,
//! in a versioned binary encoding the broker owns (the cluster only carries the bytes). Decoding
//! never panics: anything malformed (from a peer) is an error, and counts never size an allocation
//! beyond what the input could hold.
//!
//! Every request starts with `version u8 | op u8`. Names are `varint len | UTF-8`; a queue is named
//! by `vhost | name | id varint` (the id guards against a queue deleted and declared again).
//! - `PUBLISH` (to the home): `queue | count | count × (varint len | store encoding)`;
//!   answer `version | count | count × u8` (1: refused).
//! - `OPEN` (to the home): `queue | relay varint | tag | prefetch varint | no_ack | exclusive |
//!   priority zigzag`: a consumer of another node; answer empty.
//! - `SETTLE` (to the home): `relay | how u8 (0 ack, 1 requeue, 2 reject) | count | tags`.
//! - `CANCEL` (to the home): `relay`: no more deliveries; what the consumer holds stays held.
//! - `CLOSE` (to the home): `relay`: what the consumer holds goes back to the queue.
//! - `CHECK` (to the home): `count | relays`; answer `count | the relays it does not know`.
//! - `DELIVER` (from the home): `queue | relay | count | count × (tag varint | redelivered |
//!   varint len | store encoding)`; answer empty, or an error for a relay the node does not know.
//! - `GET` (to the home): `queue | relay | no_ack`: basic.get on another node, the message (if
//!   any) held on the home by a relay channel of its own until `SETTLE`; answer `version | found`
//!   then, if found, `tag varint | redelivered | remaining varint | varint len | store encoding`.
//! - `PURGE` (to the home): `queue`; answer `version | 1 | count` (the messages it removed).
//! - `STAT` (to the home): `queue`; answer `version | 2 | messages | consumers`.
//! - `REWIND` (to the home): `queue | to_ms varint`; answer `version | 3 | rewound | from_ms + 1
//!   (0: none) | clamped` (`Queue::rewind`). A node without it answers "unknown request".
//! - `STATS` (to the home): `count | count × queue`: the management API's lists and shows; answer
//!   `version | 4 × count | per queue: ready, unacknowledged, consumers, retained` (`u64::MAX`
//!   four times for a queue that does not live there). Unlike `STAT` it renews no x-expires. A
//!   node without it answers "unknown request".
//! - `MANAGEMENT` (to any node): `varint len | query`: the management API asking for this node's
//!   part of a cluster-wide answer (its connections, channels, consumers, itself) or to close one
//!   of its connections. The query and its answer are the server's (JSON, `http::mgmt::peers`);
//!   the broker only carries them. A node without it answers "unknown request".
//! - `REPLY`: `vhost | varint len | store encoding`: a direct reply for a consumer of this node.
//! - `APPLIED`: `index varint`: answered (empty) once this node has applied metadata-group entry
//!   `index` (a declaration's -ok waits for every reachable node: read-your-writes on each).

use bytes::{BufMut, Bytes, BytesMut};

use crate::queue::Settle;
use crate::quorum::codec::{err, put_bool, put_var, put_zigzag, DecodeError, Reader};

const VERSION: u8 = 1;

const OP_PUBLISH: u8 = 1;
const OP_OPEN: u8 = 2;
const OP_SETTLE: u8 = 3;
const OP_CANCEL: u8 = 4;
const OP_CLOSE: u8 = 5;
const OP_CHECK: u8 = 6;
const OP_DELIVER: u8 = 7;
const OP_GET: u8 = 8;
const OP_PURGE: u8 = 9;
const OP_STAT: u8 = 10;
const OP_REPLY: u8 = 11;
const OP_APPLIED: u8 = 12;
const OP_REWIND: u8 = 13;
const OP_STATS: u8 = 15; // 14 is time-plan.md's PUBLISH_DELAYED
const OP_MANAGEMENT: u8 = 16;

/// A queue as nodes name it to each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueRef {
    pub vhost: String,
    pub name: String,
    pub id: u64,
}

/// A delivery from the home to a consumer's node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relayed {
    /// The delivery tag on the home's relay channel.
    pub tag: u64,
    pub redelivered: bool,
    /// The message's store encoding (`crate::message::decode_stored`).
    pub message: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Publish { queue: QueueRef, messages: Vec<Bytes> },
    Open { queue: QueueRef, relay: u64, tag: String, prefetch: u32, no_ack: bool, exclusive: bool, priority: i32 },
    Settle { relay: u64, how: Settle, tags: Vec<u64> },
    Cancel { relay: u64 },
    Close { relay: u64 },
    Check { relays: Vec<u64> },
    Deliver { queue: QueueRef, relay: u64, deliveries: Vec<Relayed> },
    Get { queue: QueueRef, relay: u64, no_ack: bool },
    Purge { queue: QueueRef },
    /// A queue.declare on another node: the counts for its declare-ok. The home takes it as a
    /// declare of its own: it renews the queue's x-expires.
    Stat { queue: QueueRef },
    /// The counts of classic queues living on the asked node, for the management API (`STATS`).
    Stats { queues: Vec<QueueRef> },
    /// A rewind asked of another node (the management API, CMQ).
    Rewind { queue: QueueRef, to_ms: u64 },
    /// The management API's question to this node about its own part of a cluster-wide answer.
    Management { query: Bytes },
    /// A direct reply (`amq.rabbitmq.reply-to.n<node>.…`) published on another node, for the reply
    /// consumer on this one: the message in its store encoding.
    Reply { vhost: String, message: Bytes },
    /// Answer once this node has applied metadata-group entry `index` (or fail after a while).
    Applied { index: u64 },
}

/// The home's answer to `GET` when it had a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GotMessage {
    pub delivery: Relayed,
    /// Messages still ready on the home (basic.get-ok's message-count).
    pub remaining: u32,
}

fn put_str(out: &mut BytesMut, s: &str) {
    put_var(out, s.len() as u64);
    out.put_slice(s.as_bytes());
}

fn put_queue(out: &mut BytesMut, q: &QueueRef) {
    put_str(out, &q.vhost);
    put_str(out, &q.name);
    put_var(out, q.id);
}

fn put_blob(out: &mut BytesMut, b: &[u8]) {
    put_var(out, b.len() as u64);
    out.put_slice(b);
}

fn settle_code(how: Settle) -> u8 {
    match how {
        Settle::Ack => 0,
        Settle::Reject { requeue: true } => 1,
        Settle::Reject { requeue: false } => 2,
    }
}

impl Request {
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(64);
        out.put_u8(VERSION);
        match self {
            Request::Publish { queue, messages } => {
                out.reserve(messages.iter().map(|m| m.len() + 5).sum());
                out.put_u8(OP_PUBLISH);
                put_queue(&mut out, queue);
                put_var(&mut out, messages.len() as u64);
                for m in messages {
                    put_blob(&mut out, m);
                }
            }
            Request::Open { queue, relay, tag, prefetch, no_ack, exclusive, priority } => {
                out.put_u8(OP_OPEN);
                put_queue(&mut out, queue);
                put_var(&mut out, *relay);
                put_str(&mut out, tag);
                put_var(&mut out, *prefetch as u64);
                put_bool(&mut out, *no_ack);
                put_bool(&mut out, *exclusive);
                put_zigzag(&mut out, *priority as i64);
            }
            Request::Settle { relay, how, tags } => {
                out.put_u8(OP_SETTLE);
                put_var(&mut out, *relay);
                out.put_u8(settle_code(*how));
                put_var(&mut out, tags.len() as u64);
                for t in tags {
                    put_var(&mut out, *t);
                }
            }
            Request::Cancel { relay } => {
                out.put_u8(OP_CANCEL);
                put_var(&mut out, *relay);
            }
            Request::Close { relay } => {
                out.put_u8(OP_CLOSE);
                put_var(&mut out, *relay);
            }
            Request::Check { relays } => {
                out.put_u8(OP_CHECK);
                put_var(&mut out, relays.len() as u64);
                for r in relays {
                    put_var(&mut out, *r);
                }
            }
            Request::Deliver { queue, relay, deliveries } => {
                out.reserve(deliveries.iter().map(|d| d.message.len() + 16).sum());
                out.put_u8(OP_DELIVER);
                put_queue(&mut out, queue);
                put_var(&mut out, *relay);
                put_var(&mut out, deliveries.len() as u64);
                for d in deliveries {
                    put_var(&mut out, d.tag);
                    put_bool(&mut out, d.redelivered);
                    put_blob(&mut out, &d.message);
                }
            }
            Request::Get { queue, relay, no_ack } => {
                out.put_u8(OP_GET);
                put_queue(&mut out, queue);
                put_var(&mut out, *relay);
                put_bool(&mut out, *no_ack);
            }
            Request::Purge { queue } => {
                out.put_u8(OP_PURGE);
                put_queue(&mut out, queue);
            }
            Request::Stat { queue } => {
                out.put_u8(OP_STAT);
                put_queue(&mut out, queue);
            }
            Request::Stats { queues } => {
                out.put_u8(OP_STATS);
                put_var(&mut out, queues.len() as u64);
                for q in queues {
                    put_queue(&mut out, q);
                }
            }
            Request::Management { query } => {
                out.put_u8(OP_MANAGEMENT);
                put_blob(&mut out, query);
            }
            Request::Rewind { queue, to_ms } => {
                out.put_u8(OP_REWIND);
                put_queue(&mut out, queue);
                put_var(&mut out, *to_ms);
            }
            Request::Reply { vhost, message } => {
                out.reserve(message.len() + vhost.len() + 10);
                out.put_u8(OP_REPLY);
                put_str(&mut out, vhost);
                put_blob(&mut out, message);
            }
            Request::Applied { index } => {
                out.put_u8(OP_APPLIED);
                put_var(&mut out, *index);
            }
        }
        out.freeze()
    }

    pub fn decode(buf: &Bytes) -> Result<Request, DecodeError> {
        let mut r = Reader::new(buf);
        let version = r.u8()?;
        if version != VERSION {
            return err(format!("unknown classic queue request version {version}"));
        }
        let op = r.u8()?;
        let request = match op {
            OP_PUBLISH => {
                let queue = get_queue(&mut r)?;
                let count = r.count(1)?;
                let mut messages = Vec::with_capacity(count);
                for _ in 0..count {
                    messages.push(get_blob(&mut r, buf)?);
                }
                Request::Publish { queue, messages }
            }
            OP_OPEN => {
                let queue = get_queue(&mut r)?;
                let relay = r.var()?;
                let tag = get_str(&mut r)?;
                let prefetch = r.var_u32()?;
                let no_ack = r.bool()?;
                let exclusive = r.bool()?;
                let priority = i32::try_from(r.zigzag()?).or_else(|_| err("consumer priority out of range"))?;
                Request::Open { queue, relay, tag, prefetch, no_ack, exclusive, priority }
            }
            OP_SETTLE => {
                let relay = r.var()?;
                let how = match r.u8()? {
                    0 => Settle::Ack,
                    1 => Settle::Reject { requeue: true },
                    2 => Settle::Reject { requeue: false },
                    other => return err(format!("unknown settlement {other}")),
                };
                let count = r.count(1)?;
                let mut tags = Vec::with_capacity(count);
                for _ in 0..count {
                    tags.push(r.var()?);
                }
                Request::Settle { relay, how, tags }
            }
            OP_CANCEL => Request::Cancel { relay: r.var()? },
            OP_CLOSE => Request::Close { relay: r.var()? },
            OP_CHECK => {
                let count = r.count(1)?;
                let mut relays = Vec::with_capacity(count);
                for _ in 0..count {
                    relays.push(r.var()?);
                }
                Request::Check { relays }
            }
            OP_DELIVER => {
                let queue = get_queue(&mut r)?;
                let relay = r.var()?;
                let count = r.count(3)?;
                let mut deliveries = Vec::with_capacity(count);
                for _ in 0..count {
                    let tag = r.var()?;
                    let redelivered = r.bool()?;
                    let message = get_blob(&mut r, buf)?;
                    deliveries.push(Relayed { tag, redelivered, message });
                }
                Request::Deliver { queue, relay, deliveries }
            }
            OP_GET => Request::Get { queue: get_queue(&mut r)?, relay: r.var()?, no_ack: r.bool()? },
            OP_PURGE => Request::Purge { queue: get_queue(&mut r)? },
            OP_STAT => Request::Stat { queue: get_queue(&mut r)? },
            OP_STATS => {
                // A queue is at least three bytes (two empty names and an id).
                let count = r.count(3)?;
                let mut queues = Vec::with_capacity(count);
                for _ in 0..count {
                    queues.push(get_queue(&mut r)?);
                }
                Request::Stats { queues }
            }
            OP_REWIND => Request::Rewind { queue: get_queue(&mut r)?, to_ms: r.var()? },
            OP_MANAGEMENT => Request::Management { query: get_blob(&mut r, buf)? },
            OP_REPLY => Request::Reply { vhost: get_str(&mut r)?, message: get_blob(&mut r, buf)? },
            OP_APPLIED => Request::Applied { index: r.var()? },
            other => return err(format!("unknown classic queue request {other}")),
        };
        r.end()?;
        Ok(request)
    }
}

fn get_str(r: &mut Reader) -> Result<String, DecodeError> {
    let n = r.var()?;
    let n = r.check_count(n, 1)?;
    String::from_utf8(r.bytes(n)?.to_vec()).or_else(|_| err("a name is not UTF-8"))
}

fn get_queue(r: &mut Reader) -> Result<QueueRef, DecodeError> {
    Ok(QueueRef { vhost: get_str(r)?, name: get_str(r)?, id: r.var()? })
}

/// A length-prefixed part of `buf`, without copying.
fn get_blob(r: &mut Reader, buf: &Bytes) -> Result<Bytes, DecodeError> {
    let n = r.var()?;
    let n = r.check_count(n, 1)?;
    let start = r.pos();
    r.bytes(n)?;
    Ok(buf.slice(start..start + n))
}

/// A list of flags (the home's answer to `PUBLISH`: which messages it refused).
pub fn encode_flags(flags: &[bool]) -> Bytes {
    let mut out = BytesMut::with_capacity(8 + flags.len());
    out.put_u8(VERSION);
    put_var(&mut out, flags.len() as u64);
    for f in flags {
        out.put_u8(*f as u8);
    }
    out.freeze()
}

/// Decodes a list of flags; it must have `expected` of them.
pub fn decode_flags(buf: &[u8], expected: usize) -> Result<Vec<bool>, DecodeError> {
    let mut r = Reader::new(buf);
    let version = r.u8()?;
    if version != VERSION {
        return err(format!("unknown classic queue answer version {version}"));
    }
    let count = r.count(1)?;
    if count != expected {
        return err(format!("an answer for {count} messages to a batch of {expected}"));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(r.bool()?);
    }
    r.end()?;
    Ok(out)
}

/// The home's answer to `GET`.
pub fn encode_got(got: Option<&GotMessage>) -> Bytes {
    let mut out = BytesMut::with_capacity(16 + got.map_or(0, |g| g.delivery.message.len()));
    out.put_u8(VERSION);
    put_bool(&mut out, got.is_some());
    if let Some(g) = got {
        put_var(&mut out, g.delivery.tag);
        put_bool(&mut out, g.delivery.redelivered);
        put_var(&mut out, g.remaining as u64);
        put_blob(&mut out, &g.delivery.message);
    }
    out.freeze()
}

pub fn decode_got(buf: &Bytes) -> Result<Option<GotMessage>, DecodeError> {
    let mut r = Reader::new(buf);
    let version = r.u8()?;
    if version != VERSION {
        return err(format!("unknown classic queue answer version {version}"));
    }
    let got = if r.bool()? {
        let tag = r.var()?;
        let redelivered = r.bool()?;
        let remaining = r.var_u32()?;
        let message = get_blob(&mut r, buf)?;
        Some(GotMessage { delivery: Relayed { tag, redelivered, message }, remaining })
    } else {
        None
    };
    r.end()?;
    Ok(got)
}

/// A list of ids (the home's answer to `CHECK`: the relays it does not know), or of counts
/// (`PURGE`: how many it removed; `STAT`: messages and consumers).
pub fn encode_ids(ids: &[u64]) -> Bytes {
    let mut out = BytesMut::with_capacity(8 + 10 * ids.len());
    out.put_u8(VERSION);
    put_var(&mut out, ids.len() as u64);
    for id in ids {
        put_var(&mut out, *id);
    }
    out.freeze()
}

pub fn decode_ids(buf: &[u8]) -> Result<Vec<u64>, DecodeError> {
    let mut r = Reader::new(buf);
    let version = r.u8()?;
    if version != VERSION {
        return err(format!("unknown classic queue answer version {version}"));
    }
    let count = r.count(1)?;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(r.var()?);
    }
    r.end()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> QueueRef {
        QueueRef { vhost: "/".into(), name: "orders".into(), id: 42 }
    }

    #[test]
    fn every_request_round_trips_and_a_cut_or_garbage_one_is_an_error() {
        let requests = vec![
            Request::Publish { queue: queue(), messages: vec![Bytes::from_static(b"one"), Bytes::from(vec![7u8; 300]), Bytes::new()] },
            Request::Open { queue: queue(), relay: 1 << 40 | 7, tag: "ctag-1".into(), prefetch: 250, no_ack: false, exclusive: true, priority: -5 },
            Request::Settle { relay: 9, how: Settle::Reject { requeue: true }, tags: vec![1, 2, 300, u64::MAX] },
            Request::Settle { relay: 9, how: Settle::Ack, tags: vec![] },
            Request::Cancel { relay: 3 },
            Request::Close { relay: 4 },
            Request::Check { relays: vec![1, 2, 3] },
            Request::Deliver {
                queue: queue(),
                relay: 5,
                deliveries: vec![Relayed { tag: 1, redelivered: false, message: Bytes::from_static(b"m1") }, Relayed { tag: 2, redelivered: true, message: Bytes::new() }],
            },
            Request::Get { queue: queue(), relay: 1 << 33 | 2, no_ack: true },
            Request::Purge { queue: queue() },
            Request::Stat { queue: queue() },
            Request::Stats { queues: vec![queue(), QueueRef { vhost: String::new(), name: "q2".into(), id: 0 }] },
            Request::Stats { queues: vec![] },
            Request::Rewind { queue: queue(), to_ms: 1_764_412_800_000 },
            Request::Management { query: Bytes::from_static(br#"{"list":"connections"}"#) },
            Request::Management { query: Bytes::new() },
            Request::Reply { vhost: "/".into(), message: Bytes::from_static(b"a reply") },
            Request::Applied { index: u64::MAX },
        ];
        for req in requests {
            let bytes = req.encode();
            assert_eq!(Request::decode(&bytes).unwrap(), req);
            for cut in 0..bytes.len() {
                assert!(Request::decode(&bytes.slice(..cut)).is_err(), "{req:?} cut at {cut} bytes");
            }
            let mut longer = bytes.to_vec();
            longer.push(0);
            assert!(Request::decode(&Bytes::from(longer)).is_err());
        }
        // A count far beyond the input must not allocate for it.
        let huge = Bytes::from(vec![VERSION, OP_CHECK, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(Request::decode(&huge).is_err());
        for seed in 0..5000u32 {
            let junk: Vec<u8> = (0..(seed % 80)).map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i * 97) >> 7) as u8).collect();
            let mut framed = vec![VERSION, (seed % 12) as u8];
            framed.extend_from_slice(&junk);
            let _ = Request::decode(&Bytes::from(framed));
            let _ = decode_flags(&junk, 3);
            let _ = decode_ids(&junk);
            let _ = decode_got(&Bytes::from(junk));
        }
    }

    #[test]
    fn answers_round_trip() {
        let flags = encode_flags(&[false, true, false]);
        assert_eq!(decode_flags(&flags, 3).unwrap(), vec![false, true, false]);
        assert!(decode_flags(&flags, 2).is_err(), "an answer must cover the batch it answers");
        assert!(decode_flags(&flags[..flags.len() - 1], 3).is_err());
        let ids = encode_ids(&[5, 1 << 50]);
        assert_eq!(decode_ids(&ids).unwrap(), vec![5, 1 << 50]);
        assert!(decode_ids(&ids[..ids.len() - 1]).is_err());
        let got = GotMessage { delivery: Relayed { tag: 7, redelivered: true, message: Bytes::from_static(b"body") }, remaining: 12 };
        let bytes = encode_got(Some(&got));
        assert_eq!(decode_got(&bytes).unwrap(), Some(got));
        for cut in 0..bytes.len() {
            assert!(decode_got(&bytes.slice(..cut)).is_err());
        }
        assert_eq!(decode_got(&encode_got(None)).unwrap(), None);
    }
}
