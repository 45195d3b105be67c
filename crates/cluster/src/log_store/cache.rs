//! A group's recent entries in memory, so the reads that follow an append (replication to the
//! followers, then this node's apply) do not go to the store.
//!
//! A read from the store is a `pread` of the WAL extent the entry was written to, in chunks of up to
//! 4 MiB, which holds every other group's records in between: with 1,000 busy groups, reading back
//! each entry once to apply it (and once per follower on a leader) was most of a node's CPU (fresh
//! chunk buffers zeroed by page faults, copies). So an entry stays here until the store can read it
//! **and** this node has applied it **and** (on a leader) every replication stream has read it
//! ([`ReadMark`]), unless the group holds more than [`GROUP_CACHE_BYTES`] or the node more than
//! [`NODE_CACHE_BYTES`] (a follower that never learns the commit, a lagging state machine, a
//! follower that is down): then the oldest readable entries go first. Entries the store cannot read
//! yet always stay (they exist nowhere else).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crate::types::Entry;

/// Readable entries of one group kept past this many record bytes are dropped oldest first.
pub(crate) const GROUP_CACHE_BYTES: u64 = 16 << 20;
/// Readable entries of all the node's groups kept past this many record bytes are dropped.
pub(crate) const NODE_CACHE_BYTES: u64 = 128 << 20;

/// The node-wide count of cached record bytes, shared by every group's cache.
#[derive(Default)]
pub(crate) struct CacheBudget {
    bytes: AtomicU64,
}

impl CacheBudget {
    pub(crate) fn over(&self) -> bool {
        self.bytes.load(Ordering::Relaxed) > NODE_CACHE_BYTES
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// Where one replication stream (to one follower, on a leader) last started a read: entries from
/// the lowest mark of a group's live streams on stay cached once applied. A leader commits an
/// entry with its faster follower's ack and applies it; the slower follower's stream reads it
/// after that, and from the store that read is a `pread` of the files the entry was copied to
/// (with 1,000 busy groups, 5% of a leader's time).
pub(crate) struct ReadMark(AtomicU64);

impl ReadMark {
    /// Not reading yet: holds nothing back.
    const NONE: u64 = u64::MAX;

    /// The stream reads from `index` on.
    pub(crate) fn set(&self, index: u64) {
        self.0.store(index, Ordering::Relaxed);
    }
}

/// The read marks of a group's live log readers (a reader's mark goes with it).
#[derive(Default)]
pub(crate) struct ReadMarks(Vec<Weak<ReadMark>>);

impl ReadMarks {
    pub(crate) fn add(&mut self) -> Arc<ReadMark> {
        self.0.retain(|m| m.strong_count() > 0);
        let mark = Arc::new(ReadMark(AtomicU64::new(ReadMark::NONE)));
        self.0.push(Arc::downgrade(&mark));
        mark
    }

    /// The lowest index a live stream still reads, `u64::MAX` if none.
    pub(crate) fn lowest(&self) -> u64 {
        self.0.iter().filter_map(Weak::upgrade).map(|m| m.0.load(Ordering::Relaxed)).min().unwrap_or(ReadMark::NONE)
    }
}

/// Consecutive entries (the log's last ones) with their record sizes.
pub(crate) struct EntryCache {
    entries: VecDeque<(Entry, u64)>,
    bytes: u64,
    budget: Arc<CacheBudget>,
}

impl EntryCache {
    pub(crate) fn new(budget: Arc<CacheBudget>) -> EntryCache {
        EntryCache { entries: VecDeque::new(), bytes: 0, budget }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub(crate) fn get(&self, i: usize) -> Option<&Entry> {
        self.entries.get(i).map(|(e, _)| e)
    }

    /// Whether this group holds more than its share: readable entries go even if not applied.
    pub(crate) fn over(&self) -> bool {
        self.bytes > GROUP_CACHE_BYTES || self.budget.over()
    }

    pub(crate) fn push_back(&mut self, entry: Entry, bytes: u64) {
        self.entries.push_back((entry, bytes));
        self.add(bytes);
    }

    pub(crate) fn pop_front(&mut self) {
        if let Some((_, b)) = self.entries.pop_front() {
            self.sub(b);
        }
    }

    /// Keeps the first `len` entries.
    pub(crate) fn truncate(&mut self, len: usize) {
        while self.entries.len() > len {
            if let Some((_, b)) = self.entries.pop_back() {
                self.sub(b);
            }
        }
    }

    pub(crate) fn clear(&mut self) {
        self.truncate(0);
    }

    fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
        self.budget.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn sub(&mut self, bytes: u64) {
        self.bytes -= bytes;
        self.budget.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }
}

impl Drop for EntryCache {
    fn drop(&mut self) {
        self.budget.bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}
