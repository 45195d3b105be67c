//! The quorum queue's snapshot: the whole machine state without message bodies (the bodies stay
//! in the node's store under their msg ids). Ready messages are stored as the runs and sparse
//! per-message state they are kept as in memory, so a snapshot is as compact as the state.
//!
//! Layout (version 1; varints, "opt" = 0 none / n + 1): config (max_length opt, max_length_bytes
//! opt, overflow u8, delivery_limit opt, message_ttl opt, dead_letter u8, sac u8, expires opt),
//! last_index opt, now_ms, last_used opt, expired_reported u8, counters (8), sessions (count,
//! node, channel, seq, last_ms), next session sweep ms, consumers (count; id, priority zigzag, prefetch, auto_ack u8, credit,
//! status u8, checkouts (count; id, state)), groups (count; priority zigzag, members (count; id),
//! next), sac_active opt id, exclusive opt id, returned (count; id, state), fresh runs (count;
//! first, count, per_entry u8, expires opt), sizes (count; size). A message state is delivery_count, acquired,
//! size, expires opt.
//! Version 2 (quorum queue priorities, at-least-once dead-lettering): the config has
//! at_least_once u8 after dead_letter; a message state also has high u8; after the ready messages
//! above (the normal lane) come high_streak u8 and the high lane, laid out as the normal one, then
//! the dead letters waiting for their target (count; id, reason u8, state). Version 1 snapshots
//! still decode (everything normal, at-most-once).
//! Version 3 (delayed messages): then, per lane (normal, high), the fired messages (count; key,
//! id, state), then the delayed messages not due (count; id, due, size, ttl opt, high u8).
//! Version 4 (retention): the config ends with retention_ms opt; then the normal lane's rewound
//! messages (count; first, count, per_entry u8, expires opt), the kept consumed messages (count;
//! first, count, per_entry u8), the clock's samples (count; id, ms) and the retention floor.
//! Versions 1 to 3 still decode (none of either). Decoding checks the references between parts: a bad snapshot is an error,
//! never a panic or an inconsistent machine.

use super::codec::{err, put_bool, put_opt, put_var, put_zigzag, DecodeError, Reader};
use super::command::{ConsumerId, MsgId, SessionId};
use super::machine::{Consumer, Counters, Group, Held, Overflow, QueueConfig, QuorumMachine, Reason, Session, Status};
use super::ready::{Fired, Lane, MsgState, Ready, Run, NEVER};
use super::retained::{IdSet, Retained};
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::{BTreeMap, VecDeque};

pub const SNAPSHOT_VERSION: u8 = 4;

fn put_id(out: &mut BytesMut, c: ConsumerId) {
    put_var(out, c.node);
    put_var(out, c.local);
}

fn put_expiry(out: &mut BytesMut, expires_at: u64) {
    put_opt(out, (expires_at != NEVER).then_some(expires_at));
}

fn put_state(out: &mut BytesMut, st: &MsgState) {
    put_var(out, st.delivery_count as u64);
    put_var(out, st.acquired as u64);
    put_var(out, st.size as u64);
    put_expiry(out, st.expires_at);
    put_bool(out, st.high);
}

fn put_lane(out: &mut BytesMut, lane: &Lane) {
    put_var(out, lane.returned.len() as u64);
    for (msg, st) in &lane.returned {
        put_var(out, *msg);
        put_state(out, st);
    }
    put_var(out, lane.fresh.len() as u64);
    for run in &lane.fresh {
        put_var(out, run.first);
        put_var(out, run.count as u64);
        put_bool(out, run.per_entry);
        put_expiry(out, run.expires_at);
    }
    put_var(out, lane.sizes.len() as u64);
    for s in &lane.sizes {
        put_var(out, *s as u64);
    }
}

pub fn encode(m: &QuorumMachine) -> Bytes {
    let mut out = BytesMut::with_capacity(256);
    out.put_u8(SNAPSHOT_VERSION);
    let c = &m.config;
    put_opt(&mut out, c.max_length);
    put_opt(&mut out, c.max_length_bytes);
    out.put_u8(match c.overflow {
        Overflow::DropHead => 0,
        Overflow::RejectPublish => 1,
    });
    put_opt(&mut out, c.delivery_limit.map(u64::from));
    put_opt(&mut out, c.message_ttl_ms);
    put_bool(&mut out, c.dead_letter);
    put_bool(&mut out, c.at_least_once);
    put_bool(&mut out, c.single_active_consumer);
    put_opt(&mut out, c.expires_ms);
    put_opt(&mut out, c.retention_ms);

    put_opt(&mut out, m.last_index);
    put_var(&mut out, m.now_ms);
    put_opt(&mut out, m.last_used_ms);
    put_bool(&mut out, m.expired_reported);
    let k = &m.counters;
    for v in [k.enqueued, k.duplicates, k.rejected, k.delivered, k.acked, k.returned, k.dead_lettered, k.dropped] {
        put_var(&mut out, v);
    }

    put_var(&mut out, m.sessions.len() as u64);
    for (s, state) in &m.sessions {
        put_var(&mut out, s.node);
        put_var(&mut out, s.channel);
        put_var(&mut out, state.seq);
        put_var(&mut out, state.last_ms);
    }
    put_var(&mut out, m.next_session_sweep_ms);

    put_var(&mut out, m.consumers.len() as u64);
    for (id, c) in &m.consumers {
        put_id(&mut out, *id);
        put_zigzag(&mut out, c.priority as i64);
        put_var(&mut out, c.prefetch as u64);
        put_bool(&mut out, c.auto_ack);
        put_var(&mut out, c.credit as u64);
        out.put_u8(match c.status {
            Status::Active => 0,
            Status::Cancelled => 1,
            Status::Getter => 2,
        });
        put_var(&mut out, c.checked_out.len() as u64);
        for (msg, st) in &c.checked_out {
            put_var(&mut out, *msg);
            put_state(&mut out, st);
        }
    }

    put_var(&mut out, m.groups.len() as u64);
    for g in &m.groups {
        put_zigzag(&mut out, g.priority as i64);
        put_var(&mut out, g.members.len() as u64);
        for id in &g.members {
            put_id(&mut out, *id);
        }
        put_var(&mut out, g.next as u64);
    }
    for holder in [m.sac_active, m.exclusive] {
        put_bool(&mut out, holder.is_some());
        if let Some(id) = holder {
            put_id(&mut out, id);
        }
    }

    put_lane(&mut out, &m.ready.normal);
    out.put_u8(m.ready.high_streak);
    put_lane(&mut out, &m.ready.high);
    put_var(&mut out, m.dlx.len() as u64);
    for (msg, (reason, st)) in &m.dlx {
        put_var(&mut out, *msg);
        out.put_u8(reason_code(*reason));
        put_state(&mut out, st);
    }
    for lane in [&m.ready.normal, &m.ready.high] {
        put_var(&mut out, lane.fired.len() as u64);
        for f in &lane.fired {
            put_var(&mut out, f.key);
            put_var(&mut out, f.id);
            put_state(&mut out, &f.state);
        }
    }
    put_var(&mut out, m.delayed.len() as u64);
    for (id, held) in &m.delayed {
        put_var(&mut out, *id);
        put_var(&mut out, held.due_ms);
        put_var(&mut out, held.size as u64);
        put_opt(&mut out, held.ttl_ms);
        put_bool(&mut out, held.high);
    }
    put_runs(&mut out, m.ready.normal.rewound.runs(), true);
    put_runs(&mut out, m.retained.kept.runs(), false);
    put_var(&mut out, m.retained.samples.len() as u64);
    for (id, ms) in &m.retained.samples {
        put_var(&mut out, *id);
        put_var(&mut out, *ms);
    }
    put_var(&mut out, m.retained.floor);
    out.freeze()
}

fn put_runs<'a>(out: &mut BytesMut, runs: impl ExactSizeIterator<Item = &'a Run>, with_expiry: bool) {
    put_var(out, runs.len() as u64);
    for run in runs {
        put_var(out, run.first);
        put_var(out, run.count as u64);
        put_bool(out, run.per_entry);
        if with_expiry {
            put_expiry(out, run.expires_at);
        }
    }
}

/// Runs of ids as `put_runs` wrote them: None if out of order, overlapping or empty.
fn id_set(r: &mut Reader, with_expiry: bool) -> Result<IdSet, DecodeError> {
    let n = r.count(3)?;
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        let first = r.var()?;
        let count = r.var_u32()?;
        let per_entry = r.bool()?;
        let expires_at = if with_expiry { expiry(r)? } else { NEVER };
        runs.push(Run { first, count, per_entry, expires_at });
    }
    IdSet::from_runs(runs).map_or_else(|| err("runs of ids out of order, overlapping or empty"), Ok)
}

fn id(r: &mut Reader) -> Result<ConsumerId, DecodeError> {
    Ok(ConsumerId { node: r.var()?, local: r.var()? })
}

fn expiry(r: &mut Reader) -> Result<u64, DecodeError> {
    match r.opt()? {
        None => Ok(NEVER),
        Some(NEVER) => err("expiry out of range"),
        Some(t) => Ok(t),
    }
}

fn state(r: &mut Reader, version: u8) -> Result<MsgState, DecodeError> {
    let (delivery_count, acquired, size, expires_at) = (r.var_u32()?, r.var_u32()?, r.var_u32()?, expiry(r)?);
    let high = version >= 2 && r.bool()?;
    Ok(MsgState { delivery_count, acquired, size, expires_at, high })
}

fn reason_code(reason: Reason) -> u8 {
    match reason {
        Reason::Rejected => 0,
        Reason::Expired => 1,
        Reason::MaxLen => 2,
        Reason::DeliveryLimit => 3,
        Reason::Purged => 4,
    }
}

fn reason(r: &mut Reader) -> Result<Reason, DecodeError> {
    Ok(match r.u8()? {
        0 => Reason::Rejected,
        1 => Reason::Expired,
        2 => Reason::MaxLen,
        3 => Reason::DeliveryLimit,
        c => return err(format!("unknown dead-letter reason {c}")),
    })
}

fn priority(r: &mut Reader) -> Result<i32, DecodeError> {
    i32::try_from(r.zigzag()?).or_else(|_| err("priority exceeds 32 bits"))
}

pub fn decode(bytes: &[u8]) -> Result<QuorumMachine, DecodeError> {
    let mut r = Reader::new(bytes);
    let version = r.u8()?;
    if !(1..=SNAPSHOT_VERSION).contains(&version) {
        return err(format!("unknown snapshot version {version}"));
    }
    let config = QueueConfig {
        max_length: r.opt()?,
        max_length_bytes: r.opt()?,
        overflow: match r.u8()? {
            0 => Overflow::DropHead,
            1 => Overflow::RejectPublish,
            o => return err(format!("unknown overflow {o}")),
        },
        delivery_limit: match r.opt()? {
            None => None,
            Some(l) => Some(u32::try_from(l).or_else(|_| err("delivery limit exceeds 32 bits"))?),
        },
        message_ttl_ms: r.opt()?,
        dead_letter: r.bool()?,
        at_least_once: version >= 2 && r.bool()?,
        single_active_consumer: r.bool()?,
        expires_ms: r.opt()?,
        retention_ms: if version >= 4 { r.opt()? } else { None },
    };
    let mut m = QuorumMachine::new(config);
    m.last_index = r.opt()?;
    m.now_ms = r.var()?;
    m.last_used_ms = r.opt()?;
    m.expired_reported = r.bool()?;
    m.counters = Counters {
        enqueued: r.var()?,
        duplicates: r.var()?,
        rejected: r.var()?,
        delivered: r.var()?,
        acked: r.var()?,
        returned: r.var()?,
        dead_lettered: r.var()?,
        dropped: r.var()?,
    };

    let n = r.count(4)?;
    for _ in 0..n {
        let s = SessionId { node: r.var()?, channel: r.var()? };
        let state = Session { seq: r.var()?, last_ms: r.var()? };
        if m.sessions.insert(s, state).is_some() {
            return err("duplicate session");
        }
    }
    m.next_session_sweep_ms = r.var()?;

    // Every message appears once: checked out by one consumer, or ready.
    let mut seen: BTreeMap<MsgId, ()> = BTreeMap::new();
    let n = r.count(9)?;
    for _ in 0..n {
        let cid = id(&mut r)?;
        let priority = priority(&mut r)?;
        let prefetch = r.var_u32()?;
        let auto_ack = r.bool()?;
        let credit = r.var_u32()?;
        let status = match r.u8()? {
            0 => Status::Active,
            1 => Status::Cancelled,
            2 => Status::Getter,
            s => return err(format!("unknown consumer status {s}")),
        };
        let k = r.count(5)?;
        let mut checked_out = BTreeMap::new();
        for _ in 0..k {
            let msg = r.var()?;
            let st = state(&mut r, version)?;
            if seen.insert(msg, ()).is_some() || checked_out.insert(msg, st).is_some() {
                return err("message checked out twice");
            }
        }
        m.checked_out += checked_out.len() as u64;
        if m.consumers.insert(cid, Consumer { priority, prefetch, auto_ack, credit, status, checked_out }).is_some() {
            return err("duplicate consumer");
        }
    }

    let n = r.count(3)?;
    let mut grouped = 0usize;
    for _ in 0..n {
        let priority = priority(&mut r)?;
        let k = r.count(2)?;
        let mut members = Vec::with_capacity(k);
        for _ in 0..k {
            let cid = id(&mut r)?;
            match m.consumers.get(&cid) {
                Some(c) if c.status == Status::Active && c.priority == priority && !members.contains(&cid) => members.push(cid),
                _ => return err("group member is not an active consumer of its priority"),
            }
        }
        let next = r.var()? as usize;
        if members.is_empty() || next >= members.len() {
            return err("bad consumer group");
        }
        if m.groups.last().is_some_and(|g: &Group| g.priority <= priority) {
            return err("consumer groups out of order");
        }
        grouped += members.len();
        m.groups.push(Group { priority, members, next });
    }
    if grouped != m.consumer_count() {
        return err("active consumers missing from their groups");
    }
    let holder = |r: &mut Reader, m: &QuorumMachine| -> Result<Option<ConsumerId>, DecodeError> {
        if !r.bool()? {
            return Ok(None);
        }
        let cid = id(r)?;
        match m.consumers.get(&cid) {
            Some(c) if c.status == Status::Active => Ok(Some(cid)),
            _ => err("single-active or exclusive consumer is not an active consumer"),
        }
    };
    m.sac_active = holder(&mut r, &m)?;
    m.exclusive = holder(&mut r, &m)?;
    let sac_ok = match m.config.single_active_consumer {
        true => m.sac_active.is_some() == (m.consumer_count() > 0),
        false => m.sac_active.is_none(),
    };
    if !sac_ok {
        return err("single active consumer missing, or set on a queue without it");
    }

    let track_sizes = m.config.max_length_bytes.is_some();
    let mut normal = decode_lane(&mut r, version, false, track_sizes, &mut seen)?;
    let (high_streak, mut high) = if version >= 2 {
        (r.u8()?, decode_lane(&mut r, version, true, track_sizes, &mut seen)?)
    } else {
        (0, Lane::new(track_sizes))
    };
    if version >= 2 {
        let n = r.count(6)?;
        for _ in 0..n {
            let msg = r.var()?;
            let why = reason(&mut r)?;
            let st = state(&mut r, version)?;
            if seen.insert(msg, ()).is_some() || m.dlx.insert(msg, (why, st)).is_some() {
                return err("a dead letter also ready, checked out or repeated");
            }
            if !track_sizes && st.size != 0 {
                return err("sizes on a queue that does not count them");
            }
            m.dlx_bytes = m.dlx_bytes.saturating_add(st.size as u64);
        }
        if !m.dlx.is_empty() && !(m.config.at_least_once && m.config.dead_letter) {
            return err("dead letters waiting on a queue without at-least-once dead-lettering");
        }
    }
    if version >= 3 {
        for (lane, is_high) in [(&mut normal, false), (&mut high, true)] {
            let n = r.count(5)?;
            let mut fired = VecDeque::with_capacity(n);
            for _ in 0..n {
                let key = r.var()?;
                let msg = r.var()?;
                let st = state(&mut r, version)?;
                if st.high != is_high || (!track_sizes && st.size != 0) {
                    return err("a fired message in the other priority lane, or sized on a queue that does not count sizes");
                }
                if fired.back().is_some_and(|f: &Fired| f.key > key) {
                    return err("fired messages out of order");
                }
                if seen.insert(msg, ()).is_some() {
                    return err("a fired message also ready, checked out or repeated");
                }
                fired.push_back(Fired { key, id: msg, state: st });
            }
            if !fired.is_empty() {
                let parts = std::mem::take(lane);
                *lane = Lane::from_parts(track_sizes, parts.returned, parts.fresh, parts.sizes, fired, IdSet::default());
            }
        }
        let n = r.count(5)?;
        for _ in 0..n {
            let msg = r.var()?;
            let held = Held { due_ms: r.var()?, size: r.var_u32()?, ttl_ms: r.opt()?, high: r.bool()? };
            if held.due_ms >= NEVER || seen.insert(msg, ()).is_some() || m.delayed.insert(msg, held).is_some() {
                return err("a delayed message also ready, checked out or repeated, or due never");
            }
            m.timer.insert((held.due_ms, msg));
        }
    }
    if !track_sizes && m.consumers.values().flat_map(|c| c.checked_out.values()).any(|s| s.size != 0) {
        return err("sizes on a queue that does not count them");
    }
    if version >= 4 {
        let rewound = id_set(&mut r, true)?;
        let kept = id_set(&mut r, false)?;
        let n = r.count(2)?;
        let mut samples = VecDeque::with_capacity(n);
        for _ in 0..n {
            let sample = (r.var()?, r.var()?);
            if samples.back().is_some_and(|&(id, ms)| sample.0 <= id || sample.1 < ms) {
                return err("retention samples out of order");
            }
            samples.push_back(sample);
        }
        let floor = r.var()?;
        let retention = m.config.retention_ms.is_some();
        if !retention && !(rewound.is_empty() && kept.is_empty() && samples.is_empty() && floor == 0) {
            return err("rewound or kept messages on a queue without retention");
        }
        if kept.first().is_some_and(|(id, _)| id < floor) || samples.front().is_some_and(|&(id, _)| id < floor) {
            return err("kept messages or samples below the retention floor");
        }
        // Rewound and kept messages are neither live elsewhere nor each other.
        if seen.keys().any(|&id| rewound.contains(id) || kept.contains(id)) {
            return err("a rewound or kept message is also checked out, returned, fired, delayed or a dead letter");
        }
        let (rewound_runs, kept_runs): (Vec<Run>, Vec<Run>) = (rewound.runs().copied().collect(), kept.runs().copied().collect());
        for fresh in [&normal.fresh, &high.fresh] {
            let fresh: Vec<Run> = fresh.iter().copied().collect();
            if runs_share_an_id(&fresh, &rewound_runs) || runs_share_an_id(&fresh, &kept_runs) {
                return err("a fresh message is also rewound or kept");
            }
        }
        if runs_share_an_id(&rewound_runs, &kept_runs) {
            return err("a message both rewound and kept");
        }
        let id_limit = m.last_index.map_or(0u128, |l| (l as u128 + 1) << 16);
        let highest = [rewound_runs.last().map(Run::last), kept_runs.last().map(Run::last), samples.back().map(|s| s.0)].into_iter().flatten().max();
        if highest.is_some_and(|h| h as u128 >= id_limit) || floor as u128 > id_limit {
            return err("rewound or kept ids above the last applied index");
        }
        if !rewound.is_empty() {
            let parts = std::mem::take(&mut normal);
            normal = Lane::from_parts(track_sizes, parts.returned, parts.fresh, parts.sizes, parts.fired, rewound);
        }
        m.retained = Retained { kept, samples, floor };
    }
    // Every id was enqueued by an entry already applied, so ids keep rising after the restore.
    let id_limit = m.last_index.map_or(0u128, |l| (l as u128 + 1) << 16);
    let highest = [seen.keys().next_back().copied(), normal.fresh.back().map(Run::last), high.fresh.back().map(Run::last)].into_iter().flatten().max();
    if highest.is_some_and(|h| h as u128 >= id_limit) {
        return err("message ids above the last applied index");
    }
    // Every message appears once: no id met so far (checked out, returned, fired, delayed, a dead
    // letter) is also fresh in either lane, and the lanes' fresh runs share no id.
    if seen.keys().any(|&id| normal.in_fresh(id) || high.in_fresh(id)) {
        return err("a fresh message is also checked out, returned, fired, delayed or a dead letter");
    }
    if runs_share_an_id(&normal.fresh.iter().copied().collect::<Vec<_>>(), &high.fresh.iter().copied().collect::<Vec<_>>()) {
        return err("a fresh message in both priority lanes");
    }
    r.end()?;
    m.ready = Ready { normal, high, high_streak };
    Ok(m)
}

/// Whether two lanes' fresh runs (each in id order, their spans disjoint) have an id in common.
fn runs_share_an_id(a: &[Run], b: &[Run]) -> bool {
    let (mut i, mut j) = (0, 0);
    while let (Some(x), Some(y)) = (a.get(i), b.get(j)) {
        if x.last() >= y.first && y.last() >= x.first && runs_intersect(x, y) {
            return true;
        }
        // The run that ends first meets nothing more of the other lane.
        if x.last() < y.last() {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}

/// Whether two runs (step 1 or 2^16) have an id in common.
fn runs_intersect(x: &Run, y: &Run) -> bool {
    if x.step() == 1 || y.step() == 1 {
        // The other run's first id at or above the step-1 run's first, within its span.
        let (dense, other) = if x.step() == 1 { (x, y) } else { (y, x) };
        let k = dense.first.saturating_sub(other.first).div_ceil(other.step());
        return k < other.count as u64 && other.first + k * other.step() <= dense.last();
    }
    // Both step 2^16: the same offset within 2^16, and overlapping spans.
    x.first % (1 << 16) == y.first % (1 << 16) && x.first.max(y.first) <= x.last().min(y.last())
}

/// One lane of ready messages (`high`: the high-priority one). `seen`: the ids met so far
/// (checked out, or ready in the lane before).
fn decode_lane(r: &mut Reader, version: u8, high: bool, track_sizes: bool, seen: &mut BTreeMap<MsgId, ()>) -> Result<Lane, DecodeError> {
    let n = r.count(5)?;
    let mut returned = BTreeMap::new();
    for _ in 0..n {
        let msg = r.var()?;
        let st = state(r, version)?;
        if st.high != high {
            return err("a ready message in the other priority lane");
        }
        if seen.insert(msg, ()).is_some() || returned.insert(msg, st).is_some() {
            return err("ready message also checked out or repeated");
        }
    }
    let n = r.count(3)?;
    let mut fresh = VecDeque::with_capacity(n);
    let mut fresh_count = 0u64;
    // Returned ids are usually below the fresh ones (each was the head once), but not always: a
    // rewound message, or a delayed one dropped as it came due, may come back above some. Only
    // the fresh runs' own order is checked here; an id both fresh and elsewhere is refused below.
    let mut floor: Option<MsgId> = None;
    for _ in 0..n {
        let first = r.var()?;
        let count = r.var_u32()?;
        let per_entry = r.bool()?;
        let expires_at = expiry(r)?;
        let run = Run { first, count, per_entry, expires_at };
        if count == 0 || floor.is_some_and(|f| first <= f) || run.end() > u64::MAX as u128 {
            return err("fresh runs out of order");
        }
        floor = Some(run.last());
        fresh_count += count as u64;
        fresh.push_back(run);
    }
    let n = r.count(1)?;
    let mut sizes = VecDeque::with_capacity(n);
    for _ in 0..n {
        sizes.push_back(r.var_u32()?);
    }
    if (track_sizes && sizes.len() as u64 != fresh_count) || (!track_sizes && !sizes.is_empty()) {
        return err("fresh sizes do not match the fresh messages");
    }
    if !track_sizes && returned.values().any(|s| s.size != 0) {
        return err("sizes on a queue that does not count them");
    }
    Ok(Lane::from_parts(track_sizes, returned, fresh, sizes, VecDeque::new(), IdSet::default()))
}
