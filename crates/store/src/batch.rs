//! [`Batch`]: the records one caller appends at once, encoded outside the store's lock.

use crate::format::{self, ENQUEUE_FIXED_LEN, MAX_BODY_LEN};

/// Enqueues, acks and queue drops to append together (one ticket, one copy into the write buffer).
/// Reuse a batch with [`Batch::clear`] to keep its allocations.
#[derive(Debug, Default)]
pub struct Batch {
    /// Encoded enqueue records.
    pub(crate) records: Vec<u8>,
    pub(crate) enqueues: usize,
    /// (queue, start, end, bytes): consecutive acks of one queue merge into one range.
    acks: Vec<(u64, u64, u64, u64)>,
    drops: Vec<u64>,
    /// (queue, up_to) delivered marks.
    delivered: Vec<(u64, u64)>,
    /// (queue, from, until) rewinds.
    rewinds: Vec<(u64, u64, u64)>,
    /// Encoded acks and drops, built by `seal` outside the store's lock.
    pub(crate) tail: Vec<u8>,
    /// Largest payload added, checked by `append` (enqueue itself cannot fail).
    pub(crate) largest_payload: usize,
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds message `seq` of `queue`. Seqs of a queue must increase from one append to the next (gaps
    /// are fine: skipped seqs count as gone). The payload is given in parts (e.g. header bytes and body) to
    /// avoid a concatenation copy.
    pub fn enqueue(&mut self, queue: u64, seq: u64, timestamp_ms: u64, payload_parts: &[&[u8]]) {
        let len = format::encode_enqueue(&mut self.records, queue, seq, timestamp_ms, payload_parts);
        self.largest_payload = self.largest_payload.max(len);
        self.enqueues += 1;
    }

    /// Records that message `seq` of `queue`, of `bytes` payload bytes, is gone (acked, rejected, expired,
    /// purged...). Acking twice, or a seq the store never had, is harmless but miscounts bytes.
    pub fn ack(&mut self, queue: u64, seq: u64, bytes: u64) {
        self.ack_range(queue, seq, seq + 1, bytes);
    }

    /// Records that seqs `[start, end)` of `queue`, `bytes` payload bytes in all, are gone.
    pub fn ack_range(&mut self, queue: u64, start: u64, end: u64, bytes: u64) {
        if start >= end {
            return;
        }
        if let Some(last) = self.acks.last_mut() {
            if last.0 == queue && last.2 == start {
                last.2 = end;
                last.3 += bytes;
                return;
            }
        }
        self.acks.push((queue, start, end, bytes));
    }

    /// Records that seqs of `queue` below `up_to` may have been delivered to a consumer: after a restart
    /// they come back with the redelivered flag, the others without. Marks only ever rise.
    pub fn delivered(&mut self, queue: u64, up_to: u64) {
        self.delivered.push((queue, up_to));
    }

    /// Makes the gone seqs of `queue` in `[from, until)` that are still on disk live again (a rewind:
    /// see `QueueLog::rewind`); [`crate::Store::take_rewound`] tells which, once it is readable.
    /// Applied after the batch's acks and delivered marks.
    pub fn rewind(&mut self, queue: u64, from: u64, until: u64) {
        self.rewinds.push((queue, from, until));
    }

    /// Records that `queue` was deleted: its files go, later acks for it are ignored.
    pub fn drop_queue(&mut self, queue: u64) {
        self.drops.push(queue);
    }

    pub fn is_empty(&self) -> bool {
        self.enqueues == 0 && self.acks.is_empty() && self.drops.is_empty() && self.delivered.is_empty() && self.rewinds.is_empty()
    }

    pub fn clear(&mut self) {
        self.records.clear();
        self.enqueues = 0;
        self.acks.clear();
        self.drops.clear();
        self.delivered.clear();
        self.rewinds.clear();
        self.tail.clear();
        self.largest_payload = 0;
    }

    /// Encodes acks and drops into `tail` (acks grouped per queue, in the order given).
    pub(crate) fn seal(&mut self) {
        self.tail.clear();
        let mut i = 0;
        let mut ranges = Vec::new();
        while i < self.acks.len() {
            let queue = self.acks[i].0;
            let mut bytes = 0;
            ranges.clear();
            while i < self.acks.len() && self.acks[i].0 == queue {
                ranges.push((self.acks[i].1, self.acks[i].2));
                bytes += self.acks[i].3;
                i += 1;
            }
            format::encode_acks(&mut self.tail, queue, bytes, &ranges);
        }
        for &(q, up_to) in &self.delivered {
            format::encode_delivered(&mut self.tail, q, up_to);
        }
        for &(q, from, until) in &self.rewinds {
            format::encode_rewind(&mut self.tail, q, from, until);
        }
        for &q in &self.drops {
            format::encode_drop(&mut self.tail, q);
        }
    }

    pub(crate) fn record_count(&self) -> u64 {
        (self.enqueues + self.acks.len() + self.drops.len() + self.delivered.len() + self.rewinds.len()) as u64
    }

    pub(crate) fn max_payload() -> usize {
        MAX_BODY_LEN - ENQUEUE_FIXED_LEN
    }
}
