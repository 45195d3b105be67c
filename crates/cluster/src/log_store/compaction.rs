//! When a group's log asks its Raft for a snapshot and a purge, by bytes and by quiet, on top of
//! openraft's own policy (a snapshot every 5,000 entries, 1,000 kept after it), which counts
//! entries only: an entry carries up to 4 MiB of messages, so 5,000 of them could keep gigabytes on
//! disk after every message in them was settled (a snapshot holds the queue's state without
//! bodies; a quorum queue writes the bodies of its live messages as its own store records before
//! it answers for a snapshot, `GroupMachine::snapshot`).
//!
//! - **Busy**: once [`SNAPSHOT_AFTER_BYTES`] were appended since the last snapshot, snapshot; then
//!   purge all but the last [`KEEP_BYTES`] up to the snapshot (a follower a little behind still
//!   gets entries, further behind it gets the snapshot).
//! - **Quiet**: no append for [`QUIET_AFTER`] and at least [`QUIET_MIN_BYTES`] appended since the
//!   snapshot: snapshot and purge everything up to it, so a drained queue gives its log back.
//! - **The node's budget**: while the unpurged entries of all groups on the node together pass
//!   [`NODE_LOG_BYTES`], the groups holding the most are snapshotted and purged as a quiet one is,
//!   largest first, until the rest is under three quarters of it
//!   ([`crate::RaftLogs::over_node_budget`]). The busy rule bounds one queue's log; this bounds a
//!   thousand busy queues', each of which would otherwise keep up to 64 MiB (64 GiB per node).
//!
//! A group that applied nothing since its snapshot is not asked again (a snapshot could not move);
//! a request not answered by a new snapshot is repeated after [`ASK_AGAIN_AFTER`].

use std::time::{Duration, Instant};

use super::GroupInner;

pub const SNAPSHOT_AFTER_BYTES: u64 = 64 << 20;
pub const KEEP_BYTES: u64 = 32 << 20;
pub const QUIET_AFTER: Duration = Duration::from_secs(5);
pub const QUIET_MIN_BYTES: u64 = 256 << 10;
pub const ASK_AGAIN_AFTER: Duration = Duration::from_secs(10);
pub const NODE_LOG_BYTES: u64 = 512 << 20;

/// What a group's Raft is asked to do now (see [`crate::RaftLogs::compaction`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Compaction {
    /// Build a snapshot (openraft's `trigger().snapshot()`).
    pub snapshot: bool,
    /// Purge the log up to this index (openraft's `trigger().purge_log()`).
    pub purge_upto: Option<u64>,
}

/// A group's bookkeeping for [`Compaction`].
#[derive(Debug)]
pub(crate) struct CompactionState {
    /// Entry bytes appended after the stored snapshot's last index (exact at a snapshot and at a
    /// start, then grown by appends and shrunk by truncations).
    pub since_snapshot: u64,
    /// Bytes of all the group's unpurged entries (what it keeps on disk).
    pub log_bytes: u64,
    pub last_append: Instant,
    /// When a snapshot was last asked for, and the snapshot index then.
    asked: Option<(Instant, Option<u64>)>,
    /// The snapshot index a purge was last asked up to (or computed for), and whether quiet.
    purged_for: Option<(u64, bool)>,
}

impl CompactionState {
    pub fn new() -> CompactionState {
        CompactionState { since_snapshot: 0, log_bytes: 0, last_append: Instant::now(), asked: None, purged_for: None }
    }
}

impl GroupInner {
    fn snapshot_index(&self) -> Option<u64> {
        self.snapshot.as_ref().and_then(|s| s.meta.last_log_id).map(|l| l.index)
    }

    /// Recomputes the bytes after the snapshot from the entries (after a snapshot, at a start).
    pub(crate) fn count_since_snapshot(&mut self) {
        let from = self.snapshot_index().map_or(0, |i| i + 1);
        let skip = from.saturating_sub(self.first_index) as usize;
        self.compaction.since_snapshot = self.slots.iter().skip(skip).map(|s| s.len).sum();
    }

    /// What to ask of the group's Raft now; `pressed`: the node's logs are over their budget and
    /// this group is among those to give theirs back (see [`crate::RaftLogs::over_node_budget`]).
    /// Remembers what it asked (a snapshot is not asked again before [`ASK_AGAIN_AFTER`], a purge
    /// not again for the same snapshot).
    pub(crate) fn compaction(&mut self, now: Instant, pressed: bool) -> Compaction {
        let (out, purge_for) = self.compaction_wanted(now, pressed);
        if out.snapshot {
            self.compaction.asked = Some((now, self.snapshot_index()));
        }
        if purge_for.is_some() {
            self.compaction.purged_for = purge_for;
        }
        out
    }

    /// Whether [`GroupInner::compaction`] would ask or remember anything now (it does not remember).
    pub(crate) fn wants_compaction(&self, now: Instant, pressed: bool) -> bool {
        let (out, purge_for) = self.compaction_wanted(now, pressed);
        out.snapshot || purge_for.is_some()
    }

    /// What [`GroupInner::compaction`] asks, and the (snapshot index, all) a purge is computed for.
    fn compaction_wanted(&self, now: Instant, pressed: bool) -> (Compaction, Option<(u64, bool)>) {
        let snapshot = self.snapshot_index();
        let quiet = now.duration_since(self.compaction.last_append) >= QUIET_AFTER;
        let c = &self.compaction;
        let applied_past_snapshot = self.applied_below > snapshot.map_or(0, |i| i + 1);
        let due = if pressed {
            c.since_snapshot > 0
        } else if quiet {
            c.since_snapshot >= QUIET_MIN_BYTES
        } else {
            c.since_snapshot >= SNAPSHOT_AFTER_BYTES
        };
        // Quiet or pressed: everything up to the snapshot goes.
        let all = quiet || pressed;
        let asked_recently = c.asked.is_some_and(|(at, s)| s == snapshot && now.duration_since(at) < ASK_AGAIN_AFTER);
        let mut out = Compaction { snapshot: due && applied_past_snapshot && !asked_recently, purge_upto: None };
        let mut purge_for = None;
        if let Some(s) = snapshot {
            let done = c.purged_for.is_some_and(|(i, a)| i == s && (a || !all));
            if !done {
                purge_for = Some((s, all));
                out.purge_upto = self.purge_point(s, if all { 0 } else { KEEP_BYTES });
            }
        }
        (out, purge_for)
    }

    /// Recomputes the bytes of the unpurged entries (at a start).
    pub(crate) fn count_log_bytes(&mut self) {
        self.compaction.log_bytes = self.slots.iter().map(|s| s.len).sum();
    }

    /// The index to purge up to so that about `keep` bytes of entries up to `snapshot` stay; None
    /// when nothing more would go.
    fn purge_point(&self, snapshot: u64, keep: u64) -> Option<u64> {
        let top = snapshot.min(self.next_index().checked_sub(1)?);
        let mut upto = top;
        let mut kept = 0;
        for slot in self.slots.range(..=top.checked_sub(self.first_index)? as usize).rev() {
            if kept + slot.len > keep {
                break;
            }
            kept += slot.len;
            upto = upto.checked_sub(1)?;
        }
        (upto >= self.first_index && self.hard.purged.is_none_or(|p| p.index < upto)).then_some(upto)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use openraft::vote::RaftLeaderId;
    use openraft::EntryPayload;
    use warren_store::{Store, StoreOptions};

    use super::*;
    use crate::codec::{LeaderId, SnapshotMeta};
    use crate::log_store::RaftLogs;
    use crate::types::{Command, Entry, LogId};

    const MIB: usize = 1 << 20;

    fn entries(from: u64, count: u64) -> Vec<Entry> {
        (from..from + count)
            .map(|i| Entry { log_id: LogId::new(LeaderId::new(1, 1), i), payload: EntryPayload::Normal(Command(Bytes::from(vec![0u8; MIB]))) })
            .collect()
    }

    /// `compaction`, checking first that `wants_compaction` (what `RaftLogs::wanting_compaction`
    /// asks, to pass over the groups that want nothing) agrees: it wants something exactly when
    /// `compaction` then asks for something or remembers something new.
    fn ask(g: &mut GroupInner, now: Instant, pressed: bool) -> Compaction {
        let wants = g.wants_compaction(now, pressed);
        let before = (g.compaction.asked, g.compaction.purged_for);
        let out = g.compaction(now, pressed);
        let acted = out != Compaction::default() || (g.compaction.asked, g.compaction.purged_for) != before;
        assert_eq!(wants, acted, "wants_compaction said {wants}, compaction answered {out:?} (pressed: {pressed})");
        out
    }

    fn meta(index: u64) -> SnapshotMeta {
        SnapshotMeta { last_log_id: Some(LogId::new(LeaderId::new(1, 1), index)), last_membership: Default::default() }
    }

    /// Busy: a snapshot once 64 MiB were appended since the last one (asked once, not at every
    /// look), then a purge that keeps 32 MiB before it. Quiet: a snapshot of what is left, and a
    /// purge of everything up to it.
    #[test]
    fn a_log_asks_for_snapshots_by_bytes_and_when_quiet_and_purges_what_they_cover() {
        let dir = tempfile::tempdir().unwrap();
        let (store, recovery) = Store::open(dir.path(), StoreOptions::default()).unwrap();
        let logs = RaftLogs::open(store.clone(), &recovery.queues).unwrap();
        let g = logs.group(7).unwrap();
        let mut g = g.inner.lock();
        let (lq, sq) = (RAFT_LOG_OF_7, RAFT_STATE_OF_7);
        let t0 = Instant::now();
        g.append(&store, lq, sq, 256, entries(0, 60)).unwrap();
        g.applied_below = 60;
        assert_eq!(ask(&mut g, t0, false), Compaction::default(), "60 MiB: not yet");
        g.append(&store, lq, sq, 256, entries(60, 10)).unwrap();
        let t1 = Instant::now();
        g.save_snapshot(&store, sq, &meta(59), b"state").unwrap();
        g.compaction.since_snapshot += 64 << 20; // as if the snapshot were older
        assert!(!ask(&mut g, t1, false).snapshot, "nothing applied since the snapshot: a new one could not cover more");
        g.applied_below = 70;
        assert_eq!(ask(&mut g, t1, false), Compaction { snapshot: true, purge_upto: None });
        assert_eq!(ask(&mut g, t1, false), Compaction::default(), "asked already");

        g.save_snapshot(&store, sq, &meta(65), b"state").unwrap();
        assert_eq!(g.compaction.since_snapshot, 4 * (MIB as u64 + g.slots[0].len - MIB as u64));
        let kept = KEEP_BYTES / g.slots[0].len; // whole entries within 32 MiB
        assert_eq!(ask(&mut g, t1, false), Compaction { snapshot: false, purge_upto: Some(65 - kept) });
        assert_eq!(ask(&mut g, t1, false), Compaction::default(), "asked already");

        let later = g.compaction.last_append + QUIET_AFTER + Duration::from_millis(1);
        assert_eq!(ask(&mut g, later, false), Compaction { snapshot: true, purge_upto: Some(65) }, "quiet: all it covers goes");
        g.purge(&store, lq, sq, LogId::new(LeaderId::new(1, 1), 65)).unwrap();
        g.save_snapshot(&store, sq, &meta(69), b"state").unwrap();
        assert_eq!(ask(&mut g, later, false), Compaction { snapshot: false, purge_upto: Some(69) });
        g.purge(&store, lq, sq, LogId::new(LeaderId::new(1, 1), 69)).unwrap();
        assert_eq!(ask(&mut g, later + ASK_AGAIN_AFTER, false), Compaction::default(), "nothing left to snapshot or purge");
    }

    /// Over the node's budget, the groups keeping the most are pressed until the rest keep under
    /// three quarters of it; a pressed group snapshots whatever it has and purges all of it, though
    /// neither busy nor quiet.
    #[test]
    fn over_the_node_budget_the_largest_logs_go_first_and_all_of_them() {
        let dir = tempfile::tempdir().unwrap();
        let (store, recovery) = Store::open(dir.path(), StoreOptions::default()).unwrap();
        let logs = RaftLogs::open(store.clone(), &recovery.queues).unwrap();
        for (id, count) in [(1, 2), (2, 10), (3, 6), (4, 4)] {
            let g = logs.group(id).unwrap();
            let mut g = g.inner.lock();
            g.append(&store, crate::log_store::RAFT_LOG | id, crate::log_store::RAFT_STATE | id, 256, entries(0, count)).unwrap();
            g.applied_below = count;
        }
        let entry = logs.group(1).unwrap().inner.lock().slots[0].len;
        assert_eq!(logs.over_budget(22 * entry), Vec::<u64>::new(), "22 entries kept: within a budget of 22");
        // Over 20: down to under 15, the largest first.
        assert_eq!(logs.over_budget(20 * entry), vec![2]);
        assert_eq!(logs.over_budget(12 * entry), vec![2, 3]);

        let g = logs.group(3).unwrap();
        let mut g = g.inner.lock();
        let t = Instant::now();
        assert_eq!(ask(&mut g, t, false), Compaction::default(), "6 MiB, busy: nothing of its own");
        assert_eq!(ask(&mut g, t, true), Compaction { snapshot: true, purge_upto: None });
        g.save_snapshot(&store, crate::log_store::RAFT_STATE | 3, &meta(5), b"state").unwrap();
        assert_eq!(ask(&mut g, t, true), Compaction { snapshot: false, purge_upto: Some(5) }, "all it covers goes");
        g.purge(&store, crate::log_store::RAFT_LOG | 3, crate::log_store::RAFT_STATE | 3, LogId::new(LeaderId::new(1, 1), 5)).unwrap();
        assert_eq!(g.compaction.log_bytes, 0);
        drop(g);
        assert_eq!(logs.over_budget(12 * entry), vec![2], "the purged log counts no more");
    }

    const RAFT_LOG_OF_7: u64 = crate::log_store::RAFT_LOG | 7;
    const RAFT_STATE_OF_7: u64 = crate::log_store::RAFT_STATE | 7;
}
