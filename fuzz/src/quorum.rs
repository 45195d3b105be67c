//! The quorum-queue machine fuzz target (`warren_broker::quorum`): Raft entries and snapshots with
//! arbitrary bytes. Decoding may refuse, applying may refuse an entry, but nothing panics; and:
//! two machines applying the same entries give the same effects, replies and state; a snapshot
//! taken halfway, restored and fed the rest ends in the same state with the same effects; every
//! entry that decodes re-encodes to a fixpoint; every reply round-trips.
//!
//! Input: `config u8 | (len u16 LE | bytes)*`. `config` picks the queue's settings (bit 0
//! `x-max-length` 3, bit 1 `x-max-length-bytes` 50, bit 2 reject-publish, bit 3 delivery limit 1,
//! bit 4 `x-message-ttl` 100 ms, bit 5 a dead-letter exchange, bit 6 single active consumer;
//! `x-retention-seconds` 1 s unless bit 1); with
//! bit 7 the first chunk is a snapshot to restore first (refused: the input ends there). The other
//! chunks are the entries, applied at rising indexes.

use bytes::Bytes;
use warren_broker::quorum::{
    Attach, Command, ConsumerId, Encoder, Overflow, QueueConfig, QuorumMachine, Reply, SessionId,
};

fn config(bits: u8) -> QueueConfig {
    QueueConfig {
        max_length: (bits & 1 != 0).then_some(3),
        max_length_bytes: (bits & 2 != 0).then_some(50),
        overflow: if bits & 4 != 0 { Overflow::RejectPublish } else { Overflow::DropHead },
        delivery_limit: Some(if bits & 8 != 0 { 1 } else { 20 }),
        message_ttl_ms: (bits & 16 != 0).then_some(100),
        dead_letter: bits & 32 != 0,
        // With reject-publish a dead-lettering queue is at-least-once (drop-head keeps at-most-once
        // fuzzed).
        at_least_once: bits & 32 != 0 && bits & 4 != 0,
        single_active_consumer: bits & 64 != 0,
        expires_ms: Some(10_000),
        // Retention (and so rewinds) whenever there is no byte limit (a quorum queue refuses the
        // two together).
        retention_ms: (bits & 2 == 0).then_some(1_000),
    }
}

fn chunks(mut data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while data.len() >= 2 {
        let len = u16::from_le_bytes([data[0], data[1]]) as usize;
        let end = (2 + len).min(data.len());
        out.push(&data[2..end]);
        data = &data[end..];
    }
    out
}

fn check_encoding(entry: &[u8]) {
    let Ok(cmd) = Command::decode(entry) else { return };
    let once = cmd.encode(entry).expect("a decoded command re-encodes");
    let again = Command::decode(&once).expect("a re-encoded command decodes");
    let twice = again.encode(&once).expect("re-encodes again");
    assert_eq!(once, twice, "encoding is not a fixpoint");
}

pub fn check_quorum(data: &[u8]) {
    let Some((&bits, rest)) = data.split_first() else { return };
    let mut parts = chunks(rest);
    let mut a = QuorumMachine::new(config(bits));
    if bits & 128 != 0 {
        if parts.is_empty() {
            return;
        }
        if a.restore(parts.remove(0)).is_err() {
            return;
        }
    }
    let mut b = a.clone();
    let first = a.last_index().map_or(1, |l| l.saturating_add(1));
    let half = parts.len() / 2;
    let mut halfway = None;
    let mut tail = Vec::new();
    for (k, entry) in parts.iter().enumerate() {
        if k == half {
            halfway = Some(a.snapshot());
        }
        check_encoding(entry);
        let index = first.saturating_add(k as u64);
        let ra = a.apply(index, entry);
        let rb = b.apply(index, entry);
        assert_eq!(ra, rb, "two replicas disagree at entry {k}");
        assert_eq!(Reply::decode(&ra.1.encode()).expect("a reply decodes"), ra.1);
        if k >= half {
            tail.push(ra);
        }
    }
    assert_eq!(a, b);
    let snap = a.snapshot();
    assert_eq!(snap, b.snapshot());
    let mut restored = QuorumMachine::new(QueueConfig::default());
    restored.restore(&snap).expect("a machine's own snapshot restores");
    assert_eq!(restored, a, "restore does not rebuild the state");
    if let Some(h) = halfway {
        let mut c = QuorumMachine::new(QueueConfig::default());
        c.restore(&h).expect("a halfway snapshot restores");
        for (k, entry) in parts.iter().enumerate().skip(half) {
            let index = first.saturating_add(k as u64);
            assert_eq!(c.apply(index, entry), tail[k - half], "snapshot + replay differs at entry {k}");
        }
        assert_eq!(c.snapshot(), snap, "snapshot + replay ends elsewhere");
    }
}

fn framed(config: u8, entries: &[Bytes]) -> Vec<u8> {
    let mut out = vec![config];
    for e in entries {
        out.extend_from_slice(&(e.len() as u16).to_le_bytes());
        out.extend_from_slice(e);
    }
    out
}

/// A day in a queue's life, as entries: consumers, publishes (with a re-sent batch, and a
/// high-priority one), acks, requeues, rejects, ticks, a node down, dead letters settled, a purge.
fn scenario() -> Vec<Bytes> {
    let s = SessionId { node: 1, channel: 5 };
    let c1 = ConsumerId { node: 1, local: 1 };
    let c2 = ConsumerId { node: 2, local: 1 };
    let mut entries = Vec::new();
    let mut e = Encoder::new();
    e.attach(&Attach { consumer: c1, prefetch: 2, auto_ack: false, exclusive: false, priority: 0 });
    e.attach(&Attach { consumer: c2, prefetch: 0, auto_ack: true, exclusive: false, priority: 1 });
    e.credit(c2, 1);
    entries.push(e.finish());
    for (from, to, now) in [(1u64, 4u64, 1000u64), (3, 6, 1010), (7, 7, 1020)] {
        let mut e = Encoder::new();
        // The last one high-priority (its own lane).
        e.begin_enqueue(s, now, from == 7);
        for seq in from..=to {
            e.message(seq, 20, (seq == 5).then_some(30), format!("m{seq}").as_bytes()).expect("room");
        }
        entries.push(e.finish());
    }
    // Message ids of the first enqueue (entry 2): 2 << 16 | i.
    let id = |index: u64, i: u64| index << 16 | i;
    let mut e = Encoder::new();
    e.settle(c1, &[id(2, 1)]);
    e.return_(c1, &[id(2, 2)]);
    e.tick(1100, 1);
    entries.push(e.finish());
    let mut e = Encoder::new();
    e.discard(c1, &[id(2, 2), id(2, 3)]);
    e.dequeue(ConsumerId { node: 3, local: 9 }, false);
    e.consumer_down(1);
    entries.push(e.finish());
    let mut e = Encoder::new();
    e.detach(c2, true);
    e.session_end(s);
    e.touch(1200);
    // At-least-once: the rejected ones reached their target.
    e.dead_lettered(&[id(2, 2), id(2, 3)]);
    e.purge();
    e.tick(20_000, u64::MAX);
    entries.push(e.finish());
    entries
}

/// `(seed name, bytes)`.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let entries = scenario();
    let mut out = Vec::new();
    for (name, bits) in [("plain", 0u8), ("limits-dlx", 0b0010_1011), ("reject-ttl-sac", 0b0101_0101), ("dlx-at-least-once", 0b0010_0100)] {
        out.push((format!("scenario-{name}"), framed(bits, &entries)));
    }
    // Restored from a snapshot taken after the first four entries, then the rest.
    let mut m = QuorumMachine::new(config(0b0010_0001));
    for (k, entry) in entries.iter().take(4).enumerate() {
        m.apply(k as u64 + 1, entry);
    }
    let mut with_snapshot = vec![m.snapshot()];
    with_snapshot.extend(entries.iter().skip(4).cloned());
    out.push(("snapshot-then-entries".to_string(), framed(0b1010_0001, &with_snapshot)));
    out
}
