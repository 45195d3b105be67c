//! The queue's operations on this replica: publish's drain, consumers (attach, detach, dispatch,
//! settle), basic.get, purge, rewind, ticks (expiry, dead-letter redrive, gone consumers), leaving
//! the group and deletion.

use super::*;

impl QuorumReplica {
    /// Waits (at most `max`) until less waits to be proposed than makes publishers pause.
    pub(in crate::queue) async fn wait_until_drained(&self, max: Duration) {
        let notified = self.drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.proposals.lock().pending_bytes < PENDING_PAUSE_BYTES {
            return;
        }
        let _ = tokio::time::timeout(max, notified).await;
    }

    /// basic.consume.
    pub(in crate::queue) fn add_consumer(&self, queue: &Arc<Queue>, consumer: Arc<Consumer>, on_registered: impl FnOnce()) -> Result<()> {
        self.check_member(queue)?;
        let local = self.new_local_id();
        let attach = self.attach_of(local, &consumer);
        {
            let mut st = self.state.lock();
            if st.deleted {
                return Err(BrokerError::not_found(format!("no queue '{}'", queue.name)));
            }
            st.consumers.insert(local, LocalConsumer { consumer, backlog: VecDeque::new(), bodiless: Vec::new(), attaching: true });
            // consume-ok before any delivery: those come once the Attach is applied.
            on_registered();
        }
        let mut p = self.proposals.lock();
        p.encoder.attach(&attach);
        p.command(Waiter::Attach(local));
        self.flush(queue, &mut p);
        Ok(())
    }

    pub(super) fn attach_of(&self, local: u64, consumer: &Consumer) -> Attach {
        Attach {
            consumer: self.consumer_id(local),
            prefetch: machine_prefetch(consumer),
            auto_ack: false,
            exclusive: consumer.exclusive,
            priority: consumer.priority,
        }
    }

    /// basic.cancel, or the consumer's channel closed.
    pub(in crate::queue) fn remove_consumer(&self, queue: &Arc<Queue>, consumer: &Arc<Consumer>) {
        let closing = consumer.channel.is_closed();
        let (local, never_sent) = {
            let mut st = self.state.lock();
            let Some(local) = st.consumers.iter().find(|(_, c)| Arc::ptr_eq(&c.consumer, consumer)).map(|(id, _)| *id) else { return };
            let Some(removed) = st.consumers.remove(&local) else { return };
            let id = self.consumer_id(local);
            // What the machine assigned to it that its client never got (the backlog here, and the
            // bodiless): back as never assigned, not as failed deliveries (issue 33: a prefetch of
            // 1,000 assigns 3,000, and 20 consume/cancel cycles dead-lettered messages no client
            // had seen, with `redelivered` set on the others).
            let never_sent: Vec<MsgId> = removed.backlog.iter().map(|e| e.seq).chain(removed.bodiless.iter().copied()).collect();
            if closing {
                // Everything it holds goes back with the Detach; the channel's requeue of its unacked
                // finds nothing left to settle.
                st.checked_out.retain(|_, c| *c != id);
            } else {
                for m in &never_sent {
                    st.checked_out.remove(m);
                }
            }
            (local, never_sent)
        };
        let id = self.consumer_id(local);
        let mut p = self.proposals.lock();
        // Stopped first (it keeps what it holds), so that what is unassigned is not assigned back
        // to it; then, on a close, the rest goes back as acquired (redelivered, not failed).
        p.encoder.detach(id, false);
        p.command(Waiter::None);
        if !never_sent.is_empty() {
            p.encoder.unassign(id, &never_sent);
            p.command(Waiter::None);
        }
        if closing {
            p.encoder.detach(id, true);
            p.command(Waiter::None);
        }
        self.flush(queue, &mut p);
    }

    /// Credit or room came back: hands consumers' backlogs to their channels.
    pub(in crate::queue) fn dispatch(&self, queue: &Arc<Queue>) {
        let mut after = After::default();
        {
            let mut st = self.state.lock();
            let node = self.node();
            for (local, c) in st.consumers.iter_mut() {
                let id = ConsumerId { node, local: *local };
                while let Some(entry) = c.backlog.pop_front() {
                    if let Some(entry) = hand_to_channel(c, id, entry, &mut after) {
                        c.backlog.push_front(entry);
                        break;
                    }
                }
            }
        }
        self.finish(queue, after);
    }

    /// basic.ack / nack / reject of deliveries from this queue: Settle, Return or Discard in the next
    /// entry.
    pub(in crate::queue) fn settle(&self, queue: &Arc<Queue>, entries: Vec<Entry>, how: Settle, publisher: Option<Publisher>) {
        let settled: Vec<(ConsumerId, MsgId)> = {
            let mut st = self.state.lock();
            entries.iter().filter_map(|e| st.checked_out.remove(&e.seq).map(|c| (c, e.seq))).collect()
        };
        if settled.is_empty() {
            return;
        }
        let mut p = self.proposals.lock();
        push_settlements(&mut p, settled.into_iter(), how);
        if let Some(publisher) = publisher {
            // The entry's reply (any of its commands': an entry applies whole) resolves it.
            publisher.session.sent(self.group, publisher.seq);
            if let Some(last) = p.waiters.last_mut() {
                *last = Waiter::Settled { tries: 0, tx: Some((publisher.session.clone(), publisher.seq)) };
            }
        }
        self.flush(queue, &mut p);
    }

    /// Whether `entry` holds a Dequeue of one of this node's getters.
    pub(in crate::queue) fn has_own_dequeue(&self, entry: &[u8]) -> bool {
        let node = self.node();
        let own = |c: &Command| matches!(c, Command::Dequeue { consumer, .. } if consumer.node == node);
        match Command::decode(entry) {
            Ok(Command::Batch(commands)) => commands.iter().any(own),
            Ok(one) => own(&one),
            Err(_) => false,
        }
    }

    /// basic.get: proposes a Dequeue and asks the connection to wait; called again once it is
    /// applied, it answers.
    pub(in crate::queue) fn get(&self, queue: &Arc<Queue>, channel: &dyn DeliverySink, no_ack: bool) -> Got {
        let local = {
            let mut st = self.state.lock();
            let mine = st.getters.iter().find(|(_, g)| g.connection == channel.connection_id() && g.number == channel.number()).map(|(id, g)| (*id, g.done));
            match mine {
                Some((id, Some(delivered))) => {
                    st.getters.remove(&id);
                    return if delivered { Got::Message } else { Got::Empty };
                }
                Some((id, None)) => return Got::Later(GetWait::Replicated(id)),
                None => {}
            }
            if st.deleted {
                return Got::Empty;
            }
            let local = self.new_local_id();
            st.getters.insert(local, Getter { channel: channel.weak_sink(), connection: channel.connection_id(), number: channel.number(), no_ack, done: None });
            local
        };
        let mut p = self.proposals.lock();
        // Never a settling Dequeue, even for no-ack: see `Getter::no_ack`.
        p.encoder.dequeue(self.consumer_id(local), false);
        p.command(Waiter::Get(local));
        self.flush(queue, &mut p);
        Got::Later(GetWait::Replicated(local))
    }

    /// Returns once basic.get `local` is answered (or gone).
    pub(in crate::queue) async fn wait_get(&self, local: u64) {
        loop {
            let notified = self.gets_done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.state.lock().getters.get(&local).is_none_or(|g| g.done.is_some()) {
                return;
            }
            notified.await;
        }
    }

    /// queue.purge: waits for the Purge entry (as a blocking call: a purge is rare). Returns how
    /// many ready messages it removed.
    pub(in crate::queue) fn purge(&self, queue: &Arc<Queue>) -> Result<u32> {
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let mut p = self.proposals.lock();
            p.encoder.purge();
            p.command(Waiter::Purge(tx));
            self.flush(queue, &mut p);
        }
        match crate::blocking::run(|| rx.recv_timeout(PURGE_TIMEOUT)) {
            Ok(Some(count)) => Ok(count.min(u32::MAX as u64) as u32),
            Ok(None) => Err(BrokerError::internal(format!("the purge of quorum queue '{}' was not applied; nothing was purged", queue.name))),
            Err(_) => Err(outcome_unknown("purge", &queue.name)),
        }
    }

    /// Rewind (the queue has retention): the consumed messages it keeps from `to_ms` on are ready
    /// again. Answers once the group applied it (committed on a majority: it holds if this node or
    /// the leader dies next); proposed from any replica (a follower forwards it).
    pub(in crate::queue) async fn rewind(&self, queue: &Arc<Queue>, to_ms: u64) -> Result<crate::queue::RewindOutcome> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut p = self.proposals.lock();
            p.encoder.rewind(to_ms);
            p.command(Waiter::Rewind(tx));
            self.flush(queue, &mut p);
        }
        match tokio::time::timeout(PURGE_TIMEOUT, rx).await {
            Ok(Ok(Some(outcome))) => Ok(outcome),
            Ok(_) => Err(BrokerError::internal(format!("the rewind of quorum queue '{}' was not applied; nothing was rewound", queue.name))),
            Err(_) => Err(outcome_unknown("rewind", &queue.name)),
        }
    }

    /// Another node is gone: its consumers the machine knows now are detached, their messages come
    /// back redelivered. Named one by one rather than `ConsumerDown(node)`: if the node restarts
    /// before this applies, the consumers it attached since are not touched (it proposes
    /// `ConsumerDown` for itself first thing when it starts).
    pub(in crate::queue) fn consumers_down(&self, queue: &Arc<Queue>, node: u64) {
        let gone: Vec<ConsumerId> = self.state.lock().machine.consumers.keys().filter(|c| c.node == node).copied().collect();
        if gone.is_empty() {
            return;
        }
        let mut p = self.proposals.lock();
        detach_returning(&mut p, gone);
        self.flush(queue, &mut p);
    }

    /// At-least-once: re-publishes dead letter `id` (its body held) to the queue's dead-letter
    /// exchange, confirmed; marks it in flight. False if its body is not held (read it first).
    pub(super) fn republish_held(&self, queue: &Arc<Queue>, st: &mut ReplicaState, id: MsgId, reason: Reason, after: &mut After) -> bool {
        let (Some(reason), Some(exchange)) = (death_reason(reason), &queue.args.dead_letter_exchange) else { return true };
        let Some(message) = self.message_of(queue, st, id) else { return false };
        st.dlx_in_flight.insert(id, std::time::Instant::now() + DEAD_LETTER_SETTLE_TIMEOUT);
        let weak = Arc::downgrade(queue);
        after.dead.push(DeadLetter {
            message,
            reason,
            queue: queue.name.clone(),
            exchange: exchange.clone(),
            routing_key: queue.args.dead_letter_routing_key.clone(),
            settle: Some(Box::new(move |done| {
                if let Some(queue) = weak.upgrade() {
                    if let Some(r) = queue.replica() {
                        r.dead_letter_settled(&queue, id, done);
                    }
                }
            })),
        });
        true
    }

    /// At-least-once: the re-publish of dead letter `id` is confirmed (`done`: its targets hold it,
    /// it leaves the queue through a `DeadLettered`), or must be tried again a little later.
    fn dead_letter_settled(&self, queue: &Arc<Queue>, id: MsgId, done: bool) {
        if !done {
            let mut st = self.state.lock();
            if let Some(at) = st.dlx_in_flight.get_mut(&id) {
                *at = std::time::Instant::now() + DEAD_LETTER_RETRY_AFTER;
            }
            return;
        }
        let mut p = self.proposals.lock();
        p.encoder.dead_lettered(&[id]);
        p.command(Waiter::None);
        self.flush(queue, &mut p);
    }

    /// At-least-once, on the leader: re-publishes the dead letters the machine still holds that
    /// this node has not re-published (a new leader: all of them), or whose settle is overdue, at
    /// most `REDRIVE_PER_TICK` at a time; bodies only on disk are read first (off the lock).
    pub(super) fn redrive_dead_letters(&self, queue: &Arc<Queue>) {
        if !self.is_leader() {
            return;
        }
        let mut after = After::default();
        {
            let mut st = self.state.lock();
            if st.deleted || st.machine.dead_letter_count() == 0 {
                st.dlx_in_flight.clear();
                return;
            }
            let now = std::time::Instant::now();
            let ReplicaState { machine, dlx_in_flight, .. } = &mut *st;
            dlx_in_flight.retain(|id, _| machine.is_dead_letter_waiting(*id));
            let due: Vec<(MsgId, Reason)> = machine
                .dead_letters_waiting()
                .filter(|(id, _)| dlx_in_flight.get(id).is_none_or(|at| *at <= now))
                .take(REDRIVE_PER_TICK)
                .collect();
            if due.is_empty() {
                return;
            }
            let generation = st.generation;
            for (reason, ids) in group_by_reason(&due) {
                let effect = Effect::DeadLetterHeld { reason, msgs: ids.iter().fold(Vec::new(), |mut runs, id| {
                    crate::quorum::ready::push_id(&mut runs, *id);
                    runs
                }) };
                if !self.hold_bodies_for(queue, &mut st, &effect, true, generation) {
                    return;
                }
                for id in ids {
                    if st.machine.is_dead_letter_waiting(id) && !self.republish_held(queue, &mut st, id, reason, &mut after) {
                        tracing::warn!(queue = %queue.name, msg_id = id, "the body of a dead letter waiting for its target could not be read; trying again later");
                    }
                }
            }
        }
        self.finish(queue, after);
    }

    /// Periodic: the leader proposes a Tick when messages or the queue can expire; every replica
    /// detaches the consumers of its node it no longer has.
    pub(in crate::queue) fn tick(&self, queue: &Arc<Queue>, now_ms: u64) {
        self.detach_gone_consumers(queue);
        self.redrive_dead_letters(queue);
        // A Tick proposed for a due message that has not applied a second later was lost (a
        // leader change): again.
        if self.next_due.load(Ordering::Relaxed).saturating_add(1000) <= now_ms {
            self.due_tick(queue);
        }
        self.arm_due_timer(queue);
        // The leader that applied the expiry deletes the queue (`after.expired`); should it be lost
        // before its deletion was committed, whichever leads now does it.
        let expired = { let st = self.state.lock(); !st.deleted && st.machine.queue_expired() };
        if expired && self.is_leader() {
            if let Some(vhost) = queue.vhost.upgrade() {
                vhost.doom(queue);
            }
        }
        // Retention ends by Ticks too (the machine's clock moves its floor).
        let expiring = queue.args.message_ttl_ms.is_some()
            || queue.args.expires_ms.is_some()
            || queue.args.retention_ms > 0
            || self.saw_expiration.load(Ordering::Relaxed);
        if !expiring {
            return;
        }
        {
            let mut st = self.state.lock();
            if st.deleted || now_ms.saturating_sub(st.last_tick_ms) < TICK_EVERY_MS || !self.is_leader() {
                return;
            }
            st.last_tick_ms = now_ms;
        }
        let room = queue.vhost.upgrade().is_none_or(|v| v.dead_letter_room());
        self.propose_tick(queue, now_ms, if room { EXPIRE_PER_TICK } else { 0 });
    }

    /// The queue was redeclared: a `Touch` restarts its `x-expires` countdown on every replica.
    /// (Proposed by whichever node the client is on: the machine's clock is the largest `now_ms`
    /// of its Ticks and Touches, so the countdown does not depend on which node led when.)
    pub(in crate::queue) fn touch(&self, queue: &Arc<Queue>, now_ms: u64) {
        if self.state.lock().deleted {
            return;
        }
        let mut p = self.proposals.lock();
        p.encoder.touch(now_ms);
        p.command(Waiter::None);
        self.flush(queue, &mut p);
    }

    pub(super) fn propose_tick(&self, queue: &Arc<Queue>, now_ms: u64, max_expired: u64) {
        let mut p = self.proposals.lock();
        p.encoder.tick(now_ms, max_expired);
        p.command(Waiter::None);
        self.flush(queue, &mut p);
    }

    /// On the leader, expired messages wait at the head of a queue that dead-letters (a tick
    /// dead-letters at most `EXPIRE_PER_TICK`, and deliveries skip nothing): proposes the next
    /// Tick at once if the vhost has room for more dead letters, or once it has. So a backlog
    /// expiring at once is dead-lettered as fast as the vhost re-publishes it, a bounded number at
    /// a time, and none is dropped (issue 33: past 65,536 waiting they were). Likewise for due
    /// delayed messages a full queue dead-letters as they come due (`QuorumMachine::fire_due`).
    pub(super) fn expire_more(&self, queue: &Arc<Queue>) {
        let Some(vhost) = queue.vhost.upgrade() else { return };
        let at = {
            let mut st = self.state.lock();
            if st.deleted || !(st.machine.head_expired() || st.machine.due_left()) || st.machine.now_ms < st.extra_tick_at || !self.is_leader() {
                return;
            }
            if !vhost.dead_letter_room() {
                if st.waiting_for_room {
                    return;
                }
                st.waiting_for_room = true;
                drop(st);
                let weak = Arc::downgrade(queue);
                vhost.when_dead_letter_room(Box::new(move || {
                    let Some(queue) = weak.upgrade() else { return };
                    let Some(r) = queue.replica() else { return };
                    r.state.lock().waiting_for_room = false;
                    r.expire_more(&queue);
                }));
                return;
            }
            // Past the machine's clock, so that its apply shows (`extra_tick_at`).
            st.extra_tick_at = crate::now_ms().max(st.machine.now_ms + 1);
            st.extra_tick_at
        };
        self.propose_tick(queue, at, EXPIRE_PER_TICK);
    }

    /// Consumers of this node the group still counts at two ticks in a row although this node no
    /// longer has them, and whose channel holds none of their messages, are detached (what they
    /// hold goes back, as acquired, not failed). Their detach was lost (sent to a leader that
    /// stopped, and not committed when proposed again), or they are an earlier run's and this run's
    /// ConsumerDown was lost. Without this, a lost consumer that is delivered nothing more keeps
    /// the messages it held (whose acks were lost with it) until this node restarts. (Two ticks:
    /// a detach proposed since the last one is not proposed twice. Twice is harmless, as is a
    /// detach that arrives after the consumer is gone.)
    pub(super) fn detach_gone_consumers(&self, queue: &Arc<Queue>) {
        let gone: Vec<ConsumerId> = {
            let mut st = self.state.lock();
            let node = self.node();
            let st = &mut *st;
            let mut gone: Vec<ConsumerId> = st
                .machine
                .consumers
                .keys()
                .filter(|c| c.node == node && !st.consumers.contains_key(&c.local) && !st.getters.contains_key(&c.local))
                .copied()
                .collect();
            if !gone.is_empty() {
                gone.retain(|c| !holds_any(&st.checked_out, *c));
            }
            let seen_before = std::mem::take(&mut st.gone_at_last_tick);
            st.gone_at_last_tick = gone
                .into_iter()
                .map(|c| (c, seen_before.iter().find(|(g, _)| *g == c).map_or(1, |(_, ticks)| ticks + 1)))
                .collect();
            if st.deleted {
                return;
            }
            // Proposed at the second tick, then every `DETACH_GONE_AGAIN_TICKS` while it lasts (no
            // majority to commit it: one log line and one command a second per consumer is noise).
            st.gone_at_last_tick
                .iter()
                .filter(|(_, ticks)| *ticks == 2 || (*ticks > 2 && ticks % DETACH_GONE_AGAIN_TICKS == 0))
                .map(|(c, _)| *c)
                .collect()
        };
        if gone.is_empty() {
            return;
        }
        for c in &gone {
            tracing::info!(queue = %queue.name, consumer = c.local, "the group still counts a consumer this node no longer has: detaching it");
        }
        let mut p = self.proposals.lock();
        detach_returning(&mut p, gone);
        self.flush(queue, &mut p);
    }

    /// This node is no longer a member of the group (`warren ctl remove-node`, a shrink; the caller
    /// stops the group here and removes its log). Its consumers are cancelled, and what they held
    /// goes back to the group (`ConsumerDown` of this node, proposed through the members). The
    /// replica forgets the group's state and this node's copies of its bodies: it is now what a node
    /// outside the group always was, and its clients go through the members (`Queue::member_relay`).
    pub(in crate::queue) fn leave_group(&self, queue: &Arc<Queue>) {
        let consumers: Vec<Arc<Consumer>> = {
            let mut st = self.state.lock();
            let mut old = std::mem::replace(&mut *st, ReplicaState::new(queue_config(&queue.name, &queue.args), self.runtime.bodies.clone()));
            // Reads ahead under way end by themselves; no more may start beside them.
            st.read_ahead.in_flight = old.read_ahead.in_flight;
            st.generation = old.generation + 1;
            st.log = old.log.take();
            // A basic.get waiting for its entry answers empty (the next one goes through a member).
            st.getters = std::mem::take(&mut old.getters);
            for g in st.getters.values_mut() {
                g.done.get_or_insert(false);
            }
            old.consumers.into_values().map(|c| c.consumer).collect()
        };
        self.gets_done.notify_waiters();
        {
            let mut p = self.proposals.lock();
            p.encoder.consumer_down(self.node());
            p.command(Waiter::None);
            self.flush(queue, &mut p);
        }
        let mut drop = Batch::new();
        drop.drop_queue(self.group);
        queue.append_acks(&mut drop);
        for c in consumers {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
    }

    /// The queue was deleted: its consumers are cancelled, its records dropped, its group removed.
    /// Returns how many ready messages it held.
    pub(in crate::queue) fn delete(&self, queue: &Arc<Queue>) -> u32 {
        let (count, consumers) = {
            let mut st = self.state.lock();
            st.deleted = true;
            st.bodies.clear();
            st.store_only = 0;
            st.entry_holds.clear();
            st.retained_entries.clear();
            st.kept_records.clear();
            st.body_mem.clear();
            st.checked_out.clear();
            st.getters.clear();
            let consumers: Vec<Arc<Consumer>> = st.consumers.drain().map(|(_, c)| c.consumer).collect();
            (st.machine.ready_count().min(u32::MAX as u64) as u32, consumers)
        };
        self.gets_done.notify_waiters();
        // What waits to be proposed never will be: its publishers are nacked.
        let waiting: Vec<Waiter> = {
            let mut p = self.proposals.lock();
            p.seal();
            p.pending_bytes = 0;
            p.sealed.drain(..).flat_map(|(_, w)| w).collect()
        };
        for w in waiting {
            match w {
                Waiter::Enqueue { session: Some(session), seqs } => session.resolved(self.group, seqs.into_iter().map(|s| (s, true))),
                Waiter::Settled { tx: Some((session, seq)), .. } => session.resolved(self.group, [(seq, false)]),
                _ => {}
            }
        }
        let mut acks = Batch::new();
        acks.drop_queue(self.group);
        queue.append_acks(&mut acks);
        for c in consumers {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
        if let Some(host) = self.runtime.host() {
            host.remove(self.group);
        }
        count
    }
}

/// The prefetch the machine knows an AMQP consumer by (see `ASSIGN_AHEAD_FROM`).
fn machine_prefetch(consumer: &Consumer) -> u32 {
    match consumer.prefetch {
        _ if consumer.no_ack => NO_ACK_PREFETCH,
        p if p >= ASSIGN_AHEAD_FROM => p.saturating_mul(ASSIGN_AHEAD_FACTOR),
        p => p,
    }
}

/// Hands an entry to a consumer's channel; gives it back if the channel cannot take it now.
pub(super) fn hand_to_channel(local: &mut LocalConsumer, id: ConsumerId, entry: Entry, after: &mut After) -> Option<Entry> {
    if !local.consumer.has_credit() {
        return Some(entry); // assigned ahead: waits for the client's acks (`ASSIGN_AHEAD_FROM`)
    }
    let seq = entry.seq;
    match local.consumer.channel.try_deliver(&local.consumer, entry) {
        // A no-ack consumer: settled once handed over (its messages are the machine's until then).
        Ok(Some(_)) => {
            after.settles.push((id, seq));
            None
        }
        Ok(None) => None,
        Err(entry) => Some(entry),
    }
}

/// A message returned before, as delivered: with the `x-delivery-count` header (failed deliveries so
/// far), as RabbitMQ 4's quorum queues add it. A message whose properties do not decode goes as it is.
pub(super) fn with_delivery_count(message: &MessageRef, count: u32) -> MessageRef {
    let Ok(mut props) = warren_protocol::properties::BasicProperties::decode(&message.properties) else {
        return message.clone();
    };
    let mut headers = props.headers.take().unwrap_or_default();
    headers.insert("x-delivery-count".to_string(), warren_protocol::field::FieldValue::I64(count as i64));
    props.headers = Some(headers);
    let mut raw = BytesMut::new();
    props.encode(&mut raw);
    Arc::new(crate::message::Message {
        exchange: message.exchange.clone(),
        routing_key: message.routing_key.clone(),
        properties: raw.freeze(),
        body: message.body.clone(),
        persistent: message.persistent,
        expiration_ms: message.expiration_ms,
    })
}
