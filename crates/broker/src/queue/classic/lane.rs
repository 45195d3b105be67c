//! Lanes: a queue's ready messages as one or more FIFOs, each with its own window, span and store
//! range.
//!
//! A classic queue has one lane. A priority queue (`x-max-priority` N, 1..255) has N+1, one per
//! priority level, as RabbitMQ keeps one sub-queue per priority: messages of a level stay FIFO in
//! their lane, and delivery takes from the highest non-empty lane. Each lane is the classic model
//! unchanged (seqs increasing, a window in memory, the rest paged to the store and read back in
//! order), under its own store queue id (`Queue::id` + level, ids reserved at declare), so paging,
//! persistence, recovery and the delivered mark work per lane as they do for a classic queue. The
//! windows share the queue's budget (`window_for`), so memory stays bounded whatever the levels.
//!
//! The queue works on one lane at a time, the *current* one, which `QueueState` holds inline (and
//! reads as, through `Deref`): a classic queue's code path is exactly what it was. `Levels::select`
//! swaps another level in (two moves of a small struct) for a priority queue.

use crate::queue::Entry;
use std::collections::{BTreeMap, VecDeque};
use warren_store::SyncTicket;

/// One FIFO of ready messages and its place in the store.
#[derive(Default)]
pub(in crate::queue) struct Lane {
    /// The store queue id its messages are written under.
    pub store_id: u64,
    /// The in-memory window of ready messages.
    pub ready: VecDeque<Entry>,
    /// Body bytes of the window (for `x-max-length-bytes`, as RabbitMQ counts).
    pub ready_bytes: u64,
    /// Memory the window's messages hold (`Message::memory_bytes`): what the window is bounded by.
    pub ready_mem: u64,
    pub next_seq: u64,
    /// Ready messages that are only in the store: `span_count` live ones from `span_from` on.
    pub span_from: u64,
    pub span_count: u64,
    /// A read of the span is under way on a blocking thread, off the queue's lock
    /// (`Queue::refill_locked`).
    pub refill_in_flight: bool,
    /// The last read found nothing yet (the store's writer had not applied those messages): the store's
    /// readable watermark before it. No new read until the watermark has moved (or the next tick).
    pub refill_found_nothing: Option<SyncTicket>,
    /// Bumped whenever the span is emptied (purge, delete): a read under way is stale then.
    pub span_epoch: u64,
    /// Their body bytes (for `x-max-length-bytes`; an estimate after a restart) and store bytes.
    pub span_bytes: u64,
    pub span_store_bytes: u64,
    /// Ticket of the last append of a span message: the store's `read` sees the whole span once its
    /// readable watermark has reached it (the writer copies appends into the queue logs a moment later).
    pub span_ticket: SyncTicket,
    /// Seqs below this were in the store when the node started.
    pub recovered_until: u64,
    /// Of those, seqs below this may have been delivered before the restart (the store's delivered mark):
    /// they come back redelivered, the others not.
    pub redelivered_below: u64,
    /// The delivered mark: stored persistent messages below `mark_durable` may be delivered (the store
    /// has it durably), so that a crash never brings back a delivered message as new; the next mark,
    /// appended and waiting for its fsync, is `mark_pending` (mark, ticket).
    pub mark_durable: u64,
    pub mark_pending: Option<(u64, SyncTicket)>,
    /// Persistent messages taken into the window without being stored yet (published without confirms
    /// while every consumer is no-ack): written at the next `tick` if still here (see `Queue::publish`).
    pub has_deferred: bool,
    /// Seq after the last enqueue this lane appended to the store. The store keeps a queue's messages
    /// in seq order and cannot take a lower seq after a higher one (see `Queue::store_message`).
    pub stored_until: u64,
    /// Consumed messages a rewind made ready again, still only in the store (`queue::rewind`).
    pub rewound: Rewound,
}

/// The seq ranges a rewind made ready again and the window has not taken yet: all below the span
/// (a rewind stops at `span_from`), read back range by range, lowest first, and merged into the
/// window by seq. Memory is one entry per range (a rewind over messages still unacked or ready
/// splits its range around them), not per message.
#[derive(Default)]
pub(in crate::queue) struct Rewound {
    /// start -> end (exclusive), disjoint.
    ranges: BTreeMap<u64, u64>,
    count: u64,
}

impl Rewound {
    /// Adds ranges a rewind made live (`Store::take_rewound`: disjoint from every range here, which
    /// were live before it).
    /// A range may overlap one here only where a read found holes and made them gone, and a later
    /// rewind made them live again: merged, counted once.
    pub fn add(&mut self, ranges: &[(u64, u64)]) {
        for &(a, b) in ranges.iter().filter(|(a, b)| a < b) {
            let (mut start, mut end) = (a, b);
            let touching: Vec<(u64, u64)> = self.ranges.range(..=b).filter(|(_, &e)| e >= a).map(|(s, e)| (*s, *e)).collect();
            for (s, e) in touching {
                self.ranges.remove(&s);
                self.count -= e - s;
                start = start.min(s);
                end = end.max(e);
            }
            self.ranges.insert(start, end);
            self.count += end - start;
        }
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// The lowest range.
    pub fn first(&self) -> Option<(u64, u64)> {
        self.ranges.first_key_value().map(|(a, b)| (*a, *b))
    }

    /// The lowest range was read (or skipped) up to `seq`: what is below it leaves.
    pub fn taken_to(&mut self, seq: u64) {
        let Some((a, b)) = self.first() else { return };
        self.ranges.remove(&a);
        let upto = seq.clamp(a, b);
        self.count -= upto - a;
        if upto < b {
            self.ranges.insert(upto, b);
        }
    }

    /// Empties it (purge, delete); returns the ranges.
    pub fn take_all(&mut self) -> Vec<(u64, u64)> {
        self.count = 0;
        std::mem::take(&mut self.ranges).into_iter().collect()
    }
}

impl Lane {
    pub fn new(store_id: u64) -> Lane {
        Lane { store_id, ..Lane::default() }
    }

    /// Ready messages: the window, the span and the rewound ones.
    pub fn count(&self) -> u64 {
        self.ready.len() as u64 + self.span_count + self.rewound.count()
    }

    /// The lowest rewound message comes before the window's head (or the window is empty): it must
    /// be read before anything is delivered.
    pub fn rewound_due(&self) -> bool {
        self.rewound.first().is_some_and(|(a, _)| self.ready.front().is_none_or(|e| e.seq > a))
    }

    /// Body bytes of its ready messages.
    pub fn bytes(&self) -> u64 {
        self.ready_bytes + self.span_bytes
    }
}

/// A priority queue's lanes other than the current one; empty for a classic queue.
#[derive(Default)]
pub(in crate::queue) struct Levels {
    /// One per level; the current level's slot holds an empty placeholder.
    lanes: Vec<Lane>,
    current: usize,
}

impl Levels {
    /// The lanes of a queue with store id `id` and `max_priority` (0: a classic queue, one lane, no
    /// levels). Returns the lane of level 0 (the current one) and the others.
    pub fn new(id: u64, max_priority: u8) -> (Lane, Levels) {
        if max_priority == 0 {
            return (Lane::new(id), Levels::default());
        }
        let lanes = (0..=max_priority as u64).map(|level| if level == 0 { Lane::default() } else { Lane::new(id + level) }).collect();
        (Lane::new(id), Levels { lanes, current: 0 })
    }

    pub fn is_priority(&self) -> bool {
        !self.lanes.is_empty()
    }

    /// How many lanes (1 for a classic queue).
    pub fn lane_count(&self) -> usize {
        self.lanes.len().max(1)
    }

    /// Makes `level` the current lane (`lane` holds the current one).
    pub fn select(&mut self, lane: &mut Lane, level: usize) {
        if level == self.current || level >= self.lanes.len() {
            return;
        }
        std::mem::swap(lane, &mut self.lanes[self.current]);
        std::mem::swap(lane, &mut self.lanes[level]);
        self.current = level;
    }

    /// Ready messages and their body bytes in the lanes other than the current one.
    pub fn count_and_bytes(&self) -> (u64, u64) {
        self.lanes.iter().fold((0, 0), |(n, b), l| (n + l.count(), b + l.bytes()))
    }

    /// Levels holding ready messages, highest first (`lane` is the current one).
    pub fn non_empty_desc<'a>(&'a self, lane: &'a Lane) -> impl Iterator<Item = usize> + 'a {
        (0..self.lanes.len()).rev().filter(move |&level| {
            let l = if level == self.current { lane } else { &self.lanes[level] };
            l.count() > 0
        })
    }

    /// Every lane but the current one, to empty them (purge, delete).
    pub fn others_mut(&mut self) -> impl Iterator<Item = &mut Lane> {
        let current = self.current;
        self.lanes.iter_mut().enumerate().filter(move |(i, _)| *i != current).map(|(_, l)| l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64) -> Entry {
        let message = std::sync::Arc::new(crate::message::Message {
            exchange: String::new(),
            routing_key: String::new(),
            persistent: false,
            expiration_ms: None,
            properties: bytes::Bytes::new(),
            body: bytes::Bytes::from_static(b"abc"),
        });
        Entry { message, seq, stored_bytes: 0, expires_at_ms: None, redelivered: false, returned: 0 }
    }

    #[test]
    fn rewound_ranges_are_taken_lowest_first_and_counted() {
        let mut r = Rewound::default();
        r.add(&[(50, 150), (160, 170)]);
        r.add(&[(10, 20)]);
        assert_eq!((r.count(), r.first()), (120, Some((10, 20))));

        r.taken_to(15);
        assert_eq!((r.count(), r.first()), (115, Some((15, 20))));
        r.taken_to(30); // past the range: all of it
        assert_eq!((r.count(), r.first()), (110, Some((50, 150))));
        let mut lane = Lane::new(1);
        lane.rewound = r;
        assert!(lane.rewound_due(), "an empty window");
        lane.ready.push_back(entry(40));
        assert!(!lane.rewound_due(), "the window's head comes first");
        lane.ready.clear();
        lane.ready.push_back(entry(151));
        assert!(lane.rewound_due());
        assert_eq!(lane.count(), 111);
        assert_eq!(lane.rewound.take_all(), vec![(50, 150), (160, 170)]);
        assert_eq!(lane.count(), 1);
    }

    #[test]
    fn overlapping_rewound_ranges_merge_and_count_once() {
        let mut r = Rewound::default();
        r.add(&[(10, 20), (50, 150), (160, 170)]);
        r.add(&[(10, 12), (148, 155)]);
        assert_eq!((r.count(), r.first()), (125, Some((10, 20))));
        r.add(&[(150, 160)]); // touching both sides: one range
        assert_eq!((r.count(), r.ranges.len()), (130, 2));
        assert_eq!(r.take_all(), vec![(10, 20), (50, 170)]);
    }

    #[test]
    fn a_classic_queue_has_one_lane_and_select_does_nothing() {
        let (mut lane, mut levels) = Levels::new(7, 0);
        assert!(!levels.is_priority());
        assert_eq!(levels.lane_count(), 1);
        lane.ready.push_back(entry(0));
        levels.select(&mut lane, 3);
        assert_eq!((lane.store_id, lane.count()), (7, 1));
        assert_eq!(levels.non_empty_desc(&lane).count(), 0, "no other lanes");
    }

    #[test]
    fn select_swaps_lanes_and_keeps_their_contents() {
        let (mut lane, mut levels) = Levels::new(10, 3);
        assert_eq!(levels.lane_count(), 4);
        lane.ready.push_back(entry(0));
        levels.select(&mut lane, 2);
        assert_eq!((lane.store_id, lane.count()), (12, 0));
        lane.ready.push_back(entry(0));
        lane.ready.push_back(entry(1));
        lane.span_count = 5;
        assert_eq!(levels.count_and_bytes().0, 1, "level 0 waits in its slot");
        assert_eq!(levels.non_empty_desc(&lane).collect::<Vec<_>>(), vec![2, 0]);
        levels.select(&mut lane, 0);
        assert_eq!((lane.store_id, lane.count()), (10, 1));
        assert_eq!(levels.count_and_bytes().0, 7);
        levels.select(&mut lane, 3);
        assert_eq!(lane.store_id, 13);
        levels.select(&mut lane, 2);
        assert_eq!((lane.store_id, lane.count()), (12, 7));
        let emptied: u64 = levels.others_mut().map(|l| l.count()).sum();
        assert_eq!(emptied, 1);
    }
}
