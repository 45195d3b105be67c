//! Applying committed entries on this replica: the machine's effects, deliveries to local
//! consumers, and the work done after the lock (dead letters, acks, cancels).

use super::*;

impl QuorumReplica {
    /// The group runs: proposals go to `replicator` from now on (those made before go first).
    pub(in crate::queue) fn attach(&self, queue: &Arc<Queue>, replicator: Arc<dyn Replicator>) {
        let mut p = self.proposals.lock();
        // What this node's consumers held before a restart comes back, before any new consumer of
        // this node attaches (nothing to do for a new queue, and harmless).
        let mut first = Encoder::new();
        first.consumer_down(self.node());
        p.sealed.push_front((first.finish(), vec![Waiter::None]));
        self.state.lock().log = Some(replicator.clone());
        *self.replicator.write() = Some(replicator);
        self.flush(queue, &mut p);
    }

    /// Applies a committed entry (every replica, log order) and does what its effects ask on this
    /// node. Returns the reply for the proposer.
    ///
    /// The bodies an effect delivers or dead-letters that are only on disk are read first, with
    /// `state`'s lock let go (`body_read_for`, `read_bodies`): publishers, acks, consumers and
    /// management take that lock on runtime threads, and a slow read (or a wait for the store to
    /// make a record readable) under it stalled them all, and with them the node's other groups.
    /// Effects stay in order: the next entry applies only once this one is done, and other tasks
    /// between two effects only propose (their commands apply after this entry) or see the
    /// machine's state a little ahead of the consumers' backlogs.
    pub(in crate::queue) fn apply(&self, queue: &Arc<Queue>, index: u64, entry: &Bytes) -> Bytes {
        let mut after = After::default();
        let reply = {
            let mut st = self.state.lock();
            let generation = st.generation;
            let consumers_before = st.machine.consumers.len();
            let (effects, reply) = st.machine.apply(index, entry);
            let mut left = false;
            if !effects.is_empty() {
                let leader = self.is_leader();
                for effect in effects {
                    if !self.hold_bodies_for(queue, &mut st, &effect, leader, generation) {
                        // The replica left the group meanwhile: nothing of this entry is its any more.
                        left = true;
                        break;
                    }
                    self.perform(queue, &mut st, entry, effect, leader, &mut after);
                }
            }
            if !left && st.machine.consumers.len() < consumers_before && !st.consumers.is_empty() {
                self.lost_consumers(&mut st, &mut after);
            }
            if !left {
                unretain(&mut st, self.group, &mut after.acks);
            }
            after.expire_more = !left
                && queue.args.dead_letter_exchange.is_some()
                && (st.machine.head_expired() || st.machine.due_left())
                && st.machine.now_ms >= st.extra_tick_at;
            self.next_due.store(st.machine.next_due().unwrap_or(u64::MAX), Ordering::Relaxed);
            reply.encode()
        };
        self.finish(queue, after);
        self.arm_due_timer(queue);
        reply
    }

    /// The consumed messages the machine keeps for a rewind, and its oldest retention sample.
    pub(in crate::queue) fn retention_stats(&self) -> warren_store::RetentionStats {
        let st = self.state.lock();
        warren_store::RetentionStats { consumed: st.machine.retained_count(), oldest_ms: st.machine.oldest_kept_ms() }
    }

    /// Delayed messages the group holds, not due yet.
    pub(in crate::queue) fn delayed_count(&self) -> u64 {
        self.state.lock().machine.delayed_count()
    }

    /// On the leader, with delayed messages waiting: a timer task proposes a `Tick` when the next
    /// one comes due (the machine makes it ready then: `QuorumMachine::fire_due`), not at the
    /// housekeeping tick, so a due message is late by the timer and one commit. A new leader arms
    /// at its first housekeeping tick (`tick`, within a second). Cheap when armed already: two
    /// atomic loads.
    pub(super) fn arm_due_timer(&self, queue: &Arc<Queue>) {
        let due = self.next_due.load(Ordering::Relaxed);
        if due == u64::MAX
            || self.armed_due.load(Ordering::Relaxed) <= due
            || self.tick_proposed_for.load(Ordering::Relaxed) == due
            || !self.is_leader()
        {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        // Armed for the earlier time; a timer armed for a later one still fires, and finds
        // nothing due or proposes one more Tick (harmless).
        self.armed_due.fetch_min(due, Ordering::Relaxed);
        let queue = Arc::downgrade(queue);
        rt.spawn(async move {
            // The wall clock, which dates messages and Ticks, may drift from tokio's.
            loop {
                let now = crate::now_ms();
                if now >= due {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(due - now)).await;
            }
            let Some(queue) = queue.upgrade() else { return };
            if let Some(r) = queue.replica() {
                let _ = r.armed_due.compare_exchange(due, u64::MAX, Ordering::Relaxed, Ordering::Relaxed);
                r.due_tick(&queue);
            }
        });
    }

    /// A due timer fired: on the leader, a `Tick` if a delayed message is due by now, else the
    /// timer again for the next.
    pub(super) fn due_tick(&self, queue: &Arc<Queue>) {
        if !self.is_leader() || self.state.lock().deleted {
            return;
        }
        let now_ms = crate::now_ms();
        let due = self.next_due.load(Ordering::Relaxed);
        if due <= now_ms {
            self.tick_proposed_for.store(due, Ordering::Relaxed);
            let room = queue.vhost.upgrade().is_none_or(|v| v.dead_letter_room());
            self.propose_tick(queue, now_ms, if room { EXPIRE_PER_TICK } else { 0 });
        } else {
            self.arm_due_timer(queue);
        }
    }

    /// Reads the bodies `effect` needs that are only on disk (`body_read_for`), with the lock let go
    /// for each read, and holds them. False if the replica left the group meanwhile (its state was
    /// replaced: `generation` moved on).
    pub(super) fn hold_bodies_for(&self, queue: &Arc<Queue>, st: &mut parking_lot::MutexGuard<'_, ReplicaState>, effect: &Effect, leader: bool, generation: u64) -> bool {
        let mut tries = HashMap::new();
        while let Some(read) = self.body_read_for(queue, st, effect, leader, &mut tries) {
            let bodies = parking_lot::MutexGuard::unlocked(st, || crate::blocking::run(|| self.read_bodies(queue, &read)));
            if st.generation != generation {
                return false;
            }
            let bodies = match &read.from {
                BodySource::UnderWay(seqs) => self.took_read_under_way(st, seqs, bodies),
                _ => bodies,
            };
            if let Some(bodies) = bodies {
                take_bodies(st, bodies, &read.wanted);
            }
        }
        true
    }

    fn perform(&self, queue: &Arc<Queue>, st: &mut ReplicaState, entry: &Bytes, effect: Effect, leader: bool, after: &mut After) {
        match effect {
            Effect::Store { msg_id, payload } => {
                if payload.end > entry.len() || payload.start > payload.end {
                    tracing::error!(queue = %queue.name, msg_id, "an enqueue names bytes outside its entry; message not kept");
                    return;
                }
                self.keep_body(st, msg_id, entry.slice(payload));
                if st.machine.config().retention_ms.is_some() && msg_id >= st.stored_until {
                    // Pinned by `keep_body` already; stays pinned once consumed, for a rewind.
                    retain_entry(st, msg_id >> 16);
                }
            }
            // Consumed messages made ready again: their bodies are in their entries, read back
            // when delivered (as after a restart).
            Effect::Rewound { runs } => {
                // The reads ahead follow deliveries up the ids: start them again below the rewound
                // ones (all below what was delivered), or each would be read on the apply path.
                if let Some(first) = runs.first().map(|r| r.first) {
                    let ahead = &mut st.read_ahead;
                    if first <= ahead.delivered {
                        ahead.delivered = first.saturating_sub(1);
                        ahead.claimed_until = ahead.claimed_until.min(first);
                        ahead.look_again_at = ahead.look_again_at.min(first);
                    }
                }
                for id in runs.iter().flat_map(Run::ids) {
                    if st.bodies.contains_key(&id) {
                        continue;
                    }
                    if let Some((ticket, stored_bytes)) = st.kept_records.remove(&id) {
                        insert_body(st, id, Body { message: None, mem: 0, stored_bytes, record: Record::Stored(ticket) });
                    } else if applied_here(st, id >> 16) {
                        retain_entry(st, id >> 16);
                        insert_body(st, id, Body { message: None, mem: 0, stored_bytes: 0, record: Record::InEntry { payload: None } });
                    } else {
                        tracing::warn!(queue = %queue.name, msg_id = id, "a rewound message's body is on no record or entry of this node; its consumers here will hold it undelivered");
                    }
                }
            }
            Effect::Deliver { consumer, settled, msgs } => {
                if consumer.node == self.node() && !st.deleted {
                    self.deliver(queue, st, consumer, settled, msgs, after);
                } else if settled {
                    for d in msgs {
                        forget(st, self.group, d.msg_id, &mut after.acks);
                    }
                }
            }
            Effect::Release { msgs } | Effect::Dropped { msgs, .. } => {
                for id in run_ids(&msgs) {
                    forget(st, self.group, id, &mut after.acks);
                }
            }
            Effect::DeadLetter { reason, msgs } => {
                for id in run_ids(&msgs) {
                    let (Some(reason), Some(exchange), true) = (death_reason(reason), &queue.args.dead_letter_exchange, leader) else {
                        forget(st, self.group, id, &mut after.acks);
                        continue;
                    };
                    let message = self.message_of(queue, st, id);
                    forget(st, self.group, id, &mut after.acks);
                    let Some(message) = message else { continue };
                    after.dead.push(DeadLetter {
                        message,
                        reason,
                        queue: queue.name.clone(),
                        exchange: exchange.clone(),
                        routing_key: queue.args.dead_letter_routing_key.clone(),
                        settle: None,
                    });
                }
            }
            // At-least-once: every replica keeps the bodies until `DeadLettered`; the leader
            // re-publishes them now, confirmed (those whose body it has not: at the next tick).
            Effect::DeadLetterHeld { reason, msgs } => {
                if leader && !st.deleted {
                    for id in run_ids(&msgs) {
                        self.republish_held(queue, st, id, reason, after);
                    }
                }
            }
            // Confirms come from this node's replica applying the entry, in log order (a re-sent
            // batch's reply would not repeat the first application's rejections).
            Effect::Published { session, applied_up_to, rejected } => {
                if session.node == self.node() {
                    if let Some(s) = st.sessions.get(&session.channel).and_then(Weak::upgrade) {
                        s.applied_up_to(self.group, applied_up_to, &rejected);
                    }
                }
            }
            Effect::QueueExpired => after.expired |= leader,
        }
    }

    /// Hands the machine's deliveries to a consumer (or getter) of this node.
    pub(super) fn deliver(&self, queue: &Arc<Queue>, st: &mut ReplicaState, consumer: ConsumerId, settled: bool, msgs: Vec<Delivery>, after: &mut After) {
        let known = st.getters.contains_key(&consumer.local) || st.consumers.contains_key(&consumer.local);
        // The bodies first (read back before, see `apply`); a settled delivery's message is gone.
        let mut entries: Vec<Option<Entry>> = Vec::with_capacity(msgs.len());
        for d in &msgs {
            let message = if known { self.message_of(queue, st, d.msg_id) } else { None };
            if settled {
                forget(st, self.group, d.msg_id, &mut after.acks);
            }
            let message = message.map(|m| if d.delivery_count > 0 { with_delivery_count(&m, d.delivery_count) } else { m });
            entries.push(message.map(|message| Entry { message, seq: d.msg_id, stored_bytes: 0, expires_at_ms: None, redelivered: d.redelivered, returned: 0 }));
        }
        if let Some(last) = msgs.iter().map(|d| d.msg_id).max().filter(|_| known) {
            self.read_ahead(queue, st, last);
        }
        let ReplicaState { machine, consumers, getters, checked_out, .. } = st;
        if let Some(getter) = getters.get_mut(&consumer.local) {
            let Some(d) = msgs.first() else { return };
            // A channel closed meanwhile takes nothing more (its get-ok would never be settled).
            let channel = getter.channel.upgrade().filter(|c| !c.is_closed());
            match (entries.swap_remove(0), channel) {
                (Some(entry), Some(channel)) => {
                    let remaining = machine.ready_count().min(u32::MAX as u64) as u32;
                    if channel.deliver_get(queue, entry, settled || getter.no_ack, remaining).is_none() {
                        checked_out.insert(d.msg_id, consumer);
                    } else if !settled {
                        after.settles.push((consumer, d.msg_id));
                    }
                    getter.done = Some(true);
                }
                (None, _) => {
                    // Never discarded (that would remove it for the whole cluster): the getter lets
                    // it go back, not counted as a failed delivery.
                    tracing::error!(queue = %queue.name, msg_id = d.msg_id, "no body on this node for a message taken by basic.get; returning it");
                    if !settled {
                        after.detaches.push(consumer);
                    }
                    getter.done = Some(false);
                }
                // The channel closed before get-ok: back, not a failed delivery (as a closed channel's unacked).
                (Some(_), None) if !settled => after.detaches.push(consumer),
                (Some(_), None) => {}
            }
            after.gets_done = true;
            return;
        }
        let Some(local) = consumers.get_mut(&consumer.local) else {
            // Gone from this node: see `delivered_to_gone`. (An earlier run's consumers are
            // ConsumerDown's: a restart replays deliveries to them.)
            if !settled && consumer.local & !0xffff_ffff == self.incarnation {
                let client_holds = holds_any(checked_out, consumer);
                after.to_gone.push(ToGone { consumer, client_holds, msgs: msgs.iter().map(|d| d.msg_id).collect() });
            }
            return;
        };
        for (d, entry) in msgs.iter().zip(entries) {
            let Some(entry) = entry else {
                // Never discarded (a discard removes it for the whole cluster): it stays checked out
                // to the consumer, undelivered, and goes back when the consumer goes.
                tracing::error!(queue = %queue.name, msg_id = d.msg_id, "no body on this node for a delivered message; it stays with the consumer undelivered");
                if !settled {
                    checked_out.insert(d.msg_id, consumer);
                    local.bodiless.push(d.msg_id);
                }
                continue;
            };
            if !settled {
                checked_out.insert(d.msg_id, consumer);
            }
            if local.backlog.is_empty() {
                if let Some(entry) = hand_to_channel(local, consumer, entry, after) {
                    local.backlog.push_back(entry);
                }
            } else {
                local.backlog.push_back(entry);
            }
        }
    }

    /// Local consumers the machine no longer has although this node never cancelled them: another
    /// node detached them (`consumers_down`: this node was unreachable for a while, and its
    /// consumers' messages went to others). The client still waits on them, so they are attached
    /// again (RabbitMQ's quorum queues do the same when a node comes back). What they held is the
    /// queue's again: their backlog here is dropped (it would be delivered twice), and acks of
    /// what their channel still holds are not proposed (the machine would ignore them).
    pub(super) fn lost_consumers(&self, st: &mut ReplicaState, after: &mut After) {
        let node = self.node();
        let ReplicaState { machine, consumers, checked_out, .. } = st;
        for (local, c) in consumers.iter_mut() {
            let id = ConsumerId { node, local: *local };
            if c.attaching || machine.consumers.contains_key(&id) {
                continue;
            }
            c.backlog.clear();
            c.bodiless.clear();
            checked_out.retain(|_, holder| *holder != id);
            c.attaching = true;
            after.reattach.push(*local);
        }
    }

    /// Does what was found under the lock.
    pub(super) fn finish(&self, queue: &Arc<Queue>, mut after: After) {
        if !after.acks.is_empty() {
            queue.append_acks(&mut after.acks);
        }
        if after.gets_done {
            self.gets_done.notify_waiters();
        }
        if !after.get_applies.is_empty() {
            let gets = std::mem::take(&mut after.get_applies);
            let weak = Arc::downgrade(queue);
            let give_up = move || {
                let Some(queue) = weak.upgrade() else { return };
                let Some(r) = queue.replica() else { return };
                {
                    let mut st = r.state.lock();
                    for local in &gets {
                        if let Some(g) = st.getters.get_mut(local) {
                            g.done.get_or_insert(false);
                        }
                    }
                }
                r.gets_done.notify_waiters();
            };
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move {
                        tokio::time::sleep(GET_APPLY_WAIT).await;
                        give_up();
                    });
                }
                Err(_) => give_up(),
            }
        }
        for c in after.cancelled.drain(..) {
            c.channel.consumer_cancelled_by_server(&c.tag);
        }
        let reattach: Vec<(u64, Attach)> = if after.reattach.is_empty() {
            Vec::new()
        } else {
            let st = self.state.lock();
            after.reattach.iter().filter_map(|l| st.consumers.get(l).map(|c| (*l, self.attach_of(*l, &c.consumer)))).collect()
        };
        for (local, _) in &reattach {
            tracing::info!(queue = %queue.name, consumer = local, "a consumer of this node was detached by another node (unreachable a while): attaching it again");
        }
        if !after.settles.is_empty() || !after.to_gone.is_empty() || !after.discards.is_empty() || !after.detaches.is_empty() || !reattach.is_empty() {
            let mut p = self.proposals.lock();
            for (local, attach) in &reattach {
                p.encoder.attach(attach);
                p.command(Waiter::Attach(*local));
            }
            detach_returning(&mut p, after.detaches.drain(..));
            delivered_to_gone(&mut p, std::mem::take(&mut after.to_gone));
            for (list, kind) in [(&after.settles, Settle::Ack), (&after.discards, Settle::Reject { requeue: false })] {
                push_settlements(&mut p, list.iter().copied(), kind);
            }
            self.flush(queue, &mut p);
        }
        let Some(vhost) = queue.vhost.upgrade() else { return };
        if !after.dead.is_empty() {
            vhost.dead_letter(after.dead);
        }
        if after.expire_more {
            self.expire_more(queue);
        }
        if after.expired {
            tracing::info!(queue = %queue.name, vhost = %vhost.host_name(), "deleting quorum queue unused for longer than its x-expires");
            let name = queue.name.clone();
            // Not from inside the group's apply: deleting stops the group.
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn_blocking(move || vhost.delete_queue_unchecked(&name));
                }
                Err(_) => vhost.delete_queue_unchecked(&name),
            }
        }
    }
}
