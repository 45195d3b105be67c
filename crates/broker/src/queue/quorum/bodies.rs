//! Message bodies on this replica: kept in memory within the node's budget, pinned in their Raft
//! entries, read back (ahead of delivery) from the log or the queue's store records.

use super::*;

impl QuorumReplica {
    /// Keeps a message's body for delivery: in its entry, in this node's store already (pinned, so
    /// that the log keeps it), held in memory while the node's budget has room and read back from
    /// the entry past it. Nothing for a replayed entry's message whose record was written before a
    /// restart (loaded at the start, if still live).
    pub(super) fn keep_body(&self, st: &mut ReplicaState, msg_id: MsgId, payload: Bytes) {
        if msg_id < st.stored_until {
            return;
        }
        if stored_has_expiration(&payload) {
            self.saw_expiration.store(true, Ordering::Relaxed);
        }
        let stored_bytes = payload.len() as u64;
        // About what the decoded message would count (`Message::memory_bytes`).
        let memory = stored_bytes + 128;
        let (payload, mem) = if st.body_mem.fits(memory) { (Some(payload), memory) } else { (None, 0) };
        insert_body(st, msg_id, Body { message: None, mem, stored_bytes, record: Record::InEntry { payload } });
    }

    /// A live message's body if this node holds it (in memory, or in its entry's bytes held). The
    /// bodies not held were read before the effect (`body_read_for`): None if the replica has no
    /// such message or its body could not be read.
    pub(super) fn message_of(&self, queue: &Queue, st: &ReplicaState, msg_id: MsgId) -> Option<MessageRef> {
        match st.bodies.get(&msg_id)? {
            Body { message: Some(m), .. } => Some(m.clone()),
            Body { record: Record::InEntry { payload: Some(payload) }, .. } => {
                let decoded = decode_stored(payload).map(|stored| Arc::new(stored.message));
                if decoded.is_none() {
                    tracing::error!(queue = %queue.name, msg_id, "a quorum queue's message does not decode; not delivered");
                }
                decoded
            }
            _ => None,
        }
    }

    /// The next read `effect` needs before it is performed: of the first body it delivers (to a
    /// consumer or getter of this node) or dead-letters (as the leader) that is only on disk, and
    /// the bodies after it. Each body is read at most twice (`tries`; the first may wait for a
    /// read ahead under way), then left out: the effect finds it missing. Those up to the effect's
    /// last are held whatever the memory budget, as they are wanted now; the others while they fit.
    /// Past the budget the read stops at the effect's last.
    ///
    /// Why the bodies after it: a read kept only the body asked for once past the budget, so a
    /// consumer assigned 9,000 messages (prefetch 3,000) read 4 MiB for each of them, and each body
    /// kept, a slice of its read, held all 4 MiB: 12,000 bodies of 8 KB took the node past 10 GB.
    pub(super) fn body_read_for(&self, queue: &Queue, st: &mut ReplicaState, effect: &Effect, leader: bool, tries: &mut HashMap<MsgId, u8>) -> Option<BodyRead> {
        if st.store_only == 0 {
            return None;
        }
        let not_held = |st: &ReplicaState, id: MsgId, tries: &HashMap<MsgId, u8>| {
            st.bodies.get(&id).is_some_and(|b| !b.held()) && tries.get(&id).is_none_or(|n| *n < 2)
        };
        let (first, through) = match effect {
            Effect::Deliver { consumer, msgs, .. }
                if consumer.node == self.node() && !st.deleted && (st.getters.contains_key(&consumer.local) || st.consumers.contains_key(&consumer.local)) =>
            {
                let through = msgs.iter().map(|d| d.msg_id).max()?;
                (msgs.iter().map(|d| d.msg_id).find(|id| not_held(st, *id, tries))?, through)
            }
            Effect::DeadLetter { reason, msgs } | Effect::DeadLetterHeld { reason, msgs }
                if leader && death_reason(*reason).is_some() && queue.args.dead_letter_exchange.is_some() =>
            {
                let through = msgs.iter().map(|&(first, n)| first + u64::from(n).saturating_sub(1)).max()?;
                (run_ids(msgs).find(|id| not_held(st, *id, tries))?, through)
            }
            _ => return None,
        };
        let attempt = tries.entry(first).or_insert(0);
        *attempt += 1;
        let wanted = first..=through.max(first);
        if *attempt == 1 {
            if let Some(seqs) = st.read_ahead.under_way.iter().find(|r| r.contains(&first)).cloned() {
                st.read_ahead.awaited = Some(seqs.clone());
                return Some(BodyRead { wanted, from: BodySource::UnderWay(seqs) });
            }
        }
        let over_budget = !st.body_mem.fits_read_back(1);
        let from = match st.bodies.get(&first)?.record {
            Record::Stored(ticket) => BodySource::Store { ticket, over_budget },
            Record::InEntry { .. } => {
                let upto = if over_budget { through } else { MsgId::MAX };
                BodySource::Entries { log: st.log.clone(), ids: not_held_in_entries(st, first..=upto, READ_BACK_MESSAGES) }
            }
        };
        Some(BodyRead { wanted, from })
    }

    /// Makes `read` (without `state`'s lock, on a blocking thread): the bodies decoded, None if there
    /// are none to take (a failed read, logged, or a read ahead that did not end in time).
    pub(super) fn read_bodies(&self, queue: &Queue, read: &BodyRead) -> Option<Vec<(MsgId, MessageRef)>> {
        let first = *read.wanted.start();
        match &read.from {
            BodySource::UnderWay(seqs) => {
                let deadline = std::time::Instant::now() + READ_UNDER_WAY_WAIT;
                let mut reads = self.reads_done.lock();
                loop {
                    if let Some(done) = take_read_done(&mut reads, seqs) {
                        return done.bodies;
                    }
                    if self.read_done.wait_until(&mut reads, deadline).timed_out() {
                        tracing::warn!(queue = %queue.name, msg_id = first, "a read ahead of a quorum queue's messages took over {READ_UNDER_WAY_WAIT:?}; reading them again");
                        return None;
                    }
                }
            }
            BodySource::Store { ticket, over_budget } => {
                warren_store::test_hooks::wait_while_file_exists(HOLD_BODY_READS_FILE);
                self.store.wait_readable(*ticket, READABLE_WAIT);
                let batch = if *over_budget {
                    self.store.read_direct(self.group, first, *read.wanted.end() + 1, READ_BACK_MESSAGES, READ_BACK_BYTES)
                } else {
                    self.store.read(self.group, first, READ_BACK_MESSAGES, READ_BACK_BYTES)
                };
                match batch {
                    Ok(batch) => Some(decode_bodies(queue, batch.messages)),
                    Err(e) => {
                        tracing::error!(queue = %queue.name, error = %e, "could not read a quorum queue's messages back from the store");
                        None
                    }
                }
            }
            BodySource::Entries { log, ids } => {
                warren_store::test_hooks::wait_while_file_exists(HOLD_BODY_READS_FILE);
                Some(read_from_entries(queue, log.as_deref(), ids))
            }
        }
    }

    /// Back under the lock after waiting for read ahead `seqs`: it is no longer awaited, and if its
    /// task finished while this apply was giving up on it, the bodies it left are taken here.
    pub(super) fn took_read_under_way(&self, st: &mut ReplicaState, seqs: &std::ops::Range<MsgId>, bodies: Option<Vec<(MsgId, MessageRef)>>) -> Option<Vec<(MsgId, MessageRef)>> {
        st.read_ahead.awaited = None;
        st.read_ahead.under_way.retain(|r| r != seqs);
        match take_read_done(&mut self.reads_done.lock(), seqs) {
            Some(done) => done.bodies,
            None => bodies,
        }
    }

    /// After a delivery of `delivered`: if bodies within `READ_AHEAD_WINDOW` after it are only in the
    /// store, reads them on blocking threads, `READS_IN_FLIGHT` reads of consecutive ranges at once,
    /// until the window is held or the memory budget is reached, so they are held when the machine
    /// delivers them. Measured on three nodes draining 1,000,000 messages (`warren bench`, prefetch
    /// 1000): reading 512 bodies on the apply path whenever a delivery found one not held, ~280k
    /// msg/s; with the read-ahead ~360k; with the whole backlog in memory ~530k.
    pub(super) fn read_ahead(&self, queue: &Arc<Queue>, st: &mut ReplicaState, delivered: MsgId) {
        st.read_ahead.delivered = st.read_ahead.delivered.max(delivered);
        if st.read_ahead.in_flight < READS_IN_FLIGHT && st.read_ahead.delivered >= st.read_ahead.look_again_at {
            self.start_reads(queue, st);
        }
    }

    /// Starts reads ahead while fewer than `READS_IN_FLIGHT` are under way and there is one to make
    /// (`next_read`) among the bodies only in the store (`store_only`).
    fn start_reads(&self, queue: &Arc<Queue>, st: &mut ReplicaState) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        while st.store_only > 0 && st.read_ahead.in_flight < READS_IN_FLIGHT && !st.deleted {
            let Some(range) = self.next_read(st) else { return };
            st.read_ahead.in_flight += 1;
            st.read_ahead.claimed_until = range.seqs.end;
            st.read_ahead.under_way.push(range.seqs.clone());
            Self::read_ahead_task(&rt, queue.clone(), range);
        }
    }

    /// One read ahead, of the bodies in `range`, on a blocking thread. The store serializes a
    /// queue's reads, so with two under way one waits for the other's disk reads while that one
    /// decodes its bodies and waits for the replica's lock to hold them: the disk is kept busy.
    /// Draining 500,000 messages past the budget (`bench/cluster.py` Q2): one read after the
    /// other, 266-286k msg/s; two in flight, see `READS_IN_FLIGHT`. The task then starts the next
    /// reads, unless it found nothing (not readable yet, or a failed read): a later delivery looks
    /// again.
    pub(super) fn read_ahead_task(rt: &tokio::runtime::Handle, queue: Arc<Queue>, range: ReadRange) {
        rt.spawn_blocking(move || {
            let Some(me) = queue.replica() else { return };
            let ReadRange { seqs: range, bytes, from_entries } = range;
            let (read, read_until) = match from_entries {
                Some(ids) => {
                    let log = me.replicator.read().clone();
                    (Ok(read_from_entries(&queue, log.as_deref(), &ids)), range.end)
                }
                None => {
                    // The bytes bound the size of the store's disk reads too: the range's own, not more.
                    let read = me.store.read_direct(me.group, range.start, range.end, 2 * READ_AHEAD_MESSAGES, bytes.max(1));
                    let read_until = read.as_ref().map_or(range.start, |b| b.next_seq);
                    // Decoded before the lock: the apply path and the consumers' dispatch wait for it.
                    (read.map(|b| decode_bodies(&queue, b.messages)), read_until)
                }
            };
            let found = match &read {
                Ok(bodies) => !bodies.is_empty(),
                Err(e) => {
                    tracing::error!(queue = %queue.name, error = %e, "could not read a quorum queue's messages ahead from the store");
                    false
                }
            };
            // Handed over first without `state`'s lock: a delivery waiting for this read holds it.
            me.reads_done.lock().push(ReadDone { seqs: range.clone(), bodies: read.ok() });
            me.read_done.notify_all();
            let mut st = me.state.lock();
            st.read_ahead.in_flight = st.read_ahead.in_flight.saturating_sub(1);
            st.read_ahead.under_way.retain(|r| *r != range);
            // An apply waiting for this read takes its bodies (`took_read_under_way`).
            let awaited = st.read_ahead.awaited.as_ref() == Some(&range);
            let mine = if awaited { None } else { take_read_done(&mut me.reads_done.lock(), &range) };
            // None: a delivery took the bodies already.
            if let Some(ReadDone { bodies: Some(bodies), .. }) = mine {
                take_bodies(&mut st, bodies, &NOTHING_WANTED);
            }
            if read_until < range.end {
                // The read stopped short (its byte or count cap, or records not readable yet): what
                // is left of the range may be read again.
                st.read_ahead.claimed_until = st.read_ahead.claimed_until.min(read_until);
            }
            if found {
                me.start_reads(&queue, &mut st);
            }
        });
    }

    /// The next read ahead: from the first body after the last delivery and the reads under way
    /// that is only in the store (and readable), over `READ_AHEAD_MESSAGES` bodies or about
    /// `READ_AHEAD_BYTES` of them, inside the window (`READ_AHEAD_WINDOW` bodies after the last
    /// delivery). None if there is none, or the memory budget has no room for it beside the reads
    /// under way; deliveries then look again only `LOOK_AGAIN_EVERY` bodies later.
    fn next_read(&self, st: &mut ReplicaState) -> Option<ReadRange> {
        let delivered = st.read_ahead.delivered;
        let reserved = (st.read_ahead.in_flight as u64 + 1) * READ_AHEAD_BYTES as u64;
        let window_end = st.bodies.range(delivered + 1..).nth(READ_AHEAD_WINDOW - 1).map_or(MsgId::MAX, |(id, _)| *id + 1);
        let from = (delivered + 1).max(st.read_ahead.claimed_until);
        let found = if !st.body_mem.fits_read_back(reserved) || from >= window_end {
            None
        } else {
            st.bodies.range(from..window_end).find(|(_, b)| !b.held())
        };
        let first = found.and_then(|(id, body)| match body.record {
            Record::Stored(ticket) if self.store.is_readable(ticket) => Some((*id, false)),
            Record::InEntry { payload: None } => Some((*id, true)),
            _ => None,
        });
        let Some((first, in_entries)) = first else {
            // With fewer bodies than that after the last delivery, the next delivery looks again.
            st.read_ahead.look_again_at = st.bodies.range(delivered + 1..).nth(LOOK_AGAIN_EVERY).map_or(delivered + 1, |(id, _)| *id);
            return None;
        };
        let mut end = window_end;
        let mut bytes = 0;
        let mut ids = Vec::new();
        // One kind of read: from the entries, or from the records.
        for (count, (id, body)) in st.bodies.range(first..window_end).enumerate() {
            let in_entry = matches!(body.record, Record::InEntry { .. });
            if count == READ_AHEAD_MESSAGES || bytes >= READ_AHEAD_BYTES as u64 || in_entry != in_entries {
                end = *id;
                break;
            }
            bytes += body.stored_bytes;
            if in_entries && !body.held() {
                ids.push(*id);
            }
        }
        Some(ReadRange { seqs: first..end, bytes: bytes as usize, from_entries: in_entries.then_some(ids) })
    }
}

/// Adds a live message's body: its memory to the budget, counted in `store_only` if not held, and
/// in its entry's count if in its entry, which is pinned in the log with the first (`let_go` takes
/// it out of all three).
pub(super) fn insert_body(st: &mut ReplicaState, msg_id: MsgId, body: Body) {
    st.body_mem.add(body.mem);
    if !body.held() {
        st.store_only += 1;
    }
    if let Record::InEntry { .. } = body.record {
        hold_entry(st, msg_id >> 16);
    }
    if let Some(old) = st.bodies.insert(msg_id, body) {
        let_go(st, msg_id, &old);
    }
}

/// Takes the body of `msg_id` that left `bodies` out of the counts and the memory budget; the last
/// of its entry unpins the entry.
pub(super) fn let_go(st: &mut ReplicaState, msg_id: MsgId, body: &Body) {
    if !body.held() {
        st.store_only = st.store_only.saturating_sub(1);
    }
    if let Record::InEntry { .. } = body.record {
        release_entry(st, msg_id >> 16);
    }
    st.body_mem.sub(body.mem);
}

/// One more hold on entry `index` (a live body in it, or its messages kept for a rewind): the
/// first pins it in the log.
pub(super) fn hold_entry(st: &mut ReplicaState, index: u64) {
    let count = st.entry_holds.entry(index).or_insert(0);
    *count += 1;
    if *count == 1 {
        match &st.log {
            Some(log) => {
                if let Err(e) = log.pin_entry(index) {
                    tracing::error!(index, error = %e, "could not pin a quorum queue's entry in the log: its bodies may go with its next snapshot");
                }
            }
            None => tracing::error!(index, "a quorum queue keeps bodies in its log before its group is attached"),
        }
    }
}

/// One hold less on entry `index`: the last unpins it.
pub(super) fn release_entry(st: &mut ReplicaState, index: u64) {
    if let Some(count) = st.entry_holds.get_mut(&index) {
        *count -= 1;
        if *count == 0 {
            st.entry_holds.remove(&index);
            if let Some(Err(e)) = st.log.as_ref().map(|log| log.unpin_entry(index)) {
                tracing::error!(index, error = %e, "could not let a quorum queue's entry go from the log");
            }
        }
    }
}

/// The machine keeps no message for a rewind below its retention floor: the entries below the
/// floor's entry go from the log once no live body holds them.
pub(super) fn unretain(st: &mut ReplicaState, group: u64, acks: &mut Batch) {
    let floor_id = st.machine.retention_floor();
    while let Some((&id, &(_, bytes))) = st.kept_records.first_key_value() {
        if id >= floor_id {
            break;
        }
        st.kept_records.pop_first();
        acks.ack(group, id, bytes);
    }
    let floor = floor_id >> 16;
    while let Some(&index) = st.retained_entries.first() {
        if index >= floor {
            break;
        }
        st.retained_entries.pop_first();
        release_entry(st, index);
    }
}

/// With retention: the entry `index` stays pinned in the log, whether or not it holds live bodies,
/// until the machine's retention floor passes it (`unretain`).
pub(super) fn retain_entry(st: &mut ReplicaState, index: u64) {
    if applied_here(st, index) && st.retained_entries.insert(index) {
        hold_entry(st, index);
    }
}

/// Whether this node's log holds the entry at `index` as the group committed it (see
/// `ReplicaState::not_applied_here`).
pub(super) fn applied_here(st: &ReplicaState, index: u64) -> bool {
    !st.not_applied_here.iter().any(|r| r.contains(&index))
}

/// With retention, after the machine was restored (a start, a snapshot installed): the entries of
/// every message it keeps for a rewind, and of every live one (kept once consumed), stay pinned,
/// those up to `applied` (the last index this node applied itself; None: none).
pub(super) fn retain_entries_of_machine(st: &mut ReplicaState, applied: Option<u64>) {
    let Some(applied) = applied else { return };
    if st.machine.config().retention_ms.is_none() {
        return;
    }
    let floor = st.machine.retention_floor() >> 16;
    let mut entries: Vec<u64> =
        st.machine.retained_entries().chain(st.machine.live_ids().into_iter().map(|id| id >> 16)).filter(|i| *i >= floor && *i <= applied).collect();
    entries.sort_unstable();
    entries.dedup();
    for index in entries {
        retain_entry(st, index);
    }
}

/// A message left the queue: its body and store record go.
pub(super) fn forget(st: &mut ReplicaState, group: u64, msg_id: MsgId, acks: &mut Batch) {
    st.checked_out.remove(&msg_id);
    let Some(body) = st.bodies.remove(&msg_id) else { return };
    if let Record::Stored(ticket) = body.record {
        if st.machine.config().retention_ms.is_some() && st.machine.is_kept(msg_id) {
            st.kept_records.insert(msg_id, (ticket, body.stored_bytes));
        } else {
            acks.ack(group, msg_id, body.stored_bytes);
        }
    }
    let_go(st, msg_id, &body);
}

/// A new live message's body, to be held in memory (`insert_body` counts it) while the node's budget
/// has room for it.
pub(super) fn hold(st: &ReplicaState, message: crate::message::Message) -> Option<MessageRef> {
    st.body_mem.fits(message.memory_bytes() as u64).then(|| Arc::new(message))
}

/// Decodes bodies read back from the store (unreadable ones are logged and left out).
fn decode_bodies(queue: &Queue, messages: Vec<warren_store::StoredMessage>) -> Vec<(MsgId, MessageRef)> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        match decode_stored(&m.payload) {
            Some(stored) => out.push((m.seq, Arc::new(stored.message))),
            None => tracing::error!(queue = %queue.name, seq = m.seq, "unreadable message in the store"),
        }
    }
    out
}

/// The ids of the bodies in `ids` that are only in their entries and not held, at most `max`.
fn not_held_in_entries(st: &ReplicaState, ids: std::ops::RangeInclusive<MsgId>, max: usize) -> Vec<MsgId> {
    st.bodies.range(ids).filter(|(_, b)| matches!(b.record, Record::InEntry { payload: None })).take(max).map(|(id, _)| *id).collect()
}

/// Reads the bodies of `ids` (in id order) from their entries in this node's log, decoded.
fn read_from_entries(queue: &Queue, log: Option<&dyn Replicator>, ids: &[MsgId]) -> Vec<(MsgId, MessageRef)> {
    let mut out = Vec::with_capacity(ids.len());
    for (id, payload) in payloads_from_entries(queue, log, ids) {
        match decode_stored(&payload) {
            Some(stored) => out.push((id, Arc::new(stored.message))),
            None => tracing::error!(queue = %queue.name, msg_id = id, "a quorum queue's message does not decode"),
        }
    }
    out
}

/// Reads the bodies of `ids` (in id order) from their entries in this node's log, an entry once
/// for all its ids: their store encodings (copied out of the entries). Bodies that cannot be read are
/// logged and left out (the log has no such entry any more when the message left meanwhile).
pub(super) fn payloads_from_entries(queue: &Queue, log: Option<&dyn Replicator>, ids: &[MsgId]) -> Vec<(MsgId, Bytes)> {
    let mut out = Vec::with_capacity(ids.len());
    let Some(log) = log else {
        tracing::error!(queue = %queue.name, "a quorum queue's bodies are in its log, but its group is not attached; not read");
        return out;
    };
    let mut at = 0;
    while at < ids.len() {
        let index = ids[at] >> 16;
        let in_entry = ids[at..].iter().take_while(|id| *id >> 16 == index).count();
        let wanted = &ids[at..at + in_entry];
        at += in_entry;
        let entry = match log.read_entry(index) {
            Ok(Some(entry)) => entry,
            Ok(None) => {
                tracing::debug!(queue = %queue.name, index, "an entry with a quorum queue's bodies is not in the log (its messages left)");
                continue;
            }
            Err(e) => {
                tracing::error!(queue = %queue.name, index, error = %e, "could not read a quorum queue's bodies from its log");
                continue;
            }
        };
        let payloads = match Command::enqueued_payloads(&entry) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(queue = %queue.name, index, error = %e, "an entry with a quorum queue's bodies does not decode");
                continue;
            }
        };
        for &id in wanted {
            match payloads.get((id & 0xffff) as usize).filter(|r| r.end <= entry.len()) {
                // A copy: a slice would keep the whole entry (up to megabytes) in memory for as
                // long as the body is held, and the memory budget counts only the body.
                Some(r) => out.push((id, Bytes::copy_from_slice(&entry[r.clone()]))),
                None => tracing::error!(queue = %queue.name, msg_id = id, "a quorum queue's message is not in its entry"),
            }
        }
    }
    out
}

/// The read of `seqs` among the reads done, taken out of them.
fn take_read_done(reads: &mut Vec<ReadDone>, seqs: &std::ops::Range<MsgId>) -> Option<ReadDone> {
    reads.iter().position(|r| r.seqs == *seqs).map(|i| reads.swap_remove(i))
}

/// Holds bodies read back from the store, for messages still live and not held, while they fit in
/// the memory budget (`wanted`: held whatever the budget).
pub(super) fn take_bodies(st: &mut ReplicaState, bodies: Vec<(MsgId, MessageRef)>, wanted: &std::ops::RangeInclusive<MsgId>) {
    for (seq, message) in bodies {
        let mem = message.memory_bytes() as u64;
        let wanted = wanted.contains(&seq) || st.body_mem.fits_read_back(mem);
        let ReplicaState { bodies, body_mem, store_only, .. } = st;
        match bodies.get_mut(&seq) {
            Some(b) if wanted && !b.held() => {
                b.mem = mem;
                body_mem.add(mem);
                *store_only = store_only.saturating_sub(1);
                b.message = Some(message);
            }
            _ => {}
        }
    }
}
