//! Proposing entries: publishes batched into Enqueue commands (group commit), at most
//! `MAX_IN_FLIGHT` entries in flight, and what is proposed again when an entry's outcome is
//! unknown.

use super::*;

impl QuorumReplica {
    /// Proposes what waits, as far as the in-flight limit allows.
    pub(super) fn flush(&self, queue: &Arc<Queue>, p: &mut Proposals) {
        let Some(replicator) = self.replicator.read().clone() else { return };
        while p.in_flight < MAX_IN_FLIGHT {
            if p.sealed.is_empty() {
                p.seal();
            }
            let Some((entry, waiters)) = p.sealed.pop_front() else { break };
            p.in_flight += 1;
            p.pending_bytes = p.pending_bytes.saturating_sub(entry.len());
            let q = queue.clone();
            let proposed = entry.clone();
            replicator.propose(entry, Box::new(move |result| q.replica_proposed(result, &proposed, waiters)));
        }
        if p.pending_bytes < PENDING_PAUSE_BYTES {
            self.drained.notify_waiters();
        }
    }

    /// An entry's proposal ended: resolves what waited for its reply, proposes more.
    pub(in crate::queue) fn proposed(&self, queue: &Arc<Queue>, result: std::result::Result<Bytes, String>, entry: &[u8], waiters: Vec<Waiter>) {
        let mut again = if result.is_err() { self.to_propose_again(queue, entry, &waiters) } else { Vec::new() };
        let replies = match &result {
            Ok(bytes) => match Reply::decode(bytes) {
                Ok(Reply::Batch(replies)) => replies,
                Ok(one) => vec![one],
                Err(e) => {
                    tracing::error!(queue = %queue.name, error = %e, "a quorum queue's reply does not decode");
                    Vec::new()
                }
            },
            Err(e) => {
                tracing::warn!(queue = %queue.name, error = %e, "a quorum queue's entry was not committed; its publishes are nacked");
                Vec::new()
            }
        };
        let mut after = After::default();
        let mut replies = replies.into_iter();
        for (i, waiter) in waiters.into_iter().enumerate() {
            let reply = replies.next();
            if again.get(i).is_some_and(Option::is_some) {
                continue; // waits for its command proposed again
            }
            match waiter {
                Waiter::None | Waiter::Settled { tx: None, .. } => {}
                Waiter::Enqueue { session: Some(session), seqs } => {
                    let rejected: &[u64] = match &reply {
                        Some(Reply::Enqueued { rejected, .. }) => rejected,
                        _ => {
                            session.resolved(self.group, seqs.iter().map(|s| (*s, true)));
                            continue;
                        }
                    };
                    session.resolved(self.group, seqs.iter().map(|s| (*s, rejected.contains(s))));
                }
                Waiter::Enqueue { session: None, .. } => {}
                Waiter::Settled { tx: Some((session, seq)), .. } => {
                    // Not committed (and not proposed again, or given up on): the commit fails.
                    if reply.is_none() {
                        tracing::warn!(queue = %queue.name, "a transaction's settlements were not committed in time; its tx.commit fails");
                    }
                    session.resolved(self.group, [(seq, reply.is_none())]);
                }
                Waiter::Attach(local) => {
                    let mut st = self.state.lock();
                    if matches!(reply, Some(Reply::Refused(Refusal::ExclusiveConsumer))) {
                        if let Some(c) = st.consumers.remove(&local) {
                            after.cancelled.push(c.consumer);
                        }
                    } else if let Some(c) = st.consumers.get_mut(&local) {
                        // Not applied (no quorum within the timeout, or the leader changed and the
                        // outcome is unknown): proposed again, so that the consumer is not left
                        // registered here and unknown to the queue. Attaching twice is harmless.
                        let applied = reply.is_some();
                        c.attaching = !applied;
                        if !applied {
                            after.reattach.push(local);
                        }
                    }
                }
                Waiter::Get(local) => {
                    // A message taken for this getter is handed over when this node applies the
                    // entry (`deliver`), which on a follower comes after the leader's answer:
                    // answering get-empty on the answer lost the race on every follower.
                    let taken = matches!(reply, Some(Reply::Dequeued(Some(_))));
                    let mut st = self.state.lock();
                    if let Some(g) = st.getters.get_mut(&local) {
                        if taken && g.done.is_none() {
                            after.get_applies.push(local);
                        } else {
                            g.done.get_or_insert(false);
                        }
                    }
                    after.gets_done = true;
                }
                Waiter::Rewind(tx) => {
                    let outcome = match reply {
                        Some(Reply::Rewound { count, from_ms, clamped }) => Some(crate::queue::RewindOutcome { rewound: count, from_ms, clamped }),
                        _ => None,
                    };
                    if let (Err(_), Some(outcome)) = (tx.send(outcome), outcome) {
                        tracing::warn!(queue = %queue.name, rewound = outcome.rewound,
                            "a rewind of a quorum queue took effect after its client was told its outcome was unknown (it waited too long)");
                    }
                }
                Waiter::Purge(tx) => {
                    let count = match reply {
                        Some(Reply::Purged { count }) => Some(count),
                        _ => None,
                    };
                    if tx.send(count).is_err() {
                        if let Some(count) = count {
                            // Its client was told the outcome was unknown (`purge` timed out).
                            tracing::warn!(queue = %queue.name, removed = count,
                                "a purge of a quorum queue took effect after its client was told its outcome was unknown (it waited too long)");
                        }
                    }
                }
            }
        }
        {
            let mut p = self.proposals.lock();
            p.in_flight -= 1;
            for (command, waiter) in again.drain(..).flatten() {
                if p.encoder.push(&command, &[]).is_ok() {
                    p.command(waiter);
                }
            }
            self.flush(queue, &mut p);
        }
        self.finish(queue, after);
    }

    /// The commands of an entry whose outcome is unknown (not committed in time, or sent to a
    /// leader that went silent or was replaced: it may still be applied, or never) that must be
    /// proposed again, with how many times they will have been: acks, nacks, rejects and detaches.
    /// Lost, an ack left its message checked out to a consumer that goes on (a prefetch-1 consumer
    /// then got nothing more), and a detach left a consumer this node no longer has counted by the
    /// group, taking messages. They are safe twice: the group ignores a settlement of a message the
    /// consumer no longer holds and a detach of a consumer it does not know. (A requeue applied
    /// twice, the message delivered to the same consumer between, is a second redelivery.) Not
    /// again: publishes (nacked: the client decides), Attach and Dequeue (their waiters deal with
    /// it), ConsumerDown (this node's new consumers may be attached since), ticks and purges.
    ///
    /// Returns, by the entry's commands (their waiters), those to propose again with their new
    /// waiters (None: not again). A transaction's commit-ok waits for its settlements proposed again.
    pub(super) fn to_propose_again(&self, queue: &Queue, entry: &[u8], waiters: &[Waiter]) -> Vec<Option<(Command, Waiter)>> {
        if self.state.lock().deleted {
            return Vec::new();
        }
        let commands = match Command::decode(entry) {
            Ok(Command::Batch(commands)) => commands,
            Ok(one) => vec![one],
            Err(_) => return Vec::new(),
        };
        let mut again = Vec::with_capacity(waiters.len());
        for (command, waiter) in commands.into_iter().zip(waiters) {
            let (attempt, tx) = match waiter {
                Waiter::Settled { tries, tx } => (tries + 1, tx.clone()),
                _ => (1, None),
            };
            let settles = matches!(command, Command::Settle { .. } | Command::Return { .. } | Command::Discard { .. } | Command::Detach { .. });
            if !settles {
                again.push(None);
                continue;
            }
            if attempt > PROPOSE_AGAIN_TIMES {
                tracing::error!(queue = %queue.name, "a quorum queue's ack or detach was not committed after {PROPOSE_AGAIN_TIMES} tries; given up (its consumer may hold messages until its channel closes)");
                again.push(None);
                continue;
            }
            again.push(Some((command, Waiter::Settled { tries: attempt, tx })));
        }
        again
    }

    /// A message routed to this queue: it joins the next entry.
    /// With `delay_ms` > 0 the group holds it that long first (`QuorumMachine::fire_due`).
    pub(in crate::queue) fn publish(&self, queue: &Arc<Queue>, message: &MessageRef, stored_header: &[u8], now_ms: u64, delay_ms: u64, publisher: Option<Publisher>) -> Result<crate::queue::Enqueued> {
        let mut p = self.proposals.lock();
        // The machine drops a publish whose seq is at or below its session's last as a re-sent
        // duplicate, so a session's seqs must enter entries in rising order. A connection's session
        // numbers its publishes on its one reader task; the node's own session (publishes without
        // confirms, dead letters) is shared by every connection, so its seq is taken under the
        // proposals lock, where the message also joins the entry: taken before it, two connections
        // could add their numbers out of order and the lower one was dropped on every replica.
        let (session, seq, tracked) = match publisher {
            Some(p) => (SessionId { node: self.node(), channel: p.session.id }, p.seq, Some(p.session)),
            None => (SessionId { node: self.node(), channel: self.own_session }, self.own_seq.fetch_add(1, Ordering::Relaxed), None),
        };
        {
            let mut st = self.state.lock();
            if st.deleted {
                return Ok(crate::queue::Enqueued::Accepted { ticket: None, slow_publishers: false, store_behind: false });
            }
            if let Some(session) = tracked {
                if !st.sessions.contains_key(&session.id) {
                    st.sessions.insert(session.id, Arc::downgrade(session));
                    if st.sessions.len() > st.sessions_pruned_at {
                        // Ended sessions go, here and in the machine (their dedup state).
                        let node = self.node();
                        let mut ended = Vec::new();
                        st.sessions.retain(|id, s| {
                            let live = s.strong_count() > 0;
                            if !live {
                                ended.push(*id);
                            }
                            live
                        });
                        st.sessions_pruned_at = (2 * st.sessions.len()).max(16);
                        for id in ended {
                            p.encoder.session_end(SessionId { node, channel: id });
                            p.command(Waiter::None);
                        }
                    }
                }
            }
        }
        let size = stored_header.len() + message.body.len();
        if p.encoder.messages() >= MAX_MESSAGES_PER_ENTRY || p.encoder.encoded_len() + size > MAX_ENTRY_BYTES {
            p.seal();
        }
        // RabbitMQ 4's two priorities: above 4 is high (`quorum::ready`).
        let high = warren_protocol::properties::PropertiesView::new(&message.properties)
            .ok()
            .and_then(|v| v.priority())
            .is_some_and(|p| p > crate::quorum::ready::HIGH_PRIORITY_ABOVE);
        let delayed = delay_ms > 0;
        if p.open_session != Some((session, high, delayed)) {
            if delayed {
                p.encoder.begin_enqueue_delayed(session, now_ms, high);
            } else {
                p.encoder.begin_enqueue(session, now_ms, high);
            }
            p.command(Waiter::Enqueue { session: tracked.cloned(), seqs: Vec::new() });
            p.open_session = Some((session, high, delayed));
            p.open_now_ms = now_ms;
        }
        // The machine dates a delayed message by its Enqueue's clock, which is its first message's:
        // a later one's delay grows by the time between them, so it is due `delay_ms` after its own
        // publish; and by 1 ms, as clocks are whole ms (a publish at 1000.9 ms is dated 1000).
        let delay_ms = if delayed { delay_ms.saturating_add(now_ms.saturating_sub(p.open_now_ms)).saturating_add(1) } else { 0 };
        let mut scratch = std::mem::take(&mut p.scratch);
        scratch.clear();
        scratch.extend_from_slice(stored_header);
        scratch.extend_from_slice(&message.body);
        let body_len = u32::try_from(message.body.len()).unwrap_or(u32::MAX);
        let added = if delayed {
            p.encoder.message_delayed(seq, body_len, message.expiration_ms, delay_ms, &scratch)
        } else {
            p.encoder.message(seq, body_len, message.expiration_ms, &scratch)
        };
        p.scratch = scratch;
        if let Err(e) = added {
            return Err(BrokerError::internal(format!("could not add a message to quorum queue '{}': {e}", queue.name)));
        }
        p.pending_bytes += size;
        if let Some(session) = tracked {
            session.sent(self.group, seq);
            if let Some(Waiter::Enqueue { seqs, .. }) = p.waiters.last_mut() {
                seqs.push(seq);
            }
        }
        self.flush(queue, &mut p);
        let slow_publishers = p.pending_bytes >= PENDING_PAUSE_BYTES;
        Ok(crate::queue::Enqueued::Accepted { ticket: None, slow_publishers, store_behind: false })
    }
}

/// A purge or rewind not applied within `PURGE_TIMEOUT`: what its client is told.
pub(super) fn outcome_unknown(what: &str, queue: &str) -> BrokerError {
    BrokerError::internal(format!(
        "the {what} of quorum queue '{queue}' was not committed within {} s (no majority of its replicas reachable); \
         its outcome is unknown: it may still take effect (the node logs it if it does)",
        PURGE_TIMEOUT.as_secs()
    ))
}

/// Adds settlements to the entry being built: one command per consumer and kind.
/// Detaches `consumers`, returning what they hold (as acquired, not failed deliveries).
pub(super) fn detach_returning(p: &mut Proposals, consumers: impl IntoIterator<Item = ConsumerId>) {
    for c in consumers {
        p.encoder.detach(c, true);
        p.command(Waiter::None);
    }
}

/// Whether a channel on this node holds a message delivered to `consumer` (`ReplicaState::checked_out`).
pub(super) fn holds_any(checked_out: &BTreeMap<MsgId, ConsumerId>, consumer: ConsumerId) -> bool {
    checked_out.values().any(|holder| *holder == consumer)
}

/// Messages the group delivered to a consumer of this node that is gone from it: its cancel or
/// its channel's close was proposed, and not applied yet, or lost (sent to a leader that stopped),
/// or it is an earlier run's. They go back, and so does the consumer. Returned one by one
/// (Return: delivery count + 1), a consumer whose detach was lost got them again at once: after
/// `x-delivery-limit` rounds they were dropped. So: a consumer whose channel holds none of its
/// messages is detached with them (Detach with return: back as acquired, not failed); one
/// cancelled while its channel still holds some (which the client may still ack) is cancelled
/// again (it takes nothing more) before these are returned.
pub(super) fn delivered_to_gone(p: &mut Proposals, to_gone: Vec<ToGone>) {
    let mut detached: Vec<ConsumerId> = Vec::new();
    for ToGone { consumer, client_holds, msgs } in to_gone {
        if !detached.contains(&consumer) {
            detached.push(consumer);
            p.encoder.detach(consumer, !client_holds);
            p.command(Waiter::None);
        }
        if client_holds {
            // Never sent to the client: not failed deliveries.
            p.encoder.unassign(consumer, &msgs);
            p.command(Waiter::None);
        }
    }
}

pub(super) fn push_settlements(p: &mut Proposals, settled: impl Iterator<Item = (ConsumerId, MsgId)>, how: Settle) {
    let mut by_consumer: Vec<(ConsumerId, Vec<MsgId>)> = Vec::new();
    for (c, m) in settled {
        match by_consumer.iter_mut().find(|(id, _)| *id == c) {
            Some((_, ids)) => ids.push(m),
            None => by_consumer.push((c, vec![m])),
        }
    }
    for (c, ids) in by_consumer {
        match how {
            Settle::Ack => p.encoder.settle(c, &ids),
            Settle::Reject { requeue: true } => p.encoder.return_(c, &ids),
            Settle::Reject { requeue: false } => p.encoder.discard(c, &ids),
        }
        p.command(Waiter::None);
    }
}
