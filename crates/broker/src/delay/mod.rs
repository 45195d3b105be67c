//! Delayed delivery: messages published to an `x-delayed-message` exchange with a positive
//! `x-delay` header wait in the node's delay store until due, then go to the queues the exchange
//! routed them to when they were published.
//!
//! **Where they wait.** Node-wide *slots*, each a store queue of its own holding the messages due
//! in one span of time, bodies included ([`record`]): a *fine* slot per second for what is due
//! within an hour (the horizon), a *coarse* slot per hour beyond. A publish appends one record (one
//! body, whatever the number of queues it reached) to its slot and is confirmed once that is
//! durable, as any persistent message. Nothing is kept in memory per message: the slot directory
//! (≤ ~7,200 fine and 8,800 coarse slots), and the records of the slots about to fire.
//!
//! **How they leave** ([`timer`]): a second before a fine slot starts, its records are read
//! (sequentially: one slot, one second's messages), sorted by due time (same due: publish order)
//! and each is published to its queues when due, as at-least-once dead letters are: the slot is
//! dropped only once every queue it reached holds its messages durably, so a crash at any point
//! delivers again rather than loses. An hour before a coarse slot starts, its records are moved
//! (copied, then acked in the same batch) into fine slots. A slot that has started takes no more
//! records once closed: a late publish goes to the next open one.
//!
//! **Counts** per queue are kept in memory: added at publish, taken at firing; after a start the
//! timer counts the recovered slots' records once, before it fires any.

pub mod record;
mod timer;

use crate::error::{BrokerError, Result};
use crate::message::Message;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;
use warren_store::{Batch, RecoveredQueue, Store, SyncTicket};

/// Store queue ids of delay slots: `DELAY_SLOT_QUEUES | level << 40 | index`. Below the Raft
/// ranges (`warren_store::RAFT_STATE_QUEUES`); queue ids stay below it.
pub const DELAY_SLOT_QUEUES: u64 = 1 << 60;

/// Fine slots are one second each, for messages due within the horizon (an hour) of their
/// publish; coarse slots are as long as the horizon, and moved into fine slots a horizon ahead.
const HORIZON_MS: u64 = 3600 * 1000;
const FINE_MS: u64 = 1000;

/// The horizon: `HORIZON_MS`, or in test builds `WARREN_TEST_DELAY_HORIZON_MS` (so that a test
/// sees coarse slots moved within seconds).
pub(crate) fn horizon_ms() -> u64 {
    static HORIZON: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *HORIZON.get_or_init(|| {
        warren_store::test_hooks::millis("WARREN_TEST_DELAY_HORIZON_MS", "delayed messages due later than this go to coarse slots this long")
            .map_or(HORIZON_MS, |d| (d.as_millis() as u64).max(FINE_MS))
    })
}

/// A slot: its level (0 fine, 1 coarse) and index (its start / its width).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct SlotKey {
    level: u8,
    index: u64,
}

impl SlotKey {
    fn width(self) -> u64 {
        if self.level == 0 {
            FINE_MS
        } else {
            horizon_ms()
        }
    }
    fn start_ms(self) -> u64 {
        self.index.saturating_mul(self.width())
    }
    fn end_ms(self) -> u64 {
        self.start_ms().saturating_add(self.width())
    }
    fn store_id(self) -> u64 {
        DELAY_SLOT_QUEUES | (u64::from(self.level) << 40) | self.index
    }
    fn of_store_id(id: u64) -> Option<SlotKey> {
        if id & !((1 << 41) - 1) != DELAY_SLOT_QUEUES {
            return None;
        }
        Some(SlotKey { level: ((id >> 40) & 1) as u8, index: id & ((1 << 40) - 1) })
    }
}

/// Whether store queue `id` is a delay slot (the broker leaves those to [`Delays`] at a start).
pub fn is_delay_slot(id: u64) -> bool {
    SlotKey::of_store_id(id).is_some()
}

#[derive(Debug, Default)]
struct Slot {
    next_seq: u64,
    /// The ticket of the last batch that appended to it: its records are readable once
    /// `Store::readable` reaches it.
    last_ticket: SyncTicket,
}

#[derive(Debug, Default)]
struct Directory {
    slots: BTreeMap<SlotKey, Slot>,
    /// Recovered slots whose records are not counted yet, with their next seq at the start (what
    /// the count reads; later records were counted as they were published). The timer fires a fine
    /// slot only once counted (firing takes from the counts), and moves coarse slots only once all
    /// are: a start counts the earliest slots first, so firing resumes before a big backlog is counted.
    uncounted: BTreeMap<SlotKey, u64>,
    /// Per level, the first index that takes records: slots below are closed (being fired or moved).
    open_from: [u64; 2],
}

impl Directory {
    /// The slot a message due at `due_ms` goes to when published at `now_ms`.
    fn slot_for(&self, due_ms: u64, now_ms: u64) -> SlotKey {
        if due_ms >= now_ms.saturating_add(horizon_ms()) {
            let index = due_ms / horizon_ms();
            if index >= self.open_from[1] {
                return SlotKey { level: 1, index };
            }
        }
        SlotKey { level: 0, index: (due_ms / FINE_MS).max(self.open_from[0]) }
    }
}

/// What the timer asks of the node when a delayed message is due (`Broker` implements it; the
/// delay store names no broker or vhost).
pub trait DueHost: Send + Sync {
    /// Queue `id` of vhost `vhost`, unless one or the other was deleted.
    fn due_queue(&self, vhost: &str, id: u64) -> Option<Arc<crate::queue::Queue>>;
    /// Publishes a due message to `queue` of `vhost` as an at-least-once dead letter: `settle` is
    /// told true once the queue holds it durably, false when it must be tried again (also when the
    /// vhost is gone).
    fn publish_due(&self, vhost: &str, message: crate::message::MessageRef, queue: &Arc<crate::queue::Queue>, settle: crate::deadletter::SettleDeadLetter);
}

/// The node's delayed messages (one per broker, shared by its vhosts).
pub struct Delays {
    store: Store,
    dir: Mutex<Directory>,
    /// Delayed messages held per queue id.
    counts: Mutex<HashMap<u64, u64>>,
    /// The timer's next planned wake-up (ms); a publish due earlier wakes it.
    next_wake_ms: AtomicU64,
    wake: Notify,
    timer_started: AtomicBool,
    /// The count of recovered slots has begun (`timer::count_recovered`).
    counting: AtomicBool,
}

impl Delays {
    /// The delay store of a broker whose store recovered `recovered` (the slots among them).
    pub fn new(store: Store, recovered: &[RecoveredQueue]) -> Arc<Delays> {
        let mut dir = Directory::default();
        for rec in recovered {
            if let Some(key) = SlotKey::of_store_id(rec.queue) {
                // Empty ones too: the timer drops them in turn.
                dir.slots.insert(key, Slot { next_seq: rec.next_seq, last_ticket: 0 });
                dir.uncounted.insert(key, rec.next_seq);
            }
        }
        // A slot of the previous run that was dropped is not reused while the clock goes forward.
        dir.open_from[0] = crate::now_ms() / FINE_MS;
        horizon_ms(); // read (and a test's setting logged) at the start
        Arc::new(Delays {
            store,
            dir: Mutex::new(dir),
            counts: Mutex::new(HashMap::new()),
            next_wake_ms: AtomicU64::new(u64::MAX),
            wake: Notify::new(),
            timer_started: AtomicBool::new(false),
            counting: AtomicBool::new(false),
        })
    }

    /// Starts the timer that fires due messages (once; needs a Tokio runtime). `broker` resolves a
    /// record's vhost and queues when it is due.
    pub fn start(self: &Arc<Self>, broker: std::sync::Weak<dyn DueHost>) {
        if !self.timer_started.swap(true, Ordering::AcqRel) {
            tokio::spawn(timer::run(self.clone(), broker));
        }
    }

    /// Holds `message`, routed to `queues` of `vhost`, for `delay_ms`: appends it to its slot.
    /// The message is durable once the store reaches the returned ticket. The caller checked the
    /// delay (`check_delay`).
    pub fn hold(&self, vhost: &str, queues: &[u64], message: &Message, delay_ms: u64) -> Result<SyncTicket> {
        if queues.len() > u16::MAX as usize {
            return Err(BrokerError::precondition_failed(format!(
                "a delayed message can reach at most {} queues; this one reached {}",
                u16::MAX,
                queues.len()
            )));
        }
        let now = crate::now_ms();
        // From the clock rounded up to the next millisecond, so that "due" is never before publish
        // time plus the delay (rounded down, a message came up to a millisecond early).
        let due = now_ms_rounded_up() + delay_ms;
        let payload = record::encode(due, vhost, queues, message);
        // Counted first: with a 1 ms delay the timer may fire it before this thread goes on.
        self.add_counts(queues, crate::run_id());
        let ticket = self.append(&[(due, &payload)], now, &mut Batch::new()).inspect_err(|_| self.uncount(queues, crate::run_id()))?;
        if due < self.next_wake_ms.load(Ordering::Acquire) {
            self.wake.notify_one();
        }
        Ok(ticket)
    }

    /// Appends records (due time, payload) to their slots, with whatever `batch` holds already,
    /// in one store batch.
    fn append(&self, records: &[(u64, &[u8])], now_ms: u64, batch: &mut Batch) -> Result<SyncTicket> {
        // Under the directory's lock: seqs go to the store in the order they are handed out.
        let mut dir = self.dir.lock();
        let mut used = Vec::with_capacity(records.len());
        for (due_ms, payload) in records {
            let key = dir.slot_for(*due_ms, now_ms);
            let slot = dir.slots.entry(key).or_default();
            batch.enqueue(key.store_id(), slot.next_seq, now_ms, &[payload]);
            slot.next_seq += 1;
            used.push(key);
        }
        let appended = self.store.append(batch);
        match appended {
            Ok(ticket) => {
                for key in used {
                    if let Some(slot) = dir.slots.get_mut(&key) {
                        slot.last_ticket = ticket;
                    }
                }
                Ok(ticket)
            }
            Err(e) => {
                // Nothing of the batch was written: hand the seqs out again.
                for key in used.iter().rev() {
                    if let Some(slot) = dir.slots.get_mut(key) {
                        slot.next_seq -= 1;
                    }
                }
                Err(BrokerError::internal(format!("the message store refused a delayed message: {e}")))
            }
        }
    }

    /// Delayed messages held for queue `id`.
    pub fn count(&self, id: u64) -> u64 {
        self.counts.lock().get(&id).copied().unwrap_or(0)
    }

    fn add_counts(&self, queues: &[u64], run: u64) {
        let mut counts = self.counts.lock();
        for id in queues.iter().filter(|id| counted(**id, run)) {
            *counts.entry(*id).or_default() += 1;
        }
    }

    fn uncount(&self, queues: &[u64], run: u64) {
        let mut counts = self.counts.lock();
        for id in queues.iter().filter(|id| counted(**id, run)) {
            if let Some(n) = counts.get_mut(id) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    counts.remove(id);
                }
            }
        }
    }
}

fn now_ms_rounded_up() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros().div_ceil(1000) as u64)
        .unwrap_or(0)
}

/// Whether a record of run `run` names queue `id` in this run: a transient queue's id (from
/// `TRANSIENT_QUEUE_IDS` on) only in the run that published it.
fn counted(id: u64, run: u64) -> bool {
    id < crate::queue::TRANSIENT_QUEUE_IDS || run == crate::run_id()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_by_due_time() {
        let dir = Directory::default();
        let now = 1_800_000_000_000;
        assert_eq!(dir.slot_for(now + 1500, now), SlotKey { level: 0, index: (now + 1500) / 1000 });
        assert_eq!(dir.slot_for(now + HORIZON_MS - 1, now).level, 0);
        let far = dir.slot_for(now + 90 * 24 * 3600 * 1000, now);
        assert_eq!((far.level, far.index), (1, (now + 90 * 24 * 3600 * 1000) / HORIZON_MS));
        for key in [SlotKey { level: 0, index: now / 1000 }, far] {
            assert!(is_delay_slot(key.store_id()));
            assert_eq!(SlotKey::of_store_id(key.store_id()), Some(key));
            assert!(key.store_id() < warren_store::RAFT_STATE_QUEUES);
        }
        assert!(!is_delay_slot(42) && !is_delay_slot(warren_store::RAFT_LOG_QUEUES | 3) && !is_delay_slot(1 << 63));
    }

    #[test]
    fn closed_slots_take_no_records() {
        let mut dir = Directory::default();
        let now = 1_800_000_000_000;
        dir.open_from = [now / 1000 + 5, (now + 2 * HORIZON_MS) / HORIZON_MS + 1];
        // Due in a closed fine slot (or already due): the first open one.
        assert_eq!(dir.slot_for(now + 10, now), SlotKey { level: 0, index: now / 1000 + 5 });
        // Due in a closed coarse slot (being moved): a fine slot.
        assert_eq!(dir.slot_for(now + 2 * HORIZON_MS, now).level, 0);
        assert_eq!(dir.slot_for(now + 30 * HORIZON_MS, now).level, 1);
    }
}

/// Refuses a delay longer than Warren holds (`record::MAX_DELAY_MS`).
pub fn check_delay(delay_ms: u64) -> Result<()> {
    if delay_ms > record::MAX_DELAY_MS {
        return Err(BrokerError::precondition_failed(format!(
            "x-delay {delay_ms} ms is longer than the longest delay Warren holds ({} days)",
            record::MAX_DELAY_MS / (24 * 3600 * 1000)
        )));
    }
    Ok(())
}
