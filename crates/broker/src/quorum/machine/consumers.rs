//! The machine's consumers: attach and detach, single active consumer, settlements, basic.get, and
//! the assignment of ready messages to consumers.

use super::*;

impl QuorumMachine {
    pub(super) fn attach(&mut self, a: Attach) -> Reply {
        if self.exclusive.is_some_and(|x| x != a.consumer) {
            return Reply::Refused(Refusal::ExclusiveConsumer);
        }
        if a.exclusive && self.consumers.iter().any(|(id, c)| *id != a.consumer && c.status == Status::Active) {
            return Reply::Refused(Refusal::ExclusiveConsumer);
        }
        self.used();
        let credit = if a.prefetch == 0 { UNLIMITED } else { a.prefetch };
        let id = a.consumer;
        match self.consumers.get_mut(&id) {
            Some(c) => {
                let was_active = c.status == Status::Active;
                let old_priority = c.priority;
                c.priority = a.priority;
                c.prefetch = a.prefetch;
                c.auto_ack = a.auto_ack;
                c.credit = credit;
                c.status = Status::Active;
                if !was_active {
                    self.group_add(id, a.priority);
                } else if old_priority != a.priority {
                    self.group_remove(id, old_priority);
                    self.group_add(id, a.priority);
                }
            }
            None => {
                self.consumers.insert(
                    id,
                    Consumer {
                        priority: a.priority,
                        prefetch: a.prefetch,
                        auto_ack: a.auto_ack,
                        credit,
                        status: Status::Active,
                        checked_out: BTreeMap::new(),
                    },
                );
                self.group_add(id, a.priority);
            }
        }
        if self.config.single_active_consumer && self.sac_active.is_none() {
            self.sac_active = Some(id);
        }
        if a.exclusive {
            self.exclusive = Some(id);
        }
        Reply::Ok
    }

    fn group_add(&mut self, id: ConsumerId, priority: i32) {
        match self.groups.iter().position(|g| g.priority <= priority) {
            Some(i) if self.groups[i].priority == priority => self.groups[i].members.push(id),
            at => self.groups.insert(at.unwrap_or(self.groups.len()), Group { priority, members: vec![id], next: 0 }),
        }
    }

    fn group_remove(&mut self, id: ConsumerId, priority: i32) {
        let Some(gi) = self.groups.iter().position(|g| g.priority == priority) else { return };
        let group = &mut self.groups[gi];
        let Some(mi) = group.members.iter().position(|m| *m == id) else { return };
        group.members.remove(mi);
        if mi < group.next {
            group.next -= 1;
        }
        if group.next >= group.members.len() {
            group.next = 0;
        }
        if group.members.is_empty() {
            self.groups.remove(gi);
        }
    }

    /// Stops a consumer receiving (it may keep checked-out messages); hands over single active
    /// consumer and exclusivity.
    fn deactivate(&mut self, id: ConsumerId, status: Status) {
        let Some(c) = self.consumers.get_mut(&id) else { return };
        let was_active = c.status == Status::Active;
        c.status = status;
        let priority = c.priority;
        if was_active {
            self.group_remove(id, priority);
        }
        if self.exclusive == Some(id) {
            self.exclusive = None;
        }
        if self.sac_active == Some(id) {
            // Highest priority first, earliest registered within it.
            self.sac_active = self.groups.first().and_then(|g| g.members.first()).copied();
        }
    }

    /// Removes a consumer; its checked-out messages go back to the queue as acquired but not
    /// failed (their delivery count is unchanged; they are redelivered).
    pub(super) fn remove_consumer(&mut self, id: ConsumerId) {
        self.deactivate(id, Status::Cancelled);
        self.used();
        let Some(c) = self.consumers.remove(&id) else { return };
        self.checked_out -= c.checked_out.len() as u64;
        for (msg, st) in c.checked_out {
            self.ready.push_returned(msg, st);
        }
    }

    pub(super) fn detach(&mut self, id: ConsumerId, return_unacked: bool) {
        let Some(c) = self.consumers.get(&id) else { return };
        if return_unacked || c.checked_out.is_empty() {
            self.remove_consumer(id);
        } else {
            self.deactivate(id, Status::Cancelled);
            self.used();
        }
    }

    pub(super) fn settle(&mut self, id: ConsumerId, msg_ids: &[MsgId], how: Settlement, out: &mut Out) -> Reply {
        let Some(c) = self.consumers.get_mut(&id) else { return Reply::Ok };
        let mut settled = Vec::with_capacity(msg_ids.len());
        for msg in msg_ids {
            if let Some(st) = c.checked_out.remove(msg) {
                settled.push((*msg, st));
            }
        }
        if c.status != Status::Active && c.checked_out.is_empty() {
            self.consumers.remove(&id);
        }
        self.checked_out -= settled.len() as u64;
        for (msg, mut st) in settled {
            match how {
                Settlement::Ack => {
                    self.counters.acked += 1;
                    self.consumed(msg);
                    out.gone(Gone::Release, msg);
                }
                Settlement::Reject => self.remove(out, msg, st, Reason::Rejected),
                // Never sent to the client: as if never assigned (not redelivered, not failed).
                Settlement::Unassign => {
                    st.acquired = st.acquired.saturating_sub(1);
                    self.ready.push_returned(msg, st);
                }
                Settlement::Requeue => {
                    st.delivery_count = st.delivery_count.saturating_add(1);
                    if self.config.delivery_limit.is_some_and(|limit| st.delivery_count > limit) {
                        self.remove(out, msg, st, Reason::DeliveryLimit);
                    } else {
                        self.counters.returned += 1;
                        self.ready.push_returned(msg, st);
                    }
                }
            }
        }
        Reply::Ok
    }

    pub(super) fn dequeue(&mut self, id: ConsumerId, auto_ack: bool, out: &mut Out) -> Reply {
        self.used();
        // Only a tick dead-letters expired messages (bounded work); one past its TTL is not taken.
        self.expire_head(out, 0);
        if self.head_expired() {
            return Reply::Dequeued(None);
        }
        let Some((msg, mut st)) = self.ready.pop() else { return Reply::Dequeued(None) };
        let d = Delivery { msg_id: msg, redelivered: st.acquired > 0, delivery_count: st.delivery_count };
        st.acquired = st.acquired.saturating_add(1);
        self.counters.delivered += 1;
        if !auto_ack {
            let c = self.consumers.entry(id).or_insert_with(|| Consumer {
                priority: 0,
                prefetch: 0,
                auto_ack: false,
                credit: 0,
                status: Status::Getter,
                checked_out: BTreeMap::new(),
            });
            c.checked_out.insert(msg, st);
            self.checked_out += 1;
        }
        if auto_ack {
            self.consumed(msg);
        }
        out.deliver(id, auto_ack, d);
        Reply::Dequeued(Some(Dequeued {
            msg_id: msg,
            redelivered: d.redelivered,
            delivery_count: d.delivery_count,
            ready_after: self.ready.len(),
        }))
    }

    /// The next consumer to receive a message, advancing the round-robin.
    fn next_receiver(&mut self) -> Option<ConsumerId> {
        if self.config.single_active_consumer {
            let active = self.sac_active?;
            let top = self.groups.first().map_or(i32::MIN, |g| g.priority);
            // An active consumer outranked by a waiting one is fading: it gets nothing more.
            return self.consumers.get(&active).filter(|c| c.can_take() && c.priority >= top).map(|_| active);
        }
        for group in self.groups.iter_mut() {
            let n = group.members.len();
            for t in 0..n {
                let at = (group.next + t) % n;
                let id = group.members[at];
                if self.consumers.get(&id).is_some_and(Consumer::can_take) {
                    group.next = (at + 1) % n;
                    return Some(id);
                }
            }
        }
        None
    }

    /// Single active consumer, as RabbitMQ 4's quorum queues: when a waiting consumer has a higher
    /// priority than the active one, the active one gets no more messages and, once it has none
    /// unsettled (acked, requeued or rejected), the waiting one (highest priority, earliest
    /// attached) becomes active.
    fn switch_single_active(&mut self) {
        if !self.config.single_active_consumer {
            return;
        }
        let Some(top) = self.groups.first() else { return };
        let (best, top_priority) = (top.members[0], top.priority);
        let switch = match self.sac_active.and_then(|a| self.consumers.get(&a)) {
            None => true,
            Some(active) => active.priority < top_priority && active.checked_out.is_empty(),
        };
        if switch {
            self.sac_active = Some(best);
        }
    }

    /// Hands ready messages, head first, to consumers that can take them.
    pub(super) fn assign(&mut self, out: &mut Out) {
        self.switch_single_active();
        loop {
            self.expire_head(out, 0);
            if self.ready.is_empty() || self.head_expired() {
                return;
            }
            let Some(id) = self.next_receiver() else { return };
            let Some((msg, mut st)) = self.ready.pop() else { return };
            let Some(c) = self.consumers.get_mut(&id) else { return };
            let d = Delivery { msg_id: msg, redelivered: st.acquired > 0, delivery_count: st.delivery_count };
            st.acquired = st.acquired.saturating_add(1);
            self.counters.delivered += 1;
            if c.auto_ack {
                if c.credit != UNLIMITED {
                    c.credit -= 1;
                }
            } else {
                c.checked_out.insert(msg, st);
                self.checked_out += 1;
            }
            let auto_ack = c.auto_ack;
            if auto_ack {
                self.consumed(msg);
            }
            out.deliver(id, auto_ack, d);
        }
    }
}
