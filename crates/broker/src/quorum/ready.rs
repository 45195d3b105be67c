//! The ready messages of a quorum queue, in msg-id order, kept compact.
//!
//! Two parts, as rabbit_fifo's `returns` and `messages`: messages that went back to the queue
//! (returned, requeued, their consumer gone) with their per-message state, and fresh messages that
//! were never delivered, as runs of consecutive ids (one run per enqueue entry and expiry: a batch
//! of a thousand messages costs one run). Every returned id is below every fresh id: deliveries
//! always take the head, so a message that was ever delivered was older than every message still
//! fresh. The head of the queue is therefore the first returned message, else the first fresh one,
//! and a requeued message goes back to its place by id (as a classic queue's requeue).
//!
//! Sizes are kept per fresh message only when the queue has `x-max-length-bytes` (4 bytes each).
//!
//! A third part holds delayed messages that came due (`fired`): they keep their msg id (where
//! their body is) but join the queue where a message enqueued by the `Tick` that fired them would
//! have, as the delayed-message plugin publishes a due message then. So each has an order key,
//! `msg_id(tick index, k)`: above every id enqueued before that Tick, below every later one. The
//! head is the first returned message, else the smaller of the first fresh id and the first fired
//! key. Every message that left the lane by its head was below every fresh id then, and fresh ids
//! only rise, so "every returned id is below every fresh id" still holds.
//!
//! A fourth part holds consumed messages a rewind brought back (`rewound`, of a queue with
//! retention: see `retained`): they were each the head once, so below every fresh id, and are
//! taken with the returned ones, smallest id first, redelivered. They are all in the normal lane.
//! A rewound message may be above some fresh ids (a high-priority one, or a delayed one dropped
//! as it came due), and so may a returned one after it: both still come before every fresh one.
//!
//! Priorities, as RabbitMQ 4's quorum queues: two lanes, each as above, high (message priority
//! above 4) and normal (the rest, and no priority). The head is taken from the high lane twice for
//! each time from the normal lane while both have messages ([`HIGH_PER_NORMAL`]), so a stream of
//! high-priority messages delays the normal ones without starving them.

use super::command::MsgId;
use super::retained::IdSet;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Expiry of a message without TTL.
pub const NEVER: u64 = u64::MAX;

/// What the queue keeps of a message that is not fresh (returned, or checked out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MsgState {
    /// Failed deliveries (returned by nack/reject with requeue): the `x-delivery-count`.
    pub delivery_count: u32,
    /// Times checked out (whatever the outcome): > 0 means a delivery is a redelivery.
    pub acquired: u32,
    /// Bytes counted against `x-max-length-bytes` (0 when the queue does not count them).
    pub size: u32,
    /// Absolute expiry in ms ([`NEVER`] without TTL).
    pub expires_at: u64,
    /// Of the high-priority lane (`Ready`).
    pub high: bool,
}

/// A message priority above this is high (RabbitMQ 4's quorum queues).
pub const HIGH_PRIORITY_ABOVE: u8 = 4;

/// While both lanes have messages, the head is taken this many times from the high lane for each
/// time from the normal one.
pub const HIGH_PER_NORMAL: u8 = 2;

/// `count` fresh messages with one expiry: `first, first + 1, ...` (the messages of one entry),
/// or with `per_entry`, `first, first + 2^16, ...` (the only message of consecutive entries, as a
/// publisher waiting for each confirm makes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub first: MsgId,
    pub count: u32,
    pub per_entry: bool,
    pub expires_at: u64,
}

impl Run {
    pub fn step(&self) -> u64 {
        if self.per_entry {
            1 << 16
        } else {
            1
        }
    }

    /// The id after the last (where a run extends).
    pub fn end(&self) -> u128 {
        self.first as u128 + self.count as u128 * self.step() as u128
    }

    pub fn last(&self) -> MsgId {
        self.first + (self.count as u64 - 1) * self.step()
    }

    /// Its ids, rising.
    pub fn ids(&self) -> impl Iterator<Item = MsgId> + '_ {
        (0..self.count as u64).map(move |k| self.first + k * self.step())
    }
}

/// A delayed message that came due, ready (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fired {
    /// Its place in the queue: rising along `Lane::fired`.
    pub key: u64,
    pub id: MsgId,
    pub state: MsgState,
}

/// The ready messages of one priority lane.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lane {
    pub(crate) returned: BTreeMap<MsgId, MsgState>,
    pub(crate) fresh: VecDeque<Run>,
    /// Delayed messages that came due, by key; `fired_ids` finds one by id.
    pub(crate) fired: VecDeque<Fired>,
    fired_ids: BTreeSet<MsgId>,
    /// Consumed messages a rewind made ready again (size 0, never counted against
    /// `x-max-length-bytes`), with their expiry.
    pub(crate) rewound: IdSet,
    /// Sizes of the fresh messages, in order (only when `track_sizes`).
    pub(crate) sizes: VecDeque<u32>,
    pub(crate) track_sizes: bool,
    count: u64,
    bytes: u64,
}

impl Lane {
    pub fn new(track_sizes: bool) -> Lane {
        Lane { track_sizes, ..Default::default() }
    }

    /// Rebuilds from a snapshot's parts (counts recomputed; `fired` keys rising, checked by the caller).
    pub fn from_parts(track_sizes: bool, returned: BTreeMap<MsgId, MsgState>, fresh: VecDeque<Run>, sizes: VecDeque<u32>, fired: VecDeque<Fired>, rewound: IdSet) -> Lane {
        let count = returned.len() as u64 + fresh.iter().map(|r| r.count as u64).sum::<u64>() + fired.len() as u64 + rewound.len();
        let bytes = returned.values().map(|m| m.size as u64).sum::<u64>()
            + sizes.iter().map(|&s| s as u64).sum::<u64>()
            + fired.iter().map(|f| f.state.size as u64).sum::<u64>();
        let fired_ids = fired.iter().map(|f| f.id).collect();
        Lane { returned, fresh, fired, fired_ids, rewound, sizes, track_sizes, count, bytes }
    }

    /// Whether `id` is ready in this lane.
    pub fn contains(&self, id: MsgId) -> bool {
        self.returned.contains_key(&id) || self.fired_ids.contains(&id) || self.rewound.contains(id) || self.in_fresh(id)
    }

    /// Whether `id` is one of the fresh messages.
    pub(crate) fn in_fresh(&self, id: MsgId) -> bool {
        // Fresh runs are in id order: the last run starting at or before `id`.
        let at = self.fresh.partition_point(|r| r.first <= id);
        let Some(run) = at.checked_sub(1).and_then(|i| self.fresh.get(i)) else { return false };
        let offset = id - run.first;
        offset % run.step() == 0 && offset / run.step() < run.count as u64
    }

    /// Every id ready in this lane (unordered between returned and fresh).
    pub fn ids(&self) -> impl Iterator<Item = MsgId> + '_ {
        self.returned.keys().copied().chain(self.fired.iter().map(|f| f.id)).chain(self.rewound.ids()).chain(self.fresh.iter().flat_map(Run::ids))
    }

    pub fn len(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bytes of the ready messages (0 unless the queue counts them).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// A message just enqueued (its id above every id here).
    fn push_fresh(&mut self, id: MsgId, size: u32, expires_at: u64) {
        let size = if self.track_sizes { size } else { 0 };
        match self.fresh.back_mut() {
            Some(run) if run.expires_at == expires_at && run.count < u32::MAX && run.end() == id as u128 => run.count += 1,
            // A second message: the run takes the step between the two.
            Some(run) if run.expires_at == expires_at && run.count == 1 && run.first.checked_add(1 << 16) == Some(id) => {
                run.per_entry = true;
                run.count = 2;
            }
            _ => self.fresh.push_back(Run { first: id, count: 1, per_entry: false, expires_at }),
        }
        if self.track_sizes {
            self.sizes.push_back(size);
        }
        self.count += 1;
        self.bytes += size as u64;
    }

    /// A message back from a consumer, to its place by id.
    fn push_returned(&mut self, id: MsgId, state: MsgState) {
        if self.returned.insert(id, state).is_none() {
            self.count += 1;
            self.bytes += state.size as u64;
        }
    }

    /// A delayed message that came due, at the tail of `fired` (`key` above every key there).
    fn push_fired(&mut self, key: u64, id: MsgId, state: MsgState) {
        if !self.fired_ids.insert(id) {
            return;
        }
        let state = if self.track_sizes { state } else { MsgState { size: 0, ..state } };
        self.fired.push_back(Fired { key, id, state });
        self.count += 1;
        self.bytes += state.size as u64;
    }

    /// Consumed messages a rewind brought back (none of them in this lane already).
    fn push_rewound(&mut self, ids: IdSet) {
        let before = self.rewound.len();
        self.rewound.extend(ids);
        self.count += self.rewound.len() - before;
    }

    /// Whether the next head is the first rewound message (smaller than the first returned one).
    fn rewound_next(&self) -> bool {
        match (self.rewound.first(), self.returned.keys().next()) {
            (Some((rewound, _)), Some(&returned)) => rewound < returned,
            (rewound, _) => rewound.is_some(),
        }
    }

    /// Whether the next head after the returned messages is the first fired one.
    fn fired_next(&self) -> bool {
        match (self.fired.front(), self.fresh.front()) {
            (Some(f), Some(run)) => f.key <= run.first,
            (fired, _) => fired.is_some(),
        }
    }

    /// The head's id and expiry.
    pub fn head(&self) -> Option<(MsgId, u64)> {
        if self.rewound_next() {
            return self.rewound.first();
        }
        if let Some((&id, st)) = self.returned.iter().next() {
            return Some((id, st.expires_at));
        }
        if self.fired_next() {
            return self.fired.front().map(|f| (f.id, f.state.expires_at));
        }
        self.fresh.front().map(|r| (r.first, r.expires_at))
    }

    /// Takes the head.
    fn pop(&mut self) -> Option<(MsgId, MsgState)> {
        let (id, state) = if self.rewound_next() {
            let (id, expires_at) = self.rewound.pop_first()?;
            (id, MsgState { delivery_count: 0, acquired: 1, size: 0, expires_at, high: false })
        } else if let Some((id, st)) = self.returned.pop_first() {
            (id, st)
        } else if self.fired_next() {
            let f = self.fired.pop_front()?;
            self.fired_ids.remove(&f.id);
            (f.id, f.state)
        } else {
            let run = self.fresh.front_mut()?;
            let id = run.first;
            let expires_at = run.expires_at;
            run.count -= 1;
            if run.count == 0 {
                self.fresh.pop_front();
            } else {
                run.first += run.step();
            }
            let size = if self.track_sizes { self.sizes.pop_front().unwrap_or(0) } else { 0 };
            (id, MsgState { delivery_count: 0, acquired: 0, size, expires_at, high: false })
        };
        self.count -= 1;
        self.bytes -= state.size as u64;
        Some((id, state))
    }

    /// Removes everything; returns the ids removed as runs `(first, count)`, in id order.
    fn clear(&mut self) -> Vec<(MsgId, u32)> {
        let mut runs: Vec<(MsgId, u32)> = Vec::new();
        for &id in self.returned.keys() {
            push_id(&mut runs, id);
        }
        let mut others: Vec<MsgId> = self.fired.iter().map(|f| f.id).chain(self.rewound.ids()).collect();
        others.sort_unstable();
        for id in others {
            push_id(&mut runs, id);
        }
        for run in &self.fresh {
            if run.per_entry {
                for k in 0..run.count as u64 {
                    push_id(&mut runs, run.first + (k << 16));
                }
                continue;
            }
            match runs.last_mut() {
                Some((first, n)) if *first + *n as u64 == run.first => *n += run.count,
                _ => runs.push((run.first, run.count)),
            }
        }
        *self = Lane::new(self.track_sizes);
        runs
    }

    /// Entries of memory held (returned and fired messages + fresh and rewound runs + sizes), for
    /// the cost figures.
    pub fn entries(&self) -> (usize, usize, usize) {
        (self.returned.len() + self.fired.len(), self.fresh.len() + self.rewound.run_count(), self.sizes.len())
    }
}

/// The ready messages: the normal and the high-priority lane, and whose turn it is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ready {
    pub(crate) normal: Lane,
    pub(crate) high: Lane,
    /// Heads taken from the high lane since the last from the normal one (< [`HIGH_PER_NORMAL`]
    /// while the normal lane has messages).
    pub(crate) high_streak: u8,
}

impl Ready {
    pub fn new(track_sizes: bool) -> Ready {
        Ready { normal: Lane::new(track_sizes), high: Lane::new(track_sizes), high_streak: 0 }
    }

    pub fn len(&self) -> u64 {
        self.normal.len() + self.high.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the ready messages (0 unless the queue counts them).
    pub fn bytes(&self) -> u64 {
        self.normal.bytes() + self.high.bytes()
    }

    /// A message just enqueued (its id above every id here).
    pub fn push_fresh(&mut self, id: MsgId, size: u32, expires_at: u64, high: bool) {
        self.lane_mut(high).push_fresh(id, size, expires_at);
    }

    /// A message back from a consumer, to its place by id in its lane.
    pub fn push_returned(&mut self, id: MsgId, state: MsgState) {
        self.lane_mut(state.high).push_returned(id, state);
    }

    /// Consumed messages a rewind brought back (to the normal lane).
    pub fn push_rewound(&mut self, ids: IdSet) {
        self.normal.push_rewound(ids);
    }

    /// A delayed message that came due, joining its lane with order `key` (see the module doc).
    pub fn push_fired(&mut self, key: u64, id: MsgId, state: MsgState) {
        self.lane_mut(state.high).push_fired(key, id, state);
    }

    fn lane_mut(&mut self, high: bool) -> &mut Lane {
        if high {
            &mut self.high
        } else {
            &mut self.normal
        }
    }

    /// Whether the next head comes from the high lane.
    fn high_next(&self) -> bool {
        !self.high.is_empty() && (self.normal.is_empty() || self.high_streak < HIGH_PER_NORMAL)
    }

    /// The head's id and expiry: the next message [`Ready::pop`] takes.
    pub fn head(&self) -> Option<(MsgId, u64)> {
        if self.high_next() {
            self.high.head()
        } else {
            self.normal.head()
        }
    }

    /// Takes the head.
    pub fn pop(&mut self) -> Option<(MsgId, MsgState)> {
        if self.high_next() {
            self.high_streak = self.high_streak.saturating_add(1);
            return self.high.pop().map(|(id, st)| (id, MsgState { high: true, ..st }));
        }
        let popped = self.normal.pop()?;
        self.high_streak = 0;
        Some(popped)
    }

    /// Takes the normal lane's head, or the high lane's when the normal one is empty (what
    /// `x-max-length` drops), without changing whose turn it is.
    pub fn pop_lowest(&mut self) -> Option<(MsgId, MsgState)> {
        match self.normal.pop() {
            Some(popped) => Some(popped),
            None => self.high.pop().map(|(id, st)| (id, MsgState { high: true, ..st })),
        }
    }

    /// Whether `id` is ready.
    pub fn contains(&self, id: MsgId) -> bool {
        self.normal.contains(id) || self.high.contains(id)
    }

    /// Every ready id (unordered).
    pub fn ids(&self) -> impl Iterator<Item = MsgId> + '_ {
        self.normal.ids().chain(self.high.ids())
    }

    /// Removes everything; returns the ids removed as runs `(first, count)`, in id order.
    pub fn clear(&mut self) -> Vec<(MsgId, u32)> {
        let mut runs = self.normal.clear();
        runs.extend(self.high.clear());
        runs.sort_unstable();
        self.high_streak = 0;
        runs
    }

    /// Entries of memory held (returned messages + fresh runs + sizes), for the cost figures.
    pub fn entries(&self) -> (usize, usize, usize) {
        let (a, b, c) = self.normal.entries();
        let (d, e, f) = self.high.entries();
        (a + d, b + e, c + f)
    }
}

/// Appends an id to a list of runs `(first, count)`, extending the last run when consecutive.
pub fn push_id(runs: &mut Vec<(MsgId, u32)>, id: MsgId) {
    match runs.last_mut() {
        Some((first, n)) if *first + *n as u64 == id && *n < u32::MAX => *n += 1,
        _ => runs.push((id, 1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returned_messages_come_first_in_id_order_and_runs_merge() {
        let mut r = Lane::new(true);
        for i in 0..3 {
            r.push_fresh((5 << 16) | i, 10, NEVER);
        }
        r.push_fresh(6 << 16, 7, NEVER);
        assert_eq!(r.fresh.len(), 2);
        assert_eq!((r.len(), r.bytes()), (4, 37));
        r.push_returned(9, MsgState { delivery_count: 1, acquired: 1, size: 3, expires_at: NEVER, high: false });
        r.push_returned(4, MsgState { delivery_count: 0, acquired: 1, size: 2, expires_at: NEVER, high: false });
        let order: Vec<MsgId> = std::iter::from_fn(|| r.pop().map(|(id, _)| id)).collect();
        assert_eq!(order, vec![4, 9, 5 << 16, (5 << 16) | 1, (5 << 16) | 2, 6 << 16]);
        assert_eq!((r.len(), r.bytes()), (0, 0));
    }

    #[test]
    fn one_message_entries_at_consecutive_indexes_share_a_run() {
        let mut r = Lane::new(false);
        for index in 10..1010u64 {
            r.push_fresh(index << 16, 1, NEVER);
        }
        r.push_fresh(1011 << 16, 1, NEVER); // index 1010 was another command: a new run
        r.push_fresh((1011 << 16) | 1, 1, NEVER); // and a second message of that entry: step 1
        assert_eq!(r.fresh.len(), 2);
        assert!(r.fresh[0].per_entry && !r.fresh[1].per_entry);
        assert_eq!(r.pop().map(|(id, _)| id), Some(10 << 16));
        assert_eq!(r.pop().map(|(id, _)| id), Some(11 << 16));
        let runs = r.clear();
        assert_eq!(runs.len(), 998 + 1);
        assert_eq!(runs.last(), Some(&(1011 << 16, 2)));
    }

    #[test]
    fn high_priority_heads_go_two_for_each_normal_one_and_requeues_keep_their_lane() {
        let mut r = Ready::new(false);
        for i in 0..4u64 {
            r.push_fresh(i << 16, 1, NEVER, false);
        }
        for i in 4..10u64 {
            r.push_fresh(i << 16, 1, NEVER, true);
        }
        let mut order = Vec::new();
        while let Some((id, st)) = r.pop() {
            order.push((id >> 16, st.high));
        }
        let lanes: Vec<bool> = order.iter().map(|(_, high)| *high).collect();
        assert_eq!(lanes, vec![true, true, false, true, true, false, true, true, false, false]);
        let ids: Vec<u64> = order.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, vec![4, 5, 0, 6, 7, 1, 8, 9, 2, 3]);
        // A returned high message goes back to the head of its lane.
        r.push_returned(3 << 16, MsgState { high: false, ..MsgState::default() });
        r.push_returned(8 << 16, MsgState { high: true, ..MsgState::default() });
        assert_eq!(r.pop().map(|(id, st)| (id >> 16, st.high)), Some((8, true)));
        assert!(r.contains(3 << 16) && !r.contains(8 << 16));
    }
}
