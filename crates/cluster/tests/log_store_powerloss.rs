//! Power loss under the Raft log store, with the store's simulator (`warren_store::sim`): what an
//! append's `IOFlushed` or a returned `save_vote` promised survives; what was not promised may vanish,
//! but the recovered log never has a hole or a torn entry, and it goes on accepting appends.
//!
//! About 1-6 s in release mode (100 power cuts; the simulator makes no real fsync).

mod log_store_common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use log_store_common::*;
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::type_config::TypeConfigExt;
use openraft::RaftLogReader;
use warren_cluster::log_store::{LogStore, LogsOptions, RaftLogs};
use warren_cluster::types::{Entry, LogId, TypeConfig, Vote};
use warren_store::sim::{Fault, Loss, SimDisk};
use warren_store::{Disk, Store, StoreOptions};

fn sim_opts() -> StoreOptions {
    // Small segments and checkpoints: rolls, copies into queue files and WAL deletion all happen.
    StoreOptions { segment_size: 64 << 10, queue_segment_size: 16 << 10, checkpoint_bytes: 48 << 10, checkpoint_idle_ms: 3_600_000, active_segment_idle_ms: 0, ..StoreOptions::default() }
}

fn open_sim(sim: &Arc<SimDisk>, dir: &Path) -> Option<(Store, Arc<RaftLogs>)> {
    open_sim_with(sim, dir, LogsOptions::default())
}

/// `layout_every` small: layout records in most appends, so a power cut lands around them.
fn open_sim_with(sim: &Arc<SimDisk>, dir: &Path, options: LogsOptions) -> Option<(Store, Arc<RaftLogs>)> {
    let (store, recovery) = Store::open_on(dir, sim_opts(), Disk::simulated(sim.clone())).ok()?;
    let logs = RaftLogs::open_with(store.clone(), &recovery.queues, options).unwrap();
    Some((store, logs))
}

/// A normal entry with a payload of about 1-3 KiB naming its group, index and term.
fn big(group: u64, term: u64, index: u64) -> Entry {
    let mut e = normal(group, term, index);
    if let openraft::EntryPayload::Normal(c) = &mut e.payload {
        let mut v = c.0.to_vec();
        v.resize(1024 + (index as usize * 97) % 2048, b'x');
        c.0 = v.into();
    }
    e
}

/// The openraft #2118 case: `become_leader` marks the log flushed without I/O, relying on the vote
/// being saved after the entries. One ordered WAL makes a durable vote cover the appends before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_vote_makes_the_appends_before_it_durable() {
    for loss in [Loss::Unsynced, Loss::Torn { seed: 7 }] {
        let root = tempfile::tempdir().unwrap();
        let sim = SimDisk::new(root.path()).unwrap();
        let dir = root.path().join("store");
        let entries: Vec<Entry> = (0..30).map(|i| big(1, 1, i)).collect();
        {
            let (store, logs) = open_sim(&sim, &dir).unwrap();
            let mut ls = logs.log_store(1).unwrap();
            let mut other = logs.log_store(2).unwrap();
            for chunk in entries.chunks(3) {
                // Nobody waits for these: no IOFlushed was delivered.
                ls.append(chunk.to_vec(), IOFlushed::noop()).await.unwrap();
            }
            other.append(vec![big(2, 1, 0)], IOFlushed::noop()).await.unwrap();
            ls.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
            sim.cut_power();
            drop((ls, other, logs));
            store.close().unwrap();
        }
        sim.power_loss(loss).unwrap();
        let (_store, logs) = open_sim(&sim, &dir).unwrap();
        let mut ls = logs.log_store(1).unwrap();
        assert_eq!(ls.read_vote().await.unwrap(), Some(Vote::new_committed(2, 1)));
        assert_eq!(all_entries(&mut ls).await, entries, "{loss:?}: every append before the vote");
        let mut other = logs.log_store(2).unwrap();
        assert_eq!(all_entries(&mut other).await, vec![big(2, 1, 0)], "{loss:?}: another group's too");
    }
}

/// What the workload knows is durable, and everything it ever appended.
#[derive(Default)]
struct Model {
    /// Per group: index -> entry whose IOFlushed fired (or that a later durable record covers),
    /// minus what a durable truncation removed.
    durable: BTreeMap<u64, BTreeMap<u64, Entry>>,
    /// Per group: every entry appended (by index and term).
    appended: BTreeMap<(u64, u64, u64), Entry>,
    /// Per group: entries appended since the last durable point.
    pending: BTreeMap<u64, Vec<Entry>>,
    /// Per group: the truncation point not yet known durable.
    pending_truncation: BTreeMap<u64, u64>,
    votes: BTreeMap<u64, Vote>,
    /// Per group: the entries pinned (as a state machine holding bodies in them would) and not unpinned.
    pinned: BTreeMap<u64, BTreeSet<u64>>,
}

impl Model {
    /// Everything appended so far became durable (a later record of any group was).
    fn all_durable(&mut self) {
        for (g, keep_below) in std::mem::take(&mut self.pending_truncation) {
            self.durable.entry(g).or_default().retain(|i, _| *i < keep_below);
        }
        for (g, entries) in std::mem::take(&mut self.pending) {
            let d = self.durable.entry(g).or_default();
            for e in entries {
                d.retain(|i, _| *i < e.log_id.index);
                d.insert(e.log_id.index, e);
            }
        }
    }
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Runs `f` to its end, or returns `None` once the power is off (then nothing more becomes durable:
/// a wait for durability would never end).
async fn until_power_off<T>(sim: &SimDisk, f: impl std::future::Future<Output = T>) -> Option<T> {
    let mut f = std::pin::pin!(f);
    loop {
        tokio::select! {
            r = &mut f => return Some(r),
            _ = tokio::time::sleep(Duration::from_millis(2)) => if sim.is_powered_off() { return None },
        }
    }
}

/// Two groups appended to in turn, some appends waited for, some not; new terms truncate the
/// unwaited tail and append again; votes; purges. Stops when the power goes.
async fn workload(sim: &Arc<SimDisk>, logs: &RaftLogs, seed: u64, m: &mut Model) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut stores: Vec<LogStore> = (1..=2).map(|g| logs.log_store(g).unwrap()).collect();
    let mut next = [0u64; 2];
    let mut term = [1u64; 2];
    let mut purged_next = [0u64; 2];
    for _ in 0..60 {
        if sim.is_powered_off() {
            return;
        }
        let k = rng.below(2) as usize;
        let g = k as u64 + 1;
        let ls = &mut stores[k];
        match rng.below(10) {
            0 if next[k] > purged_next[k] + 3 => {
                // A new leader replaces the last entries (never pinned ones: a machine pins
                // entries it applied, which are committed).
                let keep = next[k] - 1 - rng.below(2);
                if m.pinned.get(&g).and_then(|p| p.last()).is_some_and(|&p| p >= keep) {
                    continue;
                }
                term[k] += 1;
                if ls.truncate_after(Some(log_id(term[k] - 1, 1, keep - 1))).await.is_err() {
                    return;
                }
                m.pending_truncation.insert(g, keep);
                m.pending.entry(g).or_default().retain(|e| e.log_id.index < keep);
                next[k] = keep;
            }
            1 => {
                let vote = Vote::new(term[k], 1);
                if !matches!(until_power_off(sim, ls.save_vote(&vote)).await, Some(Ok(()))) {
                    return;
                }
                m.all_durable();
                m.votes.insert(g, vote);
            }
            3 if next[k] > purged_next[k] + 3 => {
                let index = purged_next[k] + rng.below(next[k] - 3 - purged_next[k]);
                logs.pin_entry(g, index).unwrap();
                m.pinned.entry(g).or_default().insert(index);
            }
            4 if m.pinned.get(&g).is_some_and(|p| !p.is_empty()) => {
                let pinned = &m.pinned[&g];
                let index = *pinned.iter().nth(rng.below(pinned.len() as u64) as usize).unwrap();
                if logs.unpin_entry(g, index).is_err() {
                    return;
                }
                m.pinned.entry(g).or_default().remove(&index);
            }
            2 if next[k] > purged_next[k] + 4 => {
                let upto = purged_next[k] + rng.below(next[k] - 3 - purged_next[k]);
                if ls.purge(log_id(1, 1, upto)).await.is_err() {
                    return;
                }
                purged_next[k] = upto + 1;
            }
            _ => {
                let n = 1 + rng.below(3);
                let entries: Vec<Entry> = (next[k]..next[k] + n).map(|i| big(g, term[k], i)).collect();
                for e in &entries {
                    m.appended.insert((g, e.log_id.index, term[k]), e.clone());
                }
                next[k] += n;
                let wait = rng.below(2) == 0;
                let (tx, rx) = TypeConfig::oneshot();
                let done = if wait { IOFlushed::signal(tx) } else { IOFlushed::noop() };
                if ls.append(entries.clone(), done).await.is_err() {
                    return;
                }
                m.pending.entry(g).or_default().extend(entries);
                if wait {
                    if !matches!(until_power_off(sim, rx).await, Some(Ok(Ok(())))) {
                        return;
                    }
                    m.all_durable();
                }
            }
        }
    }
}

/// Purges use term 1 for their log id; the log store only compares indexes with what it holds.
async fn check(sim: &Arc<SimDisk>, dir: &Path, options: LogsOptions, m: &Model, what: &str) {
    let (store, logs) = open_sim_with(sim, dir, options).unwrap_or_else(|| panic!("{what}: recovery failed"));
    for g in 1..=2u64 {
        let mut ls = logs.log_store(g).unwrap();
        let state = ls.get_log_state().await.unwrap();
        let entries = ls.try_get_log_entries(0..).await.unwrap_or_else(|e| panic!("{what}: group {g}: {e}"));
        let purged_next = state.last_purged_log_id.map_or(0, |p| p.index + 1);
        for (i, e) in entries.iter().enumerate() {
            if i > 0 {
                assert_eq!(e.log_id.index, entries[i - 1].log_id.index + 1, "{what}: group {g}: a hole");
            }
            let was = m.appended.get(&(g, e.log_id.index, e.log_id.leader_id.term));
            assert_eq!(Some(e), was, "{what}: group {g}: an entry that was never appended");
        }
        let by_index: BTreeMap<u64, &Entry> = entries.iter().map(|e| (e.log_id.index, e)).collect();
        // A truncation not known durable may or may not have reached the disk.
        let maybe_truncated = m.pending_truncation.get(&g).copied().unwrap_or(u64::MAX);
        for (index, e) in m.durable.get(&g).into_iter().flatten() {
            if *index >= purged_next && *index < maybe_truncated {
                assert_eq!(by_index.get(index), Some(&e), "{what}: group {g}: durable entry {index} lost");
            }
        }
        // Pinned entries the purge let go of are retained: readable by index.
        for index in m.pinned.get(&g).into_iter().flatten() {
            let Some(e) = m.durable.get(&g).and_then(|d| d.get(index)) else { continue };
            let got = logs.read_entry(g, *index).unwrap_or_else(|err| panic!("{what}: group {g}: pinned entry {index}: {err}"));
            assert_eq!(got.as_ref(), Some(e), "{what}: group {g}: pinned entry {index} lost");
        }
        let last = state.last_log_id.map(|l: LogId| l.index);
        if let Some(vote) = m.votes.get(&g) {
            let got = ls.read_vote().await.unwrap();
            assert!(got.is_some_and(|v| v >= *vote), "{what}: group {g}: vote {vote} went back to {got:?}");
        }
        // The recovered log accepts the next entry, durably.
        let next = last.map_or(0, |l| l + 1);
        let term = state.last_log_id.map_or(1, |l| l.leader_id.term) + 10;
        let (tx, rx) = TypeConfig::oneshot();
        ls.append(vec![big(g, term, next)], IOFlushed::signal(tx)).await.unwrap();
        rx.await.unwrap().unwrap();
    }
    store.close().unwrap();
}

async fn run_once(cut_at: Option<u64>, loss: Loss, seed: u64) -> u64 {
    let root = tempfile::tempdir().unwrap();
    let sim = SimDisk::new(root.path()).unwrap();
    let dir = root.path().join("store");
    let mut m = Model::default();
    let options = LogsOptions { layout_every: if seed.is_multiple_of(2) { 3 } else { 256 } };
    let (store, logs) = open_sim_with(&sim, &dir, options).unwrap();
    let start = sim.op_count();
    if let Some(k) = cut_at {
        sim.fault_at(start + k, Fault::PowerCut);
    }
    workload(&sim, &logs, seed, &mut m).await;
    let ops = sim.op_count() - start;
    sim.cut_power();
    drop(logs);
    store.close().unwrap();
    sim.power_loss(loss).unwrap();
    check(&sim, &dir, options, &m, &format!("seed {seed}, cut at op {cut_at:?} of {ops}, {loss:?}, {options:?}")).await;
    ops
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_flushed_survives_a_power_cut_and_the_rest_leaves_no_hole() {
    for seed in 1..=8u64 {
        // A run to the end gives the number of operations to cut at.
        let ops = run_once(None, Loss::Unsynced, seed).await;
        let mut rng = Rng(seed + 99);
        for i in 0..12u64 {
            let cut = rng.below(ops.max(1));
            let loss = if i % 2 == 0 { Loss::Unsynced } else { Loss::Torn { seed: seed * 100 + i } };
            run_once(Some(cut), loss, seed).await;
        }
    }
}

/// A snapshot reported built survives a power cut; one cut short leaves the snapshot before it
/// whole (never a torn one), and the machine restores from whichever is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_built_snapshot_survives_a_power_cut_and_a_cut_build_leaves_the_previous_one() {
    use futures_util::stream;
    use openraft::storage::RaftStateMachine;
    use openraft::RaftSnapshotBuilder;
    use warren_cluster::machine::testing::ListMachine;
    use warren_cluster::machine::StateMachine;

    let entries: Vec<Entry> = (0..120).map(|i| big(3, 1, i)).collect();
    async fn apply(sm: &mut StateMachine<ListMachine>, entries: &[Entry]) {
        let items: Vec<_> = entries.iter().cloned().map(|e| Ok((e, None))).collect();
        sm.apply(stream::iter(items)).await.unwrap();
    }
    // Operations of the second snapshot's build, counted on a run without a cut.
    let mut total = None;
    let mut k = 0u64;
    loop {
        let root = tempfile::tempdir().unwrap();
        let sim = SimDisk::new(root.path()).unwrap();
        let dir = root.path().join("store");
        let (store, logs) = open_sim(&sim, &dir).unwrap();
        let mut ls = logs.log_store(3).unwrap();
        append_flushed(&mut ls, entries.clone()).await;
        let mut sm = StateMachine::open(&logs, 3, ListMachine::default()).await.unwrap();
        apply(&mut sm, &entries[..60]).await;
        let first = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
        ls.purge(log_id(1, 1, 59)).await.unwrap();
        apply(&mut sm, &entries[60..]).await;
        let start = sim.op_count();
        if total.is_some() {
            sim.fault_at(start + k, Fault::PowerCut);
        }
        let mut builder = sm.get_snapshot_builder().await;
        let built = until_power_off(&sim, builder.build_snapshot()).await.and_then(|r| r.ok());
        let ops = sim.op_count() - start;
        sim.cut_power();
        drop((ls, sm, logs));
        store.close().unwrap();
        sim.power_loss(if k % 2 == 0 { Loss::Unsynced } else { Loss::Torn { seed: k } }).unwrap();

        let (_store, logs) = open_sim(&sim, &dir).unwrap();
        let machine = ListMachine::default();
        let mut sm = StateMachine::open(&logs, 3, machine.clone()).await.unwrap();
        let current = sm.get_current_snapshot().await.unwrap().expect("a snapshot");
        let applied = sm.applied_state().await.unwrap().0;
        if let Some(second) = &built {
            assert_eq!(current.meta, second.meta, "cut at {k}: the built snapshot is there");
        } else {
            assert!(current.meta == first.meta || current.meta.last_log_id == Some(entries[119].log_id), "cut at {k}: {:?}", current.meta);
        }
        assert_eq!(applied, current.meta.last_log_id);
        let n = applied.map_or(0, |l| l.index as usize + 1);
        assert_eq!(machine.commands().len(), n, "cut at {k}: the machine holds exactly the snapshot's commands");
        let mut ls = logs.log_store(3).unwrap();
        let rest = all_entries(&mut ls).await;
        // The purge was not waited for; the second snapshot's record came after it in the WAL.
        let first_index = rest.first().map(|e| e.log_id.index);
        if built.is_some() {
            assert_eq!(first_index, Some(60), "cut at {k}: the log after the purge");
        } else {
            assert!(matches!(first_index, Some(0) | Some(60)), "cut at {k}: {first_index:?}");
        }
        assert_eq!(rest.last().map(|e| e.log_id.index), Some(119), "cut at {k}");
        match total {
            None => {
                total = Some(ops);
                k = 0;
            }
            Some(t) if k + 1 >= t => break,
            Some(_) => k += 1,
        }
    }
    assert!(total.unwrap() > 0);
}
