//! The delay timer (one task per node): counts what a start recovered, loads fine slots a moment
//! before they start, publishes each message when due, drops a slot once all it held is durable
//! in its queues, and moves coarse slots into fine ones an hour ahead.

use super::{counted, horizon_ms, record, Delays, DueHost, SlotKey};
use crate::queue::Queue;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use warren_store::{Batch, SyncTicket};

/// A fine slot is read this long before it starts, so that its first messages leave on time.
const LOOKAHEAD_MS: u64 = 1000;
/// Records loaded and not yet fired, at most (about): a slot bigger than this is fired in parts.
const LOADED_LIMIT: usize = 32 << 20;
/// What one read takes from a slot.
const READ_BYTES: usize = 4 << 20;
const READ_COUNT: usize = 4096;
/// Bytes moved from coarse slots per round of the timer: firing is not held up by a big move.
const MOVE_BUDGET: usize = 8 << 20;
/// A message its queues refused (no majority in time, a home node down) is tried again this much later.
const RETRY_MS: u64 = 5000;
/// Fired messages not yet held durably by their queues, at most: past it, due ones wait.
const MAX_UNSETTLED: usize = 20_000;
/// While fired messages wait for their queues' confirms, the timer looks again this often.
const SETTLE_POLL_MS: u64 = 10;

/// A fine slot being fired.
struct Firing {
    /// The next seq to read.
    read_next: u64,
    /// Its records loaded and not yet fired.
    loaded: usize,
    /// It takes no more records (`Directory::open_from` is past it).
    closed: bool,
    settling: Arc<Settling>,
}

/// The fired messages of one slot whose queues have not all confirmed them.
#[derive(Default)]
struct Settling {
    unsettled: AtomicUsize,
    /// The newest retry's ticket: the slot goes once that is durable too.
    retry_ticket: AtomicU64,
    /// A retry could not be written: the slot stays (its messages come again after a restart).
    failed: AtomicBool,
}

/// A loaded record, by (due, slot index, seq): due order, and publish order for the same due.
type DueKey = (u64, u64, u64);

/// A coarse slot being moved into fine slots.
struct Moving {
    key: SlotKey,
    read_next: u64,
    until: u64,
    /// The ticket of the last append to it: its records are read once that is readable.
    last_ticket: SyncTicket,
}

struct Timer {
    delays: Arc<Delays>,
    firing: BTreeMap<u64, Firing>,
    /// Loaded records and their sizes.
    due: BTreeMap<DueKey, (record::DelayedRecord, usize)>,
    loaded_bytes: usize,
    moving: Option<Moving>,
    /// A slot holds records the store has not made readable yet.
    waiting_for_records: bool,
    /// Due messages were held back by flow control this round.
    held_back: bool,
}

pub(super) async fn run(delays: Arc<Delays>, broker: Weak<dyn DueHost>) {
    let counter = delays.clone();
    let spawned = std::thread::Builder::new().name("warren-delay-count".into()).spawn(move || count_recovered(&counter));
    if let Err(e) = spawned {
        tracing::error!(error = %e, "could not start a thread to count the recovered delayed messages; counting them first");
        crate::blocking::run(|| count_recovered(&delays));
    }
    let mut readable = delays.store.readable();
    let mut timer = Timer { delays: delays.clone(), firing: BTreeMap::new(), due: BTreeMap::new(), loaded_bytes: 0, moving: None, waiting_for_records: false, held_back: false };
    loop {
        let Some(broker) = broker.upgrade() else { return };
        // While this round runs, any publish wakes the next one (it may have missed this round's load).
        delays.next_wake_ms.store(u64::MAX, Ordering::Release);
        let now = crate::now_ms();
        timer.waiting_for_records = false;
        // Directly on the runtime, not through `blocking::run`: reads of at most 32 MiB a round,
        // mostly from the page cache (a slot is read a second after it was written), and
        // `block_in_place` a thousand times a second handed the worker's tasks to new threads
        // each time: under load the allocator kept ~800 MB spread over their arenas.
        timer.move_coarse(now);
        timer.load(now);
        timer.fire(&*broker, now);
        timer.close(now);
        drop(broker);
        let next = timer.next_wake(now);
        delays.next_wake_ms.store(next, Ordering::Release);
        let sleep = Duration::from_millis(next.saturating_sub(crate::now_ms()));
        let wait_readable = timer.waiting_for_records;
        tokio::select! {
            _ = delays.wake.notified() => {}
            _ = tokio::time::sleep(sleep) => {}
            _ = readable.changed(), if wait_readable => {}
        }
    }
}

/// Counts the recovered slots' records per queue, earliest slots first, marking each counted
/// (`Directory::uncounted`): the timer fires a slot only once its records are counted.
fn count_recovered(delays: &Delays) {
    if delays.counting.swap(true, Ordering::AcqRel) {
        return;
    }
    let slots: Vec<(SlotKey, u64)> = delays.dir.lock().uncounted.iter().map(|(k, until)| (*k, *until)).collect();
    let started = std::time::Instant::now();
    let mut held = 0u64;
    for (key, until) in slots {
        let mut from = 0;
        while from < until {
            let batch = match delays.store.read_range(key.store_id(), from..until, READ_COUNT, READ_BYTES) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(slot = key.store_id(), error = %e, "could not read a delay slot to count its messages");
                    break;
                }
            };
            let mut counts = delays.counts.lock();
            for m in &batch.messages {
                if let Some(rec) = record::decode(&m.payload) {
                    held += 1;
                    for id in rec.queues.iter().filter(|id| counted(**id, rec.run)) {
                        *counts.entry(*id).or_default() += 1;
                    }
                }
            }
            if batch.next_seq <= from {
                break;
            }
            from = batch.next_seq;
        }
        delays.dir.lock().uncounted.remove(&key);
        delays.wake.notify_one();
    }
    if held > 0 {
        tracing::info!(messages = held, elapsed_ms = started.elapsed().as_millis() as u64, "delayed messages recovered");
    }
}

impl Timer {
    /// Reads the records of fine slots starting within `LOOKAHEAD_MS` that are not loaded yet.
    fn load(&mut self, now: u64) {
        let candidates: Vec<(SlotKey, u64, SyncTicket)> = {
            let dir = self.delays.dir.lock();
            dir.slots
                .range(SlotKey { level: 0, index: 0 }..SlotKey { level: 1, index: 0 })
                .take_while(|(k, _)| k.start_ms() <= now + LOOKAHEAD_MS)
                // (A recovered slot waits for its count; later ones need not.)
                .filter(|(k, _)| !dir.uncounted.contains_key(k))
                .map(|(k, s)| (*k, s.next_seq, s.last_ticket))
                .collect()
        };
        for (key, next_seq, last_ticket) in candidates {
            if self.loaded_bytes >= LOADED_LIMIT {
                return;
            }
            let firing = self.firing.entry(key.index).or_insert_with(|| Firing { read_next: 0, loaded: 0, closed: false, settling: Arc::default() });
            while firing.read_next < next_seq && self.loaded_bytes < LOADED_LIMIT {
                // Looked at before the read: a record made readable in between is then read next round.
                let all_readable = self.delays.store.is_readable(last_ticket);
                let batch = match self.delays.store.read_range(key.store_id(), firing.read_next..next_seq, READ_COUNT, READ_BYTES) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::error!(slot = key.store_id(), error = %e, "could not read a delay slot; trying again");
                        self.waiting_for_records = true;
                        break;
                    }
                };
                for m in batch.messages {
                    match record::decode(&m.payload) {
                        Some(rec) => {
                            self.loaded_bytes += m.payload.len();
                            firing.loaded += 1;
                            self.due.insert((rec.due_ms, key.index, m.seq), (rec, m.payload.len()));
                        }
                        None => tracing::error!(slot = key.store_id(), seq = m.seq, "a delayed message does not decode; it is dropped"),
                    }
                }
                if batch.next_seq <= firing.read_next {
                    // Appended, not readable yet: the next round comes when the store has made more readable.
                    self.waiting_for_records |= !all_readable;
                    break;
                }
                firing.read_next = batch.next_seq;
            }
        }
    }

    /// Publishes every loaded message that is due.
    fn fire(&mut self, broker: &dyn DueHost, now: u64) {
        self.held_back = false;
        if self.due.first_key_value().is_none_or(|((due, _, _), _)| *due > now) {
            return;
        }
        let mut unsettled: usize = self.firing.values().map(|f| f.settling.unsettled.load(Ordering::Acquire)).sum();
        while let Some(entry) = self.due.first_entry() {
            if entry.key().0 > now {
                break;
            }
            // Flow control, as publishers get it: while the store is behind or many fired messages
            // wait for their queues, the rest waits (memory stays bounded; they leave late).
            if unsettled >= MAX_UNSETTLED || self.delays.store.is_behind() {
                self.held_back = true;
                break;
            }
            let ((_, index, _), (rec, len)) = entry.remove_entry();
            self.loaded_bytes = self.loaded_bytes.saturating_sub(len);
            let Some(firing) = self.firing.get_mut(&index) else { continue };
            firing.loaded = firing.loaded.saturating_sub(1);
            self.delays.uncount(&rec.queues, rec.run);
            let wanted = |id: &&u64| counted(**id, rec.run);
            let queues: Vec<Arc<Queue>> =
                rec.queues.iter().filter(wanted).filter_map(|id| broker.due_queue(&rec.vhost, *id).filter(|q| !q.is_deleted())).collect();
            if queues.is_empty() {
                continue; // its queues (or its vhost) were deleted
            }
            let Some(message) = record::due_message(&rec.message) else {
                tracing::error!(vhost = %rec.vhost, "a delayed message does not decode; it is dropped");
                continue;
            };
            let message = Arc::new(message);
            let rec = Arc::new(rec);
            // Queue by queue: one that refuses it gets it again later, alone (the others hold it).
            for queue in queues {
                let settling = firing.settling.clone();
                settling.unsettled.fetch_add(1, Ordering::AcqRel);
                unsettled += 1;
                let (delays, retried, id) = (self.delays.clone(), rec.clone(), queue.id);
                broker.publish_due(
                    &rec.vhost,
                    message.clone(),
                    &queue,
                    Box::new(move |held| {
                        if !held {
                            delays.retry(&retried, id, &settling);
                        }
                        settling.unsettled.fetch_sub(1, Ordering::AcqRel);
                    }),
                );
            }
        }
    }

    /// Closes fine slots that ended and are all loaded; drops closed ones whose messages their
    /// queues all hold.
    fn close(&mut self, now: u64) {
        let mut dropped = Vec::new();
        for (&index, firing) in self.firing.iter_mut() {
            let key = SlotKey { level: 0, index };
            if !firing.closed && firing.loaded == 0 && key.end_ms() <= now {
                let mut dir = self.delays.dir.lock();
                let all_read = dir.slots.get(&key).is_none_or(|s| s.next_seq <= firing.read_next);
                if all_read {
                    dir.open_from[0] = dir.open_from[0].max(index + 1);
                    firing.closed = true;
                }
            }
            let settled = firing.settling.unsettled.load(Ordering::Acquire) == 0
                && self.delays.store.is_durable(firing.settling.retry_ticket.load(Ordering::Acquire));
            if firing.closed && settled && !firing.settling.failed.load(Ordering::Acquire) {
                dropped.push(index);
            }
        }
        if dropped.is_empty() {
            return;
        }
        let mut batch = Batch::new();
        {
            let mut dir = self.delays.dir.lock();
            for index in &dropped {
                let key = SlotKey { level: 0, index: *index };
                dir.slots.remove(&key);
                batch.drop_queue(key.store_id());
                self.firing.remove(index);
            }
        }
        // Not waited for: a drop lost to a crash fires the slot again (at-least-once).
        if let Err(e) = self.delays.store.append(&mut batch) {
            tracing::warn!(error = %e, "could not drop fired delay slots; they fire again after a restart");
        }
    }

    /// Moves the coarse slots starting within the horizon into fine slots, at most
    /// `MOVE_BUDGET` bytes per call: each part's copies and the ack of its originals in one batch.
    fn move_coarse(&mut self, now: u64) {
        let mut budget = MOVE_BUDGET;
        while budget > 0 {
            let Some(moving) = self.moving.as_mut() else {
                let mut dir = self.delays.dir.lock();
                if !dir.uncounted.is_empty() {
                    return; // moved records would be taken from counts not added yet
                }
                let next = dir
                    .slots
                    .range(SlotKey { level: 1, index: 0 }..)
                    .next()
                    .filter(|(k, _)| k.start_ms() <= now + horizon_ms())
                    .map(|(k, s)| (*k, s.next_seq, s.last_ticket));
                let Some((key, until, last_ticket)) = next else { return };
                // Closed first: what is published for its hour from now on goes to fine slots; what
                // was appended is read once readable.
                dir.open_from[1] = dir.open_from[1].max(key.index + 1);
                self.moving = Some(Moving { key, read_next: 0, until, last_ticket });
                continue;
            };
            if !self.delays.store.is_readable(moving.last_ticket) {
                self.waiting_for_records = true;
                return;
            }
            let id = moving.key.store_id();
            if moving.read_next >= moving.until {
                let key = moving.key;
                self.moving = None;
                self.delays.dir.lock().slots.remove(&key);
                let mut batch = Batch::new();
                batch.drop_queue(id);
                if let Err(e) = self.delays.store.append(&mut batch) {
                    tracing::warn!(error = %e, "could not drop a moved delay slot; it is moved again after a restart");
                }
                continue;
            }
            let batch = match self.delays.store.read_range(id, moving.read_next..moving.until, READ_COUNT, READ_BYTES.min(budget)) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(slot = id, error = %e, "could not read a coarse delay slot; trying again");
                    return;
                }
            };
            if batch.next_seq <= moving.read_next {
                // Nothing more to read below `until`: the rest is gone (moved before a crash).
                moving.read_next = moving.until;
                continue;
            }
            let records: Vec<(u64, &[u8])> = batch
                .messages
                .iter()
                .filter_map(|m| record::decode(&m.payload).map(|rec| (rec.due_ms, &m.payload[..])))
                .collect();
            let bytes: usize = batch.messages.iter().map(|m| m.payload.len()).sum();
            let mut also = Batch::new();
            also.ack_range(id, moving.read_next, batch.next_seq, bytes as u64);
            if let Err(e) = self.delays.append(&records, now, &mut also) {
                tracing::error!(slot = id, error = %e, "could not move delayed messages into their fine slots; trying again");
                return;
            }
            moving.read_next = batch.next_seq;
            budget = budget.saturating_sub(bytes.max(1));
        }
    }

    /// When to look again: the next due message, the next fine slot to load, the next coarse slot
    /// to move, settles awaited; at most a second away.
    fn next_wake(&self, now: u64) -> u64 {
        let mut next = now + 1000;
        if let Some(((due, _, _), _)) = self.due.first_key_value() {
            next = next.min(*due);
        }
        if self.firing.values().any(|f| f.closed) || self.moving.is_some() || self.held_back {
            next = next.min(now + SETTLE_POLL_MS);
        }
        if self.loaded_bytes >= LOADED_LIMIT {
            return next.max(now + 1); // the next slot loads as this one's messages leave
        }
        let dir = self.delays.dir.lock();
        if let Some((key, _)) = dir.slots.range(SlotKey { level: 0, index: 0 }..SlotKey { level: 1, index: 0 }).find(|(k, _)| !self.firing.contains_key(&k.index) && !dir.uncounted.contains_key(k)) {
            next = next.min(key.start_ms().saturating_sub(LOOKAHEAD_MS));
        }
        next.max(now + 1)
    }
}

impl Delays {
    /// A fired message queue `id` refused (full with reject-publish, its home node down or backed
    /// up, no majority in time): held again for that queue alone, `RETRY_MS` from now.
    fn retry(&self, rec: &record::DelayedRecord, id: u64, settling: &Settling) {
        let now = crate::now_ms();
        let again = record::encode_stored(now + RETRY_MS, rec.run, &rec.vhost, &[id], &rec.message);
        self.add_counts(&[id], rec.run);
        match self.append(&[(now + RETRY_MS, &again)], now, &mut Batch::new()) {
            Ok(ticket) => {
                settling.retry_ticket.fetch_max(ticket, Ordering::AcqRel);
                tracing::debug!(vhost = %rec.vhost, queue_id = id, "a due delayed message was refused by its queue; trying again in {RETRY_MS} ms");
            }
            Err(e) => {
                self.uncount(&[id], rec.run);
                settling.failed.store(true, Ordering::Release);
                tracing::error!(error = %e, "a due delayed message its queue refused could not be held again; it comes again after a restart");
            }
        }
        self.wake.notify_one();
    }
}
