//! Snapshots and catching up: the machine's snapshot, a restart's restore, and the bodies a member
//! fetches from a peer after installing a snapshot (and serves to one).

use super::*;

impl QuorumReplica {
    /// The machine's state for a snapshot (no bodies). The log up to here may be purged once the
    /// snapshot is stored: the entries with the bodies of live messages are pinned (`keep_body`),
    /// so the log keeps them.
    pub(in crate::queue) fn snapshot(&self) -> Bytes {
        self.state.lock().machine.snapshot()
    }

    /// Replaces the machine's state by a snapshot's.
    pub(in crate::queue) fn restore_snapshot(&self, snapshot: &[u8]) -> std::result::Result<(), String> {
        let mut st = self.state.lock();
        let applied = st.machine.last_index();
        st.machine.restore(snapshot).map_err(|e| e.to_string())?;
        st.applied_before_restore = applied;
        self.next_due.store(st.machine.next_due().unwrap_or(u64::MAX), Ordering::Relaxed);
        Ok(())
    }

    /// At a start, the machine was restored from this node's own snapshot: the live messages it
    /// lists whose bodies were not loaded from the queue's records (`restore_bodies`) are in their
    /// entries, which this node applied before the snapshot (also below `stored_until`: bodies this
    /// node had in its entries when it installed a snapshot were not fetched as records). Those
    /// entries are pinned now (the log lets the retained ones nobody pins go after this) and the
    /// bodies read back when delivered.
    pub(in crate::queue) fn restored_at_start(&self, queue: &Queue) {
        let mut st = self.state.lock();
        let missing: Vec<MsgId> = st.machine.live_ids().into_iter().filter(|id| !st.bodies.contains_key(id)).collect();
        if !missing.is_empty() {
            tracing::debug!(queue = %queue.name, messages = missing.len(), "a quorum queue's bodies are read from its log when delivered");
        }
        for id in missing {
            insert_body(&mut st, id, Body { message: None, mem: 0, stored_bytes: 0, record: Record::InEntry { payload: None } });
        }
        // Every id of its own snapshot is in an entry this node applied.
        let applied = st.machine.last_index();
        retain_entries_of_machine(&mut st, applied);
        // Records of consumed messages kept for a rewind were loaded as bodies (`restore_bodies`).
        if st.machine.config().retention_ms.is_some() {
            let kept: Vec<MsgId> = st.bodies.keys().copied().filter(|id| !st.machine.is_live(*id) && st.machine.is_kept(*id)).collect();
            for id in kept {
                if let Some(body) = st.bodies.remove(&id) {
                    if let Record::Stored(ticket) = body.record {
                        st.kept_records.insert(id, (ticket, body.stored_bytes));
                    }
                    let_go(&mut st, id, &body);
                }
            }
        }
    }

    /// A snapshot from a peer was installed (`restore_snapshot`): bodies of messages it no longer
    /// lists go, and the first request for the bodies of its live messages this node lacks is
    /// returned (None: nothing to fetch). Those bodies must be in the store before any later entry
    /// applies (records rise by msg id): the caller fetches them ([`QuorumReplica::bodies_fetched`])
    /// before returning to the group. The live bodies this node has in its own entries stay there
    /// (pinned: the log keeps them when it goes up to the snapshot).
    pub(in crate::queue) fn snapshot_installed(&self, queue: &Arc<Queue>) -> std::result::Result<Option<Bytes>, String> {
        let mut after = After::default();
        let request = {
            let mut st = self.state.lock();
            // First: entries of messages the snapshot keeps for a rewind must not go with the bodies
            // that leave here. Only those this node applied: at a higher index its log may hold an
            // entry the group never committed (it led alone, cut off), not the message's.
            let applied = st.applied_before_restore;
            if let Some(installed) = st.machine.last_index() {
                let first = applied.map_or(0, |a| a + 1);
                if first <= installed {
                    st.not_applied_here.push(first..=installed);
                }
            }
            retain_entries_of_machine(&mut st, applied);
            let gone: Vec<MsgId> = st.bodies.keys().copied().filter(|id| !st.machine.is_live(*id)).collect();
            for id in gone {
                forget(&mut st, self.group, id, &mut after.acks);
            }
            let ReplicaState { machine, checked_out, .. } = &mut *st;
            checked_out.retain(|id, _| machine.is_live(*id));
            let until = st.machine.last_index().map_or(0, |i| (i + 1) << 16);
            let from = st.stored_until;
            if from < until {
                st.fetch = Some(BodyFetch { until, started: std::time::Instant::now(), messages: 0, bytes: 0 });
                Some(BodiesRequest { from, until, max_bytes: FETCH_BYTES }.encode())
            } else {
                None
            }
        };
        self.finish(queue, after);
        Ok(request)
    }

    /// A peer's answer to `request`: the live messages among its records are written to this node's
    /// store (as they would have been at apply) and held. Returns the next request, or None once the
    /// snapshot's bodies are all here. An answer that does not decode is an error (ask elsewhere).
    pub(in crate::queue) fn bodies_fetched(&self, queue: &Arc<Queue>, request: &[u8], answer: Bytes) -> std::result::Result<Option<Bytes>, String> {
        let request = BodiesRequest::decode(request).map_err(|e| format!("bad body request: {e}"))?;
        let answer = BodiesAnswer::decode(&answer, &request).map_err(|e| format!("bad body answer: {e}"))?;
        let mut after = After::default();
        let next = {
            let mut st = self.state.lock();
            if st.deleted {
                st.fetch = None;
                return Ok(None);
            }
            let Some(until) = st.fetch.as_ref().map(|f| f.until) else { return Ok(None) };
            for r in answer.records {
                // Already stored here (an earlier answer), or neither live nor kept for a rewind.
                let kept = st.machine.is_kept(r.msg_id);
                if r.msg_id < st.stored_until || !(st.machine.is_live(r.msg_id) || kept) || st.bodies.contains_key(&r.msg_id) {
                    continue;
                }
                let Some(stored) = decode_stored(&r.payload) else {
                    return Err(format!("message {} from the peer does not decode", r.msg_id));
                };
                let ticket = self.store.append_enqueue(self.group, r.msg_id, r.timestamp_ms, &[&r.payload]).map_err(|e| e.to_string())?;
                st.stored_until = r.msg_id + 1;
                st.last_ticket = st.last_ticket.max(ticket);
                if kept {
                    // Consumed, kept for a rewind: the record waits (`Effect::Rewound`, `unretain`).
                    st.kept_records.insert(r.msg_id, (ticket, r.payload.len() as u64));
                    continue;
                }
                if stored.message.expiration_ms.is_some() {
                    self.saw_expiration.store(true, Ordering::Relaxed);
                }
                let stored_bytes = r.payload.len() as u64;
                let message = hold(&st, stored.message);
                insert_body(&mut st, r.msg_id, Body::new(message, stored_bytes, Record::Stored(ticket)));
                if let Some(f) = st.fetch.as_mut() {
                    f.messages += 1;
                    f.bytes += stored_bytes;
                }
            }
            if !answer.complete {
                Some(BodiesRequest { from: answer.next.max(st.stored_until), until, max_bytes: FETCH_BYTES }.encode())
            } else {
                st.stored_until = st.stored_until.max(until);
                if let Some(f) = st.fetch.take() {
                    let secs = f.started.elapsed().as_secs_f64().max(1e-6);
                    tracing::info!(
                        queue = %queue.name,
                        messages = f.messages,
                        bytes = f.bytes,
                        secs = format!("{secs:.2}"),
                        msgs_per_s = format!("{:.0}", f.messages as f64 / secs),
                        mb_per_s = format!("{:.1}", f.bytes as f64 / secs / 1e6),
                        "caught up from a snapshot: fetched the bodies of its live messages from a peer"
                    );
                }
                // Messages the snapshot has checked out to this node's consumers (assigned by entries
                // this node skipped) go to them now.
                let node = self.node();
                let locals: Vec<u64> = st.consumers.keys().copied().collect();
                for local in locals {
                    let id = ConsumerId { node, local };
                    let msgs: Vec<Delivery> = st
                        .machine
                        .checked_out_by(id)
                        .into_iter()
                        .filter(|m| !st.checked_out.contains_key(m))
                        .map(|msg_id| Delivery { msg_id, redelivered: true, delivery_count: 0 })
                        .collect();
                    if !msgs.is_empty() {
                        self.deliver(queue, &mut st, id, false, msgs, &mut after);
                    }
                }
                None
            }
        };
        self.finish(queue, after);
        Ok(next)
    }

    /// A peer asks for the bodies of this replica's live messages (it installed a snapshot): from
    /// memory, the queue's records and the entries they are in. Blocking (store reads, a short wait
    /// for the store's writer): called off the runtime.
    pub(in crate::queue) fn serve_bodies(&self, queue: &Queue, request: &[u8]) -> std::result::Result<Bytes, String> {
        let request = BodiesRequest::decode(request).map_err(|e| format!("bad body request: {e}"))?;
        let max_bytes = (request.max_bytes as usize).clamp(1, MAX_ANSWER_BYTES);
        // Where each live body of the range is, about `max_bytes` of them: read after the lock.
        let (applied_until, ticket, now_ms, plan, mut next) = {
            let st = self.state.lock();
            if st.fetch.is_some() {
                return Err("this replica is itself fetching the bodies of a snapshot".to_string());
            }
            let mut plan: Vec<(MsgId, Option<Bytes>, bool)> = Vec::new();
            let mut bytes = 0u64;
            let mut next = request.until;
            // Live messages, and (with retention) consumed ones kept for a rewind, in id order.
            let mut live = st.bodies.range(request.from..request.until).peekable();
            let mut kept = st.machine.kept_from(request.from).take_while(|id| *id < request.until).peekable();
            loop {
                let (id, is_kept) = match (live.peek(), kept.peek()) {
                    (None, None) => break,
                    (Some((&l, _)), Some(&k)) if k < l => (k, true),
                    (Some((&l, _)), _) => (l, false),
                    (None, Some(&k)) => (k, true),
                };
                if bytes >= max_bytes as u64 || plan.len() >= SERVE_MAX_MESSAGES {
                    next = id;
                    break;
                }
                if is_kept {
                    kept.next();
                    plan.push(match st.kept_records.get(&id) {
                        Some(&(_, stored_bytes)) => {
                            bytes += stored_bytes;
                            (id, None, false)
                        }
                        None if !applied_here(&st, id >> 16) => continue,
                        None => (id, None, true),
                    });
                    continue;
                }
                let Some((_, body)) = live.next() else { break };
                bytes += body.stored_bytes;
                plan.push(match &body.record {
                    Record::InEntry { payload } => (id, payload.clone(), true),
                    Record::Stored(_) => (id, None, false),
                });
            }
            (st.machine.last_index().map_or(0, |i| (i + 1) << 16), st.last_ticket, st.machine.now_ms(), plan, next)
        };
        if applied_until < request.until {
            return Err(format!("this replica has applied less of the log ({applied_until:#x}) than asked ({:#x})", request.until));
        }
        if plan.iter().any(|(_, _, in_entry)| !in_entry) && !self.store.wait_readable(ticket, READABLE_WAIT) {
            return Err("the store has not made the records readable yet".to_string());
        }
        let from_log: Vec<MsgId> = plan.iter().filter(|(_, held, in_entry)| *in_entry && held.is_none()).map(|(id, ..)| *id).collect();
        let log = self.replicator.read().clone();
        let mut from_log = payloads_from_entries(queue, log.as_deref(), &from_log).into_iter().peekable();
        let mut from_store: VecDeque<warren_store::StoredMessage> = VecDeque::new();
        let mut records = Vec::with_capacity(plan.len());
        let mut bytes = 0;
        let unreadable = !plan.is_empty() && unreadable_once_for_tests();
        if unreadable {
            tracing::warn!(queue = %queue.name, "answered a body request as if no body were readable (WARREN_TEST_UNREADABLE_BODIES_ONCE)");
        }
        for (id, held, in_entry) in plan {
            // Bodies restored at a start are counted at 0 bytes in the plan: the cap is on what is read.
            if bytes >= max_bytes {
                next = id;
                break;
            }
            let payload = match (held, in_entry) {
                _ if unreadable => None,
                (Some(p), _) => Some(p),
                (None, true) => from_log.next_if(|(i, _)| *i == id).map(|(_, p)| p),
                (None, false) => {
                    while from_store.front().is_some_and(|m| m.seq < id) {
                        from_store.pop_front();
                    }
                    if from_store.is_empty() {
                        from_store.extend(self.store.read(self.group, id, READ_BACK_MESSAGES, READ_BACK_BYTES).map_err(|e| e.to_string())?.messages);
                    }
                    from_store.front().filter(|m| m.seq == id).map(|m| m.payload.clone())
                }
            };
            match payload {
                Some(payload) => {
                    bytes += payload.len();
                    records.push(BodyRecord { msg_id: id, timestamp_ms: now_ms, payload });
                }
                // The message left since it was planned (its record acked, its entry let go): the
                // asking node applies that later too. Still live, it is a body this replica cannot
                // read: an answer without it would leave the asking node without it for good, so
                // the request fails, and that node asks another member.
                None if self.state.lock().machine.is_live(id) => {
                    return Err(format!("this replica cannot read the body of live message {id:#x}"));
                }
                None => {}
            }
        }
        Ok(BodiesAnswer { records, next, complete: next >= request.until }.encode())
    }

    /// At a start: loads what the store holds for this queue (the bodies of its live messages).
    pub(in crate::queue) fn restore_bodies(&self, queue: &Queue, recovered: &RecoveredQueue) {
        let mut st = self.state.lock();
        st.stored_until = st.stored_until.max(recovered.next_seq);
        let mut from = recovered.first_seq;
        while from < recovered.next_seq {
            let batch = match self.store.read(self.group, from, 4096, 16 << 20) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(queue = %queue.name, error = %e, "could not read a quorum queue's messages back from the store");
                    return;
                }
            };
            if batch.messages.is_empty() && batch.next_seq <= from {
                break;
            }
            for m in batch.messages {
                let stored_bytes = m.payload.len() as u64;
                match decode_stored(&m.payload) {
                    Some(stored) => {
                        let message = hold(&st, stored.message);
                        insert_body(&mut st, m.seq, Body::new(message, stored_bytes, Record::Stored(0)));
                    }
                    None => tracing::error!(queue = %queue.name, seq = m.seq, "unreadable message in the store"),
                }
            }
            from = batch.next_seq;
        }
    }
}

/// Test-only (`WARREN_TEST_UNREADABLE_BODIES_ONCE=1`, test-hooks builds): true for the first body
/// request with bodies in it that this node serves: it finds none of them readable (as if a pinned
/// entry were lost), so a test shows that the asking node gets them from another member instead
/// of going on without them.
fn unreadable_once_for_tests() -> bool {
    static ARMED: std::sync::OnceLock<std::sync::atomic::AtomicBool> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        let on = warren_store::test_hooks::var("WARREN_TEST_UNREADABLE_BODIES_ONCE").is_some_and(|v| v == "1");
        if on {
            tracing::warn!("WARREN_TEST_UNREADABLE_BODIES_ONCE is set: the first body request served finds no body readable (a test-only hook)");
        }
        std::sync::atomic::AtomicBool::new(on)
    });
    armed.swap(false, Ordering::Relaxed)
}
