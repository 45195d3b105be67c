//! A connection's publisher session: what its publishes (and transactional settlements) are waiting
//! for in quorum queues, so a confirm or tx.commit-ok waits for every queue it covers.
//!
//! A confirm covers two kinds of durability handles:
//! - classic queues: "durable on this node at store position P" (a `SyncTicket`, compared with the
//!   store's durable watermark by the connection's writer), and
//! - quorum queues: "applied by group G for publisher session S up to pub seq N", which comes back as
//!   the reply of the group's Enqueue command once the entry is committed on a majority.
//!
//! Every operation of the connection that goes to a quorum queue gets a pub seq from one rising
//! counter (`PublisherSession::next_seq`). The queue says it [`sent`](PublisherSession::sent) it and
//! later that the group [`resolved`](PublisherSession::resolved) it (applied or refused). A confirm of
//! the operation numbered `s` may go out once every operation below `s + 1` is resolved
//! ([`PublisherSession::resolved_below`]), and the store reached its ticket; a refused one is a
//! basic.nack ([`PublisherSession::take_refused`]). A connection's operations to each group are
//! resolved in about the order they were sent, so one watermark serves all its channels (a confirm on
//! one channel may wait for a quorum queue another channel published to a moment before: never longer
//! than one commit).

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Weak;

use crate::sink::ClientSink;

/// Session ids are random: a group remembers a session's last pub seq to drop re-sent duplicates, so
/// an id must never come back with its seqs starting again (after a restart, or on another node).
pub type SessionId = u64;

/// Most refusals a session keeps for confirms not written yet (see `take_refused`).
const MAX_REFUSED: usize = 65_536;

/// Who published a message: its connection's session and the pub seq of this publish.
#[derive(Clone, Copy)]
pub struct Publisher<'a> {
    pub session: &'a std::sync::Arc<PublisherSession>,
    pub seq: u64,
}

pub struct PublisherSession {
    pub id: SessionId,
    /// Every operation numbered below this is resolved (u64::MAX: none outstanding).
    resolved_below: AtomicU64,
    /// Some operation was refused and its confirm not yet taken by the writer.
    any_refused: AtomicBool,
    next_seq: AtomicU64,
    state: Mutex<SessionState>,
    /// Woken when `resolved_below` moves (the connection's outbox: its writer sends the confirms).
    sink: Weak<dyn ClientSink>,
}

#[derive(Default)]
struct SessionState {
    /// Per quorum queue (by id): operations sent and not resolved yet, in seq order (`done` marks one
    /// resolved out of order; it leaves once everything before it is resolved).
    outstanding: Vec<(u64, VecDeque<(u64, bool)>)>,
    /// Refused operations whose confirms the writer has not taken yet, in seq order.
    refused: Vec<u64>,
}

impl PublisherSession {
    pub fn new(sink: Weak<dyn ClientSink>) -> PublisherSession {
        PublisherSession {
            id: rand::random::<u64>() | 1,
            resolved_below: AtomicU64::new(u64::MAX),
            any_refused: AtomicBool::new(false),
            next_seq: AtomicU64::new(1),
            state: Mutex::new(SessionState::default()),
            sink,
        }
    }

    /// The pub seq of the connection's next operation (rising, never 0).
    pub fn next_seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Operation `seq` went to quorum queue `queue`: confirms from `seq` on wait until it is resolved.
    /// Called in seq order per queue (the connection's reader is one task).
    pub fn sent(&self, queue: u64, seq: u64) {
        let mut st = self.state.lock();
        let i = match st.outstanding.iter().position(|(q, _)| *q == queue) {
            Some(i) => i,
            None => {
                st.outstanding.push((queue, VecDeque::new()));
                st.outstanding.len() - 1
            }
        };
        st.outstanding[i].1.push_back((seq, false));
        self.update_watermark(&st);
    }

    /// Group `queue` applied (`refused` false) or refused (x-overflow reject-publish, no majority in
    /// time, the queue is gone) operation `seq`.
    pub fn resolved(&self, queue: u64, seqs: impl IntoIterator<Item = (u64, bool)>) {
        {
            let mut st = self.state.lock();
            let Some(i) = st.outstanding.iter().position(|(q, _)| *q == queue) else { return };
            let mut refused = Vec::new();
            {
                let pending = &mut st.outstanding[i].1;
                for (seq, was_refused) in seqs {
                    if let Ok(at) = pending.binary_search_by_key(&seq, |(s, _)| *s) {
                        pending[at].1 = true;
                        if was_refused {
                            refused.push(seq);
                        }
                    }
                }
                while pending.front().is_some_and(|(_, done)| *done) {
                    pending.pop_front();
                }
            }
            if st.outstanding[i].1.is_empty() {
                st.outstanding.swap_remove(i);
            }
            if !refused.is_empty() {
                st.refused.extend(refused);
                st.refused.sort_unstable();
                // Refusals nobody takes (a confirm dropped with its closed channel) must not pile
                // up: the oldest go.
                if st.refused.len() > MAX_REFUSED {
                    let extra = st.refused.len() - MAX_REFUSED;
                    st.refused.drain(..extra);
                }
                self.any_refused.store(true, Ordering::Release);
            }
            self.update_watermark(&st);
        }
        if let Some(sink) = self.sink.upgrade() {
            sink.confirms_changed();
        }
    }

    /// Group `queue` applied every operation of this session up to `up_to`; those in `rejected` were
    /// refused (the machine's `Published` effect).
    pub fn applied_up_to(&self, queue: u64, up_to: u64, rejected: &[u64]) {
        let seqs: Vec<(u64, bool)> = {
            let st = self.state.lock();
            let Some((_, pending)) = st.outstanding.iter().find(|(q, _)| *q == queue) else { return };
            pending.iter().take_while(|(s, _)| *s <= up_to).map(|(s, _)| (*s, rejected.contains(s))).collect()
        };
        if !seqs.is_empty() {
            self.resolved(queue, seqs);
        }
    }

    fn update_watermark(&self, st: &SessionState) {
        let below = st.outstanding.iter().filter_map(|(_, p)| p.front().map(|(s, _)| *s)).min().unwrap_or(u64::MAX);
        self.resolved_below.store(below, Ordering::Release);
    }

    /// Every operation numbered below this is resolved.
    pub fn resolved_below(&self) -> u64 {
        self.resolved_below.load(Ordering::Acquire)
    }

    /// Whether operation `seq` is resolved (and everything before it).
    pub fn is_resolved(&self, seq: u64) -> bool {
        seq < self.resolved_below()
    }

    /// Whether operation `seq` was refused by some queue (its confirm is a basic.nack); forgets it.
    pub fn take_refused(&self, seq: u64) -> bool {
        if !self.any_refused.load(Ordering::Acquire) {
            return false;
        }
        let mut st = self.state.lock();
        let refused = match st.refused.binary_search(&seq) {
            Ok(at) => {
                st.refused.remove(at);
                true
            }
            Err(_) => false,
        };
        if st.refused.is_empty() {
            self.any_refused.store(false, Ordering::Release);
        }
        refused
    }

    /// How many operations numbered `first..=last` some queue refused (a transaction's: its
    /// tx.commit then fails); forgets them.
    pub fn take_refused_in(&self, first: u64, last: u64) -> usize {
        if !self.any_refused.load(Ordering::Acquire) || first > last {
            return 0;
        }
        let mut st = self.state.lock();
        let from = st.refused.partition_point(|s| *s < first);
        let to = st.refused.partition_point(|s| *s <= last);
        st.refused.drain(from..to);
        if st.refused.is_empty() {
            self.any_refused.store(false, Ordering::Release);
        }
        to - from
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoSink;
    impl ClientSink for NoSink {
        fn send(&self, _: crate::channel::Delivery) {}
    }

    fn session() -> PublisherSession {
        let sink: Weak<NoSink> = Weak::new();
        PublisherSession::new(sink)
    }

    #[test]
    fn the_refusals_of_a_range_are_counted_and_forgotten_and_no_others() {
        let s = session();
        let seqs: Vec<u64> = (0..6).map(|_| s.next_seq()).collect();
        for &q in &seqs {
            s.sent(7, q);
        }
        s.resolved(7, seqs.iter().map(|&q| (q, q % 2 == 0)));
        assert_eq!(s.take_refused_in(seqs[0], seqs[3]), 2, "seqs 2 and 4 of 1..=4 were refused");
        assert_eq!(s.take_refused_in(seqs[0], seqs[3]), 0, "taken once");
        assert!(s.take_refused(seqs[5]), "a refusal outside the range is left for its confirm");
        assert_eq!(s.take_refused_in(seqs[4], seqs[3]), 0, "an empty range");
    }

    #[test]
    fn a_confirm_waits_for_every_queue_it_went_to() {
        let s = session();
        assert_eq!(s.resolved_below(), u64::MAX);
        let (a, b) = (s.next_seq(), s.next_seq());
        s.sent(10, a);
        s.sent(20, a);
        s.sent(20, b);
        assert!(!s.is_resolved(a));
        s.resolved(10, [(a, false)]);
        assert!(!s.is_resolved(a), "queue 20 has not applied it yet");
        s.resolved(20, [(b, false)]);
        assert!(!s.is_resolved(a), "b resolved out of order does not resolve a");
        s.resolved(20, [(a, true)]);
        assert!(s.is_resolved(a) && s.is_resolved(b));
        assert!(s.take_refused(a), "refused by queue 20: a nack");
        assert!(!s.take_refused(b));
    }
}
