//! Retention of a quorum queue (`x-retention-seconds`) and its rewind, in the machine's state.
//!
//! A consumed message (acked, settled by an auto-ack delivery, rejected, expired, dropped or
//! dead-lettered: whatever left the queue, as a classic queue's store keeps every consumed record)
//! whose publish time is within the retention is *kept*: its id stays in [`Retained::kept`], and
//! its body stays in its Raft entry, which each replica keeps pinned in its log (the machine holds
//! no body). A rewind moves the kept ids from a point in time on back to the queue, as ready
//! messages with the redelivered flag (`ready::Lane::rewound`).
//!
//! No time per message: [`Retained::samples`] holds the first id enqueued in each step of the
//! machine's clock (step `max(1 ms, retention / 65,536)`, so at most ~65,537 samples, ~1 MiB, per
//! queue). Ids rise with time (a message is dated by its enqueue, never before the machine's clock,
//! and the dates are made monotonic here), so the ids of a sample up to the next were enqueued
//! within one step of the sample's time. A rewind to `t` starts at the first sample whose step
//! reaches `t` (exact with a 1 ms step, i.e. a retention up to 65 s; longer ones may bring back
//! messages up to one step older than `t`, never miss one); retention ends a
//! sample's messages once the next sample is older than the retention, and ids below the first
//! sample left (`floor`) are no longer kept.
//!
//! Ids are kept as runs ([`IdSet`]), like the fresh messages: acks mostly come in id order, so the
//! messages of one entry, or the single messages of consecutive entries, share a run.

use super::command::MsgId;
use super::ready::{Run, NEVER};
use std::collections::{BTreeMap, VecDeque};

/// At most about this many time samples per queue (the step grows with the retention).
pub const MAX_SAMPLES: u64 = 65_536;

/// A set of message ids as runs of step 1 (the messages of one entry) or 2^16 (the first message
/// of consecutive entries), each with one expiry, keyed by their first id. Runs never interleave:
/// each run's span `[first, last]` holds no id of another run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdSet {
    runs: BTreeMap<MsgId, Run>,
    len: u64,
}

/// `a` then `b` as one run, if `b` continues `a` with the same step and expiry.
fn join(a: &Run, b: &Run) -> Option<Run> {
    if a.expires_at != b.expires_at || b.first <= a.last() {
        return None;
    }
    let gap = b.first - a.last();
    if gap != 1 && gap != 1 << 16 {
        return None;
    }
    if (a.count > 1 && a.step() != gap) || (b.count > 1 && b.step() != gap) {
        return None;
    }
    let count = a.count.checked_add(b.count)?;
    Some(Run { first: a.first, count, per_entry: gap == 1 << 16, expires_at: a.expires_at })
}

/// A run of `count` ids from `first` with `step` (a run of one has step 1).
fn run(first: MsgId, count: u32, step: u64, expires_at: u64) -> Run {
    Run { first, count, per_entry: count > 1 && step != 1, expires_at }
}

impl IdSet {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runs, in id order.
    pub fn runs(&self) -> impl ExactSizeIterator<Item = &Run> + '_ {
        self.runs.values()
    }

    /// How many runs (memory: ~60 B each).
    pub fn run_count(&self) -> usize {
        self.runs.len()
    }

    pub fn first(&self) -> Option<(MsgId, u64)> {
        self.runs.values().next().map(|r| (r.first, r.expires_at))
    }

    pub fn contains(&self, id: MsgId) -> bool {
        let Some((_, r)) = self.runs.range(..=id).next_back() else { return false };
        let offset = id - r.first;
        offset % r.step() == 0 && offset / r.step() < r.count as u64
    }

    /// The ids at or above `from`, in order.
    pub fn ids_from(&self, from: MsgId) -> impl Iterator<Item = MsgId> + '_ {
        let start = self.runs.range(..=from).next_back().filter(|(_, r)| r.last() >= from).map_or(from, |(&first, _)| first);
        self.runs.range(start..).flat_map(move |(_, r)| {
            // The first run may start below `from`: its ids from there on.
            let skip = if r.first < from { (from - r.first).div_ceil(r.step()) } else { 0 };
            (skip..r.count as u64).map(move |k| r.first + k * r.step())
        })
    }

    /// Every id, in order.
    pub fn ids(&self) -> impl Iterator<Item = MsgId> + '_ {
        self.runs.values().flat_map(Run::ids)
    }

    /// Adds `id` (with `expires_at`); false if it was there.
    pub fn insert(&mut self, id: MsgId, expires_at: u64) -> bool {
        if let Some((&first, &r)) = self.runs.range(..=id).next_back() {
            if id <= r.last() {
                let offset = id - first;
                if offset % r.step() == 0 {
                    return false;
                }
                // Inside a per-entry run's span, between two of its ids: split it there.
                let below = (offset / r.step() + 1) as u32;
                self.runs.insert(first, run(first, below, r.step(), r.expires_at));
                let next = first + below as u64 * r.step();
                self.runs.insert(next, run(next, r.count - below, r.step(), r.expires_at));
            }
        }
        self.len += 1;
        self.put(run(id, 1, 1, expires_at));
        true
    }

    /// Adds a run whose span holds no id of the set, joining it to its neighbours where it
    /// continues them.
    fn put(&mut self, mut new: Run) {
        if let Some((&first, prev)) = self.runs.range(..new.first).next_back() {
            if let Some(joined) = join(prev, &new) {
                self.runs.remove(&first);
                new = joined;
            }
        }
        if let Some((&first, next)) = self.runs.range(new.first.saturating_add(1)..).next() {
            if let Some(joined) = join(&new, next) {
                self.runs.remove(&first);
                new = joined;
            }
        }
        self.runs.insert(new.first, new);
    }

    /// Adds every id of `other` (ids already here are not counted twice). Runs that meet nothing
    /// here go in whole; the others id by id.
    pub fn extend(&mut self, other: IdSet) {
        for r in other.runs.into_values() {
            let clear = self.runs.range(..=r.last()).next_back().is_none_or(|(_, x)| x.last() < r.first);
            if clear {
                self.len += r.count as u64;
                self.put(r);
            } else {
                for id in r.ids() {
                    self.insert(id, r.expires_at);
                }
            }
        }
    }

    /// Takes the first id, with its expiry.
    pub fn pop_first(&mut self) -> Option<(MsgId, u64)> {
        let (first, r) = self.runs.pop_first()?;
        if r.count > 1 {
            let next = first + r.step();
            self.runs.insert(next, run(next, r.count - 1, r.step(), r.expires_at));
        }
        self.len -= 1;
        Some((first, r.expires_at))
    }

    /// Removes and returns the ids at or above `from`.
    pub fn split_off(&mut self, from: MsgId) -> IdSet {
        let mut upper = self.runs.split_off(&from);
        if let Some((&first, &r)) = self.runs.range(..from).next_back() {
            if r.last() >= from {
                let below = (from - first).div_ceil(r.step()) as u32;
                self.runs.insert(first, run(first, below, r.step(), r.expires_at));
                let next = first + below as u64 * r.step();
                upper.insert(next, run(next, r.count - below, r.step(), r.expires_at));
            }
        }
        let upper_len = upper.values().map(|r| r.count as u64).sum();
        self.len -= upper_len;
        IdSet { runs: upper, len: upper_len }
    }

    /// Gives every id `expires_at`.
    pub fn set_expiry(&mut self, expires_at: u64) {
        let runs = std::mem::take(&mut self.runs);
        self.len = 0;
        for mut r in runs.into_values() {
            r.expires_at = expires_at;
            self.len += r.count as u64;
            self.put(r);
        }
    }

    /// Rebuilds from runs (a snapshot's): None if they are out of order, overlap, or are empty.
    pub fn from_runs(runs: impl IntoIterator<Item = Run>) -> Option<IdSet> {
        let mut set = IdSet::default();
        let mut last: Option<MsgId> = None;
        for r in runs {
            if r.count == 0 || last.is_some_and(|l| r.first <= l) || r.end() > u64::MAX as u128 || (r.count == 1 && r.per_entry) {
                return None;
            }
            last = Some(r.last());
            set.len += r.count as u64;
            set.runs.insert(r.first, r);
        }
        Some(set)
    }
}

/// What a queue with retention keeps of its consumed messages (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Retained {
    /// Consumed messages within the retention (expiry unused: [`NEVER`]).
    pub kept: IdSet,
    /// `(first id, time)` of each step of the clock that enqueued something, times rising.
    pub samples: VecDeque<(MsgId, u64)>,
    /// Ids below this are past the retention: never kept.
    pub floor: MsgId,
}

/// Where a rewind starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RewindPoint {
    pub from: MsgId,
    /// When the sample at `from` was taken (at or before the time asked, unless `clamped`).
    pub from_ms: u64,
    /// The time asked is before the oldest sample the retention keeps.
    pub clamped: bool,
}

/// The sampling step of a retention.
pub fn sample_step(retention_ms: u64) -> u64 {
    (retention_ms / MAX_SAMPLES).max(1)
}

impl Retained {
    /// A message `id` was enqueued at `at_ms`.
    pub fn enqueued(&mut self, retention_ms: u64, id: MsgId, at_ms: u64) {
        match self.samples.back() {
            Some(&(_, t)) if at_ms < t.saturating_add(sample_step(retention_ms)) => {}
            Some(&(_, t)) => self.samples.push_back((id, at_ms.max(t))),
            None => self.samples.push_back((id, at_ms)),
        }
    }

    /// A message left the queue: kept while its retention lasts.
    pub fn consumed(&mut self, id: MsgId) {
        if id >= self.floor {
            self.kept.insert(id, NEVER);
        }
    }

    /// The clock is `now_ms`: messages whose retention ended are no longer kept. `next_id` is
    /// above every id enqueued so far. Returns how many left.
    pub fn expire(&mut self, retention_ms: u64, now_ms: u64, next_id: MsgId) -> u64 {
        let ended = |t: u64| t.saturating_add(retention_ms) <= now_ms;
        // A sample's messages were enqueued before the next sample's time.
        while self.samples.len() >= 2 && ended(self.samples[1].1) {
            self.samples.pop_front();
        }
        // The last sample's messages came within one step of it.
        let all_ended = self.samples.len() == 1 && ended(self.samples[0].1.saturating_add(sample_step(retention_ms)));
        let floor = match self.samples.front() {
            Some(&(id, _)) if !all_ended => id,
            _ => next_id,
        };
        if floor <= self.floor {
            return 0;
        }
        if all_ended {
            self.samples.clear();
        }
        self.floor = floor;
        let before = self.kept.len();
        self.kept = self.kept.split_off(floor);
        before - self.kept.len()
    }

    /// Where a rewind to `to_ms` starts: the first sample whose messages may be at or after it
    /// (its step ends after `to_ms`); None if every sample is older.
    pub fn rewind_point(&self, retention_ms: u64, to_ms: u64) -> Option<RewindPoint> {
        let step = sample_step(retention_ms);
        let at = self.samples.partition_point(|&(_, t)| t.saturating_add(step) <= to_ms);
        let &(from, from_ms) = self.samples.get(at)?;
        Some(RewindPoint { from, from_ms, clamped: at == 0 && to_ms < from_ms })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn check(set: &IdSet, model: &BTreeSet<MsgId>) {
        assert_eq!(set.len(), model.len() as u64);
        assert_eq!(set.ids().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
        let runs: Vec<Run> = set.runs().copied().collect();
        assert_eq!(IdSet::from_runs(runs).as_ref(), Some(set), "runs in order, apart");
    }

    #[test]
    fn id_sets_match_a_model_through_random_inserts_pops_and_splits() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..200 {
            let mut set = IdSet::default();
            let mut model = BTreeSet::new();
            for _ in 0..300 {
                // Ids of a few entries: dense within an entry, or one per entry.
                let id = ((next() % 12) << 16) | (next() % if round % 2 == 0 { 3 } else { 1 });
                match next() % 10 {
                    0 => {
                        assert_eq!(set.pop_first().map(|(id, _)| id), model.pop_first());
                    }
                    1 => {
                        assert_eq!(set.ids_from(id).collect::<Vec<_>>(), model.range(id..).copied().collect::<Vec<_>>());
                        let upper = set.split_off(id);
                        let model_upper = model.split_off(&id);
                        check(&upper, &model_upper);
                        if next() % 2 == 0 {
                            set.extend(upper);
                            model.extend(model_upper);
                        }
                    }
                    _ => assert_eq!(set.insert(id, NEVER), model.insert(id)),
                }
                check(&set, &model);
                assert!(model.iter().all(|id| set.contains(*id)));
                assert!(!set.contains(12 << 16));
            }
        }
    }

    #[test]
    fn in_order_acks_of_single_message_entries_make_one_run() {
        let mut set = IdSet::default();
        for index in 1..=1000u64 {
            set.insert(index << 16, NEVER);
        }
        assert_eq!((set.len(), set.run_count()), (1000, 1));
        // Acks of two consumers interleaved also end as one run once the gaps fill.
        let mut set = IdSet::default();
        for k in 0..500u64 {
            set.insert((1 + k) << 16, NEVER);
            set.insert((501 + k) << 16, NEVER);
        }
        assert_eq!((set.len(), set.run_count()), (1000, 1));
    }

    #[test]
    fn retention_samples_find_the_rewind_point_and_end_by_time() {
        let mut r = Retained::default();
        let retention = 60_000;
        for (i, t) in [(1u64, 1_000u64), (2, 1_000), (3, 1_500), (4, 1_400), (5, 2_000)] {
            r.enqueued(retention, i << 16, t);
            r.consumed(i << 16);
        }
        // 4 was dated before 3: the samples keep time rising.
        assert_eq!(r.samples, VecDeque::from(vec![(1 << 16, 1_000), (3 << 16, 1_500), (5 << 16, 2_000)]));
        assert_eq!(r.rewind_point(retention, 1_000), Some(RewindPoint { from: 1 << 16, from_ms: 1_000, clamped: false }));
        assert_eq!(r.rewind_point(retention, 1_001), Some(RewindPoint { from: 3 << 16, from_ms: 1_500, clamped: false }));
        assert_eq!(r.rewind_point(retention, 1_500).map(|p| p.from), Some(3 << 16));
        assert_eq!(r.rewind_point(retention, 10), Some(RewindPoint { from: 1 << 16, from_ms: 1_000, clamped: true }));
        assert_eq!(r.rewind_point(retention, 2_001), None, "nothing from then on");
        // A coarser step (600 ms): the sample whose step reaches the time.
        let coarse = 65_536 * 600;
        let mut c = Retained::default();
        for (i, t) in [(1u64, 1_000u64), (2, 1_500), (3, 1_700)] {
            c.enqueued(coarse, i << 16, t);
        }
        assert_eq!(c.samples, VecDeque::from(vec![(1 << 16, 1_000), (3 << 16, 1_700)]));
        assert_eq!(c.rewind_point(coarse, 1_599).map(|p| p.from), Some(1 << 16), "2 may be at or after it");
        assert_eq!(c.rewind_point(coarse, 1_600).map(|p| p.from), Some(3 << 16));
        assert_eq!(r.expire(retention, 61_499, 6 << 16), 0);
        assert_eq!(r.expire(retention, 61_500, 6 << 16), 2, "1 and 2 end once 3's sample is past the retention");
        assert_eq!(r.floor, 3 << 16);
        r.consumed(2 << 16);
        assert_eq!(r.kept.len(), 3, "below the floor: not kept");
        assert_eq!(r.expire(retention, 62_001, 6 << 16), 3);
        assert!(r.samples.is_empty() && r.kept.is_empty());
        assert_eq!(r.floor, 6 << 16);
        assert_eq!(r.rewind_point(retention, 0), None);
    }
}
