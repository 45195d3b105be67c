//! A classic queue's operations on this node (its home): publish, consumers and dispatch, basic.get,
//! settle, purge, delete, the housekeeping tick.

use super::*;

impl Queue {
    /// `Queue::publish` of a classic queue on this node.
    pub(in crate::queue) fn classic_publish(
        self: &Arc<Self>,
        c: &Classic,
        message: &MessageRef,
        stored_header: &[u8],
        now_ms: u64,
        lazy_ok: bool,
    ) -> Result<Enqueued> {
        let mut after = AfterUnlock::default();
        let outcome = {
            let mut st = c.state.lock();
            if st.deleted {
                return Ok(Enqueued::Accepted { ticket: None, slow_publishers: false, store_behind: false });
            }
            let level = self.level_of(message);
            st.select(level);
            if self.args.overflow != Overflow::DropHead && self.is_full(&st, message.body_len() as u64) {
                if self.args.overflow == Overflow::RejectPublishDlx {
                    let entry = Entry { message: message.clone(), seq: 0, stored_bytes: 0, expires_at_ms: None, redelivered: false, returned: 0 };
                    self.dead_letter_into(&mut after, entry, DeathReason::MaxLen);
                }
                drop(st);
                self.finish(after);
                return Ok(Enqueued::Rejected);
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            let must_be_durable = self.durable && message.persistent;
            let (window_messages, window_bytes) = self.window();
            let paged = st.span_count > 0 || st.ready.len() >= window_messages || st.ready_mem >= window_bytes;
            // Without a confirm (`lazy_ok`), a message for no-ack consumers is written only if it is still
            // waiting at the next tick (see above). A confirmed one is always written before it is
            // confirmed: a delivery is only queued for the consumer's socket here, and a crash before it is
            // written would lose a message the publisher was told is safe.
            let all_no_ack = !st.consumers.is_empty() && st.consumers.receivers().all(|c| c.no_ack);
            let skip_store = must_be_durable && !paged && self.args.retention_ms == 0 && lazy_ok && all_no_ack;
            let ticket;
            let stored_bytes = if (must_be_durable && !skip_store) || paged || self.args.retention_ms > 0 {
                // The store takes a queue's seqs in increasing order: deferred ones go first.
                if st.has_deferred {
                    self.store_deferred_locked(&mut st, now_ms);
                }
                let store_id = st.store_id;
                let t = self.store_message(store_id, &mut st.stored_until, seq, now_ms, stored_header, message)?;
                if paged {
                    st.span_ticket = t;
                }
                ticket = must_be_durable.then_some(t);
                (stored_header.len() + message.body.len()) as u64
            } else {
                ticket = None;
                0
            };
            if paged {
                if st.span_count == 0 {
                    st.span_from = seq;
                }
                st.span_count += 1;
                st.span_bytes += message.body_len() as u64;
                st.span_store_bytes += stored_bytes;
            } else {
                let expires_at_ms = self.expiry_for(message, now_ms);
                st.ready_bytes += message.body_len() as u64;
                st.ready_mem += message.memory_bytes() as u64;
                st.ready.push_back(Entry { message: message.clone(), seq, stored_bytes, expires_at_ms, redelivered: false, returned: 0 });
            }
            self.drop_head_over_limit(&mut st, &mut after);
            self.dispatch_locked(&mut st, now_ms, &mut after);
            st.select(level);
            if skip_store && st.ready.back().is_some_and(|e| e.seq == seq && e.stored_bytes == 0) {
                st.has_deferred = true;
            }
            // TTL 0 (or an already past expiry): what no consumer took right now expires now.
            self.expire_locked(&mut st, now_ms, true, &mut after);
            let store_behind = (stored_bytes > 0 || ticket.is_some()) && self.store.is_behind();
            Enqueued::Accepted { ticket, slow_publishers: st.publishers_must_wait(), store_behind }
        };
        self.finish(after);
        Ok(outcome)
    }

    /// `Queue::wait_until_drained` of a classic queue on this node.
    pub(in crate::queue) async fn classic_wait_until_drained(&self, c: &Classic, max: std::time::Duration) {
        let notified = c.drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let mut st = c.state.lock();
            if !st.publishers_must_wait() || st.consumers.is_empty() {
                return;
            }
            st.publisher_waiting = true;
        }
        if tokio::time::timeout(max, notified).await.is_err() {
            c.state.lock().consumers_stalled = true;
        }
    }

    /// `Queue::dispatch` of a classic queue on this node.
    pub(in crate::queue) fn classic_dispatch(self: &Arc<Self>, c: &Classic) {
        let mut after = AfterUnlock::default();
        {
            let mut st = c.state.lock();
            if st.deleted {
                return;
            }
            self.dispatch_locked(&mut st, crate::now_ms(), &mut after);
        }
        self.finish(after);
    }

    /// `Queue::tick` of a classic queue on this node.
    pub(in crate::queue) fn classic_tick(self: &Arc<Self>, c: &Classic, now_ms: u64) -> bool {
        let mut after = AfterUnlock::default();
        let expired_unused = {
            let mut st = c.state.lock();
            if st.deleted {
                return false;
            }
            let lanes = st.levels.lane_count();
            for level in 0..lanes {
                st.select(level);
                // A read that found nothing is tried again at least once per tick.
                st.refill_found_nothing = None;
                self.refill_locked(&mut st, &mut after);
                self.expire_locked(&mut st, now_ms, true, &mut after);
            }
            self.dispatch_locked(&mut st, now_ms, &mut after);
            for level in 0..lanes {
                st.select(level);
                if st.has_deferred {
                    self.store_deferred_locked(&mut st, now_ms);
                }
            }
            self.args.expires_ms.is_some_and(|ttl| {
                st.consumers.is_empty() && now_ms.saturating_sub(st.last_used_ms) >= ttl
            })
        };
        self.finish(after);
        expired_unused
    }

    /// `Queue::store_lazy` of a classic queue on this node.
    pub(in crate::queue) fn classic_store_lazy(&self, c: &Classic) {
        let mut st = c.state.lock();
        if !st.deleted {
            for level in 0..st.levels.lane_count() {
                st.select(level);
                self.store_deferred_locked(&mut st, crate::now_ms());
            }
        }
    }

    /// `Queue::add_consumer` of a classic queue on this node.
    pub(in crate::queue) fn classic_add_consumer(self: &Arc<Self>, c: &Classic, consumer: Arc<Consumer>, on_registered: impl FnOnce()) -> Result<()> {
        {
            let mut st = c.state.lock();
            if st.deleted {
                return Err(BrokerError::not_found(format!("no queue '{}'", self.name)));
            }
            // An exclusive consumer excludes every other, and single active consumer excludes exclusive
            // ones (RabbitMQ answers both with 403).
            if st.consumers.iter().any(|c| c.exclusive)
                || (consumer.exclusive && (!st.consumers.is_empty() || self.args.single_active_consumer))
            {
                return Err(BrokerError::access_refused(format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    self.name,
                    self.vhost_name()
                )));
            }
            st.consumers.add(consumer);
            on_registered();
            st.had_consumers = true;
            st.last_used_ms = crate::now_ms();
        }
        self.dispatch();
        Ok(())
    }

    /// `Queue::remove_consumer` of a classic queue on this node.
    pub(in crate::queue) fn classic_remove_consumer(self: &Arc<Self>, c: &Classic, consumer: &Arc<Consumer>) {
        let mut after = AfterUnlock::default();
        {
            let mut st = c.state.lock();
            if st.consumers.remove(consumer) {
                // With single active consumer another may have taken over: it gets what is waiting.
                after.dispatch = self.args.single_active_consumer;
            }
            st.last_used_ms = crate::now_ms();
            if self.auto_delete && st.had_consumers && st.consumers.is_empty() && !st.deleted {
                after.auto_delete = true;
            }
        }
        self.finish(after);
    }

    /// `Queue::get` of a classic queue on this node.
    pub(in crate::queue) fn classic_get(self: &Arc<Self>, c: &Classic, channel: &dyn DeliverySink, no_ack: bool) -> Got {
        let mut after = AfterUnlock::default();
        let got = {
            let mut st = c.state.lock();
            let now = crate::now_ms();
            st.last_used_ms = now;
            let wait = match self.select_head(&mut st, now, true, &mut after) {
                Head::Ready | Head::Empty => None,
                // The next messages are being read from the store (`refill_locked`).
                Head::Refilling => Some(GetWait::Refill(st.refills_done)),
                Head::Unreadable(ticket) => Some(GetWait::Readable(ticket)),
            };
            if let Some(wait) = wait {
                drop(st);
                self.finish(after);
                return Got::Later(wait);
            }
            if !no_ack && self.head_is_deferred(&st) {
                // It becomes unacked: it must be in the store before anything could requeue it (see
                // `store_deferred_locked`), and then it needs its delivered mark too.
                self.store_deferred_locked(&mut st, now);
            }
            // The head's delivered mark must be durable first (see `delivery_marked`): once per 1,024
            // gets, the caller waits for that one fsync.
            if !self.delivery_marked(&mut st) {
                if let Some((_, ticket)) = st.mark_pending {
                    drop(st);
                    self.finish(after);
                    return Got::Later(GetWait::Durable(ticket));
                }
            }
            match pop_ready(&mut st) {
                None => Got::Empty,
                Some(entry) => {
                    let remaining = ready_count(&st).min(u32::MAX as u64) as u32;
                    match channel.deliver_get(self, entry, no_ack, remaining) {
                        // no-ack: the connection acks it in the store once written (`AckWhenWritten`).
                        Some(_consumed) => {}
                        None => st.unacked += 1,
                    }
                    Got::Message
                }
            }
        };
        self.finish(after);
        got
    }

    /// `Queue::settle` of a classic queue on this node.
    pub(in crate::queue) fn classic_settle(self: &Arc<Self>, c: &Classic, entries: Vec<Entry>, how: Settle, acks: &mut Batch) -> Option<SyncTicket> {
        let mut after = AfterUnlock::default();
        {
            let mut st = c.state.lock();
            st.unacked = st.unacked.saturating_sub(entries.len() as u64);
            for entry in entries {
                match how {
                    _ if st.deleted => {} // the queue's files went with it
                    Settle::Ack => entry.settle_in_store(self.store_id_of(&entry), acks),
                    Settle::Reject { requeue: true } => {
                        let mut entry = entry;
                        entry.redelivered = true;
                        entry.returned = entry.returned.saturating_add(1);
                        st.select(self.level_of(&entry.message));
                        push_ready_sorted(&mut st, entry);
                    }
                    Settle::Reject { requeue: false } => self.dead_letter_into(&mut after, entry, DeathReason::Rejected),
                }
            }
            if matches!(how, Settle::Reject { requeue: true }) && !st.deleted {
                self.drop_head_over_limit(&mut st, &mut after);
            }
        }
        self.finish(after)
    }

    /// `Queue::purge` of a classic queue on this node. Answers once the purge is durable: a purge-ok
    /// followed by a crash must not bring the messages back (nor rewound ones the purge dropped).
    pub(in crate::queue) fn classic_purge(self: &Arc<Self>, c: &Classic) -> Result<u32> {
        let mut after = AfterUnlock::default();
        let n = {
            let mut st = c.state.lock();
            drain_ready(&mut st, &mut after.acks)
        };
        if after.acks.is_empty() {
            return Ok(n);
        }
        let ticket = self.store.append(&mut after.acks).map_err(crate::queue::store_error)?;
        // A purge is rare: a blocking wait (off the worker's other tasks) for one group commit.
        crate::blocking::run(|| self.store.wait_durable(ticket)).map_err(|e| {
            BrokerError::internal(format!("the purge of queue '{}' is written but not known durable (the store: {e}); it may be undone by a crash", self.name))
        })?;
        Ok(n)
    }

    /// `Queue::mark_deleted` of a classic queue on this node.
    pub(in crate::queue) fn classic_mark_deleted(self: &Arc<Self>, c: &Classic) -> u32 {
        let (n, consumers, mut acks) = {
            let mut st = c.state.lock();
            st.deleted = true;
            let mut acks = Batch::new();
            let n = drain_ready(&mut st, &mut acks);
            // Everything the store holds for this queue goes at once, acked or not.
            acks.clear();
            for store_id in self.store_ids() {
                acks.drop_queue(store_id);
            }
            (n, st.consumers.take_all(), acks)
        };
        self.append_acks(&mut acks);
        for c in consumers {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
        n
    }

    /// Delivers ready messages to consumers with credit, in the order `Consumers::candidates` gives
    /// (priority, then round-robin).
    pub(super) fn dispatch_locked(self: &Arc<Self>, st: &mut QueueState, now_ms: u64, after: &mut AfterUnlock) {
        loop {
            if st.consumers.is_empty() {
                return;
            }
            match self.select_head(st, now_ms, false, after) {
                Head::Ready => {}
                // The read's merge (`refilled_from_store`) dispatches.
                Head::Empty | Head::Refilling => return,
                Head::Unreadable(ticket) => {
                    self.resume_when_readable(st, ticket);
                    return;
                }
            }
            let mut delivered = false;
            let mut candidates = st.consumers.candidates();
            while let Some((slot, consumer)) = candidates.next(&st.consumers) {
                if !consumer.has_credit() {
                    continue;
                }
                if !consumer.no_ack && self.head_is_deferred(st) {
                    // Deferred entries never become unacked unstored (see `store_deferred_locked`).
                    self.store_deferred_locked(st, now_ms);
                }
                if !self.delivery_marked(st) {
                    self.resume_when_marked(st);
                    return;
                }
                let Some(entry) = pop_ready(st) else { return };
                match consumer.channel.try_deliver(&consumer, entry) {
                    // A no-ack delivery: its connection acks it in the store once written (`AckWhenWritten`).
                    Ok(Some(_consumed)) => {}
                    Ok(None) => st.unacked += 1,
                    Err(entry) => {
                        push_ready_front(st, entry);
                        continue;
                    }
                }
                st.consumers.delivered(slot);
                delivered = true;
                break;
            }
            if !delivered {
                st.held_back = st.consumers.receivers().any(|c| c.has_credit() && !c.channel.has_room());
                return;
            }
            st.consumers_stalled = false;
            if st.publisher_waiting && (!st.held_back || st.ready.len() <= FLOW_RESUME_AT) {
                st.held_back = false;
                st.publisher_waiting = false;
                if let Some(classic) = self.classic() {
                    classic.drained.notify_waiters();
                }
            }
        }
    }

    /// Does the work collected under the lock; returns the ticket of the store acks it appended.
    pub(super) fn finish(self: &Arc<Self>, mut after: AfterUnlock) -> Option<SyncTicket> {
        let ticket = self.append_acks(&mut after.acks);
        let Some(vhost) = self.vhost.upgrade() else { return ticket };
        for c in after.cancelled {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
        if !after.dead.is_empty() {
            vhost.dead_letter(after.dead);
        }
        if after.auto_delete {
            vhost.delete_queue_unchecked(&self.name);
        } else if after.dispatch {
            self.dispatch();
        }
        ticket
    }
}
