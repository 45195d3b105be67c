//! What a durable classic queue writes besides its messages' appends: persistent messages written
//! late (`lazy_ok`), delivered marks, and its state from the store after a restart.

use super::*;

impl Queue {
    /// `Queue::restore` of a classic queue on this node.
    pub(in crate::queue) fn classic_restore(&self, c: &Classic, recovered: &RecoveredQueue) {
        let mut st = c.state.lock();
        // A priority queue's levels are store queues `id`, `id` + 1, ... (see `lane`).
        st.select(recovered.queue.saturating_sub(self.id) as usize);
        st.next_seq = recovered.next_seq;
        st.stored_until = recovered.next_seq;
        st.recovered_until = recovered.next_seq;
        st.redelivered_below = recovered.delivered_until;
        st.mark_durable = recovered.delivered_until;
        st.span_from = recovered.first_seq;
        st.span_count = recovered.live_count;
        st.span_store_bytes = recovered.live_bytes;
        // Body bytes are not recorded separately; the stored bytes are a close upper bound.
        st.span_bytes = recovered.live_bytes;
    }

    /// Appends message `seq` to the store. Seqs must reach the store in increasing order (`stored_until`
    /// is the seq after the last one appended): a lower one would be refused by the store and lost on
    /// restart, so it is refused here, loudly, as the bug it is (a deferred message not written before a
    /// later one; see `store_deferred_locked`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_message(&self, store_id: u64, stored_until: &mut u64, seq: u64, now_ms: u64, stored_header: &[u8], message: &MessageRef) -> Result<SyncTicket> {
        if seq < *stored_until {
            tracing::error!(queue = %self.name, seq, stored_until = *stored_until, "message not stored: its seq is below one already stored (a bug)");
            debug_assert!(false, "queue {}: seq {seq} stored after seq {}", self.name, *stored_until - 1);
            return Err(BrokerError::internal(format!(
                "queue '{}' could not store a message out of order (seq {seq} after {}); this is a bug in Warren",
                self.name,
                *stored_until - 1
            )));
        }
        let ticket = self.store.append_enqueue(store_id, seq, now_ms, &[stored_header, &message.body]).map_err(store_error)?;
        *stored_until = seq + 1;
        Ok(ticket)
    }

    /// Whether the head of the window is a persistent message of this durable queue that is not in the
    /// store yet (see `store_deferred_locked`).
    pub(super) fn head_is_deferred(&self, st: &QueueState) -> bool {
        self.durable && st.ready.front().is_some_and(|e| e.stored_bytes == 0 && e.message.persistent)
    }

    /// Whether the head of the window may be delivered as far as the delivered mark goes: a stored
    /// persistent message may leave only once the store durably says it may have been delivered (else a
    /// crash would bring it back as never delivered). Marks are requested `MARK_STEP` seqs ahead, half a
    /// step early, so a consumer normally never waits for one; after a restart at most that many
    /// never-delivered messages come back flagged redelivered.
    pub(super) fn delivery_marked(&self, st: &mut QueueState) -> bool {
        let Some(head) = st.ready.front() else { return true };
        if head.stored_bytes == 0 || !(self.durable && head.message.persistent) {
            return true;
        }
        let seq = head.seq;
        if let Some((up_to, ticket)) = st.mark_pending {
            if self.store.is_durable(ticket) {
                st.mark_durable = st.mark_durable.max(up_to);
                st.mark_pending = None;
            }
        }
        if st.mark_pending.is_none() && seq + MARK_STEP / 2 >= st.mark_durable {
            let mut batch = Batch::new();
            batch.delivered(st.store_id, seq + MARK_STEP);
            match self.store.append(&mut batch) {
                Ok(ticket) => st.mark_pending = Some((seq + MARK_STEP, ticket)),
                Err(e) => tracing::error!(queue = %self.name, error = %e, "could not record deliveries in the store"),
            }
        }
        seq < st.mark_durable
    }

    /// Dispatches again once the pending delivered mark is durable.
    pub(super) fn resume_when_marked(self: &Arc<Self>, st: &mut QueueState) {
        let Some((_, ticket)) = st.mark_pending else { return };
        self.resume_when(st, ticket, Store::durable, |st| &mut st.mark_waiter);
    }

    /// Dispatches again once the store can read the head back (see `Head::Unreadable`).
    pub(super) fn resume_when_readable(self: &Arc<Self>, st: &mut QueueState, ticket: SyncTicket) {
        self.resume_when(st, ticket, Store::readable, |st| &mut st.readable_waiter);
    }

    /// Dispatches again once the store's `watermark` (durable or readable) reaches `ticket`, from a
    /// task; `waiting` is the state's flag that keeps it to one such task per watermark.
    fn resume_when(
        self: &Arc<Self>,
        st: &mut QueueState,
        ticket: SyncTicket,
        watermark: fn(&Store) -> tokio::sync::watch::Receiver<u64>,
        waiting: fn(&mut QueueState) -> &mut bool,
    ) {
        if *waiting(st) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        *waiting(st) = true;
        let queue = self.clone();
        let mut watermark = watermark(&self.store);
        rt.spawn(async move {
            let _ = watermark.wait_for(|&w| w >= ticket).await;
            if let Some(c) = queue.classic() {
                *waiting(&mut c.state.lock()) = false;
            }
            queue.dispatch();
        });
    }

    /// Writes the persistent messages of a durable queue that wait in the window without being in the
    /// store (`publish` with `lazy_ok`, while every consumer is no-ack), in seq
    /// order. Invariant: such messages are only ever in the window, never unacked (`dispatch_locked` and
    /// `get` write them before an ack-mode consumer or basic.get takes one: a requeued one would come
    /// back below seqs stored meanwhile), and they are written before any later seq is, since the store
    /// takes a queue's seqs in increasing order (`store_message`). Returns the ticket of the last write.
    pub(super) fn store_deferred_locked(&self, st: &mut QueueState, now_ms: u64) -> Option<SyncTicket> {
        st.has_deferred = false;
        if !self.durable {
            return None;
        }
        let mut header = bytes::BytesMut::new();
        let mut ticket = None;
        let Lane { ready, stored_until, store_id, .. } = &mut st.lane;
        for entry in ready.iter_mut().filter(|e| e.stored_bytes == 0 && e.message.persistent) {
            header.clear();
            crate::message::encode_header(&entry.message, Some(now_ms), &mut header);
            match self.store_message(*store_id, stored_until, entry.seq, now_ms, &header, &entry.message) {
                Ok(t) => {
                    entry.stored_bytes = (header.len() + entry.message.body.len()) as u64;
                    ticket = Some(t);
                }
                Err(e) => {
                    tracing::error!(queue = %self.name, error = %e, "could not write a message to the store");
                    break;
                }
            }
        }
        ticket
    }
}
