//! A classic queue's window of ready messages: refilled from the store as it drains, expired at
//! the head, dropped at the head past max-length, dead-lettered.

use super::*;

impl Queue {
    /// Tops up the current lane's window from its span when it runs low. The read (up to 4 MiB, and a
    /// wait for the queue log's lock, which the store's writer holds while a checkpoint copies records
    /// into the queue's files: on a full disk, until space is back) must hold neither this queue's lock
    /// nor a runtime thread: on a runtime it runs on a blocking thread and `refilled_from_store` merges
    /// it under the lock. Without a runtime (startup, tests) it reads here.
    pub(super) fn refill_locked(&self, st: &mut QueueState, after: &mut AfterUnlock) {
        let (window_messages, window) = self.window();
        // Rewound messages below the window's head first (`rewind`).
        while st.rewound_due() && !st.refill_in_flight {
            if !self.refill_rewound_locked(st, after) {
                return;
            }
        }
        while st.span_count > 0 && st.ready.len() < window_messages / 2 && st.ready_mem < window / 2 && !st.refill_in_flight {
            if let Some(watermark) = st.refill_found_nothing {
                if !self.store.is_readable(watermark + 1) {
                    return; // nothing new can be readable yet
                }
                st.refill_found_nothing = None;
            }
            let want = window_messages - st.ready.len();
            let budget = (window - st.ready_mem) as usize;
            let (store_id, from, epoch) = (st.store_id, st.span_from, st.span_epoch);
            if let (Ok(rt), Some(me)) = (tokio::runtime::Handle::try_current(), self.me.upgrade()) {
                st.refill_in_flight = true;
                rt.spawn_blocking(move || {
                    let read = me.read_span(store_id, from, want, budget);
                    me.refilled_from_store(store_id, from, epoch, read);
                });
                return;
            }
            let read = self.read_span(store_id, from, want, budget);
            if !self.take_read(st, after, read) {
                return;
            }
        }
    }

    /// Reads a lane's span from `from`, with the readable watermark from before the read (`SpanRead`):
    /// the read saw everything appended up to it, so reading again finds more only once it moved.
    fn read_span(&self, store_id: u64, from: u64, want: usize, budget: usize) -> SpanRead {
        let watermark = *self.store.readable().borrow();
        SpanRead { watermark, read: self.store.read(store_id, from, want, budget) }
    }

    /// Merges a read of a lane's span made off the lock (see `refill_locked`), unless the span changed
    /// meanwhile (purged, deleted: the read is dropped), then delivers.
    pub(super) fn refilled_from_store(self: &Arc<Self>, store_id: u64, from: u64, epoch: u64, read: SpanRead) {
        self.merge_read(store_id, |me, st, after| {
            if st.span_epoch == epoch && st.span_from == from && me.take_read(st, after, read) {
                me.drop_head_over_limit(st, after);
            }
        });
    }

    /// Merges a read made off the lock into the lane of `store_id` (`take`, which drops a stale
    /// one), then delivers and wakes basic.gets waiting for it.
    pub(super) fn merge_read(self: &Arc<Self>, store_id: u64, take: impl FnOnce(&Self, &mut QueueState, &mut AfterUnlock)) {
        let Some(c) = self.classic() else { return };
        let mut after = AfterUnlock::default();
        {
            let mut st = c.state.lock();
            st.refills_done += 1;
            if !st.deleted {
                st.select(store_id.saturating_sub(self.id) as usize);
                st.refill_in_flight = false;
                take(self, &mut st, &mut after);
                self.dispatch_locked(&mut st, crate::now_ms(), &mut after);
            }
        }
        c.refilled.notify_waiters();
        self.finish(after);
    }

    /// Puts what a read of the current lane's span returned into its window. False if it found nothing
    /// (an error, or the store's writer has not applied those messages yet: a later read gets them).
    fn take_read(&self, st: &mut QueueState, after: &mut AfterUnlock, read: SpanRead) -> bool {
        let batch = match read.read {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(queue = %self.name, error = %e, "could not read messages back from the store");
                st.refill_found_nothing = Some(read.watermark);
                return false;
            }
        };
        if batch.messages.is_empty() && batch.lost == 0 {
            st.refill_found_nothing = Some(read.watermark);
            return false;
        }
        st.span_from = batch.next_seq;
        // (Holes: seqs a rewind made live without a record, e.g. before a restart; not there.)
        st.span_count = st.span_count.saturating_sub(batch.messages.len() as u64 + batch.lost + batch.holes);
        for m in batch.messages {
            st.span_store_bytes = st.span_store_bytes.saturating_sub(m.payload.len() as u64);
            let stored_bytes = m.payload.len() as u64;
            let Some((message, expires_at_ms)) = self.decode_read(st.store_id, &m, after) else { continue };
            st.span_bytes = st.span_bytes.saturating_sub(message.body_len() as u64);
            if self.lost_to_restart(st, m.seq, &message) {
                after.acks.ack(st.store_id, m.seq, stored_bytes);
                continue;
            }
            st.ready_bytes += message.body_len() as u64;
            st.ready_mem += message.memory_bytes() as u64;
            let redelivered = m.seq < st.redelivered_below;
            st.ready.push_back(Entry { message, seq: m.seq, stored_bytes, expires_at_ms, redelivered, returned: 0 });
        }
        if st.span_count == 0 {
            st.span_bytes = 0;
            st.span_store_bytes = 0;
        }
        true
    }

    /// A message read back from a lane's store queue, with its expiry; an unreadable one is dropped
    /// (acked in the store, logged).
    pub(super) fn decode_read(&self, store_id: u64, m: &warren_store::StoredMessage, after: &mut AfterUnlock) -> Option<(Arc<Message>, Option<u64>)> {
        let Some(stored) = decode_stored(&m.payload) else {
            tracing::error!(queue = %self.name, seq = m.seq, "unreadable message in the store; dropping it");
            after.acks.ack(store_id, m.seq, m.payload.len() as u64);
            return None;
        };
        let message = Arc::new(stored.message);
        let expires_at_ms = self.expiry_for(&message, stored.expires_at_ms.unwrap_or(m.timestamp_ms));
        Some((message, expires_at_ms))
    }

    /// A transient message the store held from before a restart: it does not survive one.
    pub(super) fn lost_to_restart(&self, st: &QueueState, seq: u64, message: &Message) -> bool {
        seq < st.recovered_until && !(self.durable && message.persistent)
    }

    /// A lane's window (messages, bytes): a priority queue's lanes share the budget of one classic
    /// queue (each at least 16 messages and 16 KiB), so memory stays bounded whatever the levels.
    pub(in crate::queue) fn window(&self) -> (usize, u64) {
        let bytes = window_bytes();
        if self.args.max_priority == 0 {
            return (WINDOW_MESSAGES, bytes);
        }
        let lanes = self.args.max_priority as u64 + 1;
        ((WINDOW_MESSAGES / lanes as usize).max(16), (bytes / lanes).max(16 << 10))
    }

    /// Makes the lane to deliver from current (the highest priority holding ready messages), with its
    /// window refilled and expired messages dropped (`inclusive`: see `expire_locked`). A lane whose
    /// next messages are being read, or not readable yet (the store writer is a moment behind:
    /// `Store::readable`), is waited for, never passed over: a get-empty or a lower priority first
    /// would be a lie.
    pub(super) fn select_head(&self, st: &mut QueueState, now_ms: u64, inclusive: bool, after: &mut AfterUnlock) -> Head {
        if !st.levels.is_priority() {
            return self.lane_head(st, now_ms, inclusive, after).unwrap_or(Head::Empty);
        }
        // Highest first, without collecting the levels: this runs once per message dispatched.
        let mut below = st.levels.lane_count();
        loop {
            let next = st.levels.non_empty_desc(&st.lane).find(|&level| level < below);
            let Some(level) = next else { break };
            below = level;
            st.select(level);
            if let Some(head) = self.lane_head(st, now_ms, inclusive, after) {
                return head;
            }
        }
        Head::Empty
    }

    /// The current lane's head, refilled and expired; None if the lane has nothing to deliver.
    fn lane_head(&self, st: &mut QueueState, now_ms: u64, inclusive: bool, after: &mut AfterUnlock) -> Option<Head> {
        self.refill_locked(st, after);
        self.expire_locked(st, now_ms, inclusive, after);
        if st.rewound_due() {
            // (What expired may have uncovered a rewound message below the new head.)
            self.refill_locked(st, after);
            if st.refill_in_flight {
                return Some(Head::Refilling);
            }
        }
        if !st.ready.is_empty() {
            return Some(Head::Ready);
        }
        if st.span_count == 0 {
            return None;
        }
        if st.refill_in_flight {
            return Some(Head::Refilling);
        }
        // A span the store had made readable and a read still did not give back is not there (lost):
        // passed over rather than waited for forever.
        (!self.store.is_readable(st.span_ticket)).then_some(Head::Unreadable(st.span_ticket))
    }

    pub(super) fn is_full(&self, st: &QueueState, incoming_bytes: u64) -> bool {
        self.args.max_length.is_some_and(|max| ready_count(st) >= max)
            || self.args.max_length_bytes.is_some_and(|max| ready_bytes(st) + incoming_bytes > max)
    }

    pub(super) fn drop_head_over_limit(&self, st: &mut QueueState, after: &mut AfterUnlock) {
        if self.args.overflow != Overflow::DropHead {
            return;
        }
        loop {
            let over = self.args.max_length.is_some_and(|max| ready_count(st) > max)
                || self.args.max_length_bytes.is_some_and(|max| ready_bytes(st) > max);
            if !over {
                break;
            }
            // The head: of the highest priority, in a priority queue (as RabbitMQ drops).
            st.select_highest();
            self.refill_locked(st, after);
            if st.rewound_due() {
                // The oldest are rewound messages still being read: the read's merge drops them.
                break;
            }
            let Some(entry) = pop_ready(st) else { break };
            self.dead_letter_into(after, entry, DeathReason::MaxLen);
        }
    }

    /// Drops expired messages from the head. `inclusive` also drops those expiring exactly now
    /// (after a delivery attempt, so that TTL 0 means "deliver now or never").
    pub(super) fn expire_locked(&self, st: &mut QueueState, now_ms: u64, inclusive: bool, after: &mut AfterUnlock) {
        while let Some(head) = st.ready.front() {
            let expired = match head.expires_at_ms {
                Some(at) => at < now_ms || (inclusive && at == now_ms),
                None => false,
            };
            if !expired {
                break;
            }
            if let Some(entry) = pop_ready(st) {
                self.dead_letter_into(after, entry, DeathReason::Expired);
            }
        }
    }

    /// Either dead-letters an entry (if the queue has a DLX) or just drops it; both settle it in the store.
    pub(super) fn dead_letter_into(&self, after: &mut AfterUnlock, entry: Entry, reason: DeathReason) {
        entry.settle_in_store(self.store_id_of(&entry), &mut after.acks);
        if let Some(exchange) = &self.args.dead_letter_exchange {
            after.dead.push(DeadLetter {
                message: entry.message,
                reason,
                queue: self.name.clone(),
                exchange: exchange.clone(),
                routing_key: self.args.dead_letter_routing_key.clone(),
                settle: None,
            });
        }
    }
}
