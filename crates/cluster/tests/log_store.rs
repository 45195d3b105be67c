//! The Raft log store on a real store in a temp dir: openraft's conformance suite, and what comes
//! back after the store is closed and opened again (entries, vote, committed, truncation, purge,
//! snapshots, several groups).

mod log_store_common;

use std::sync::Arc;

use bytes::Bytes;
use log_store_common::*;
use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::log::{StoreBuilder, Suite};
use openraft::{RaftLogReader, RaftSnapshotBuilder, StorageError};
use warren_cluster::log_store::{LogStore, RaftLogs, RAFT_LOG, RAFT_STATE};
use warren_cluster::machine::testing::ListMachine;
use warren_cluster::machine::StateMachine;
use warren_cluster::types::{TypeConfig, Vote};

/// Keeps the temp dir until the store is closed (a writer thread must not see its directory go).
struct Guard {
    logs: Arc<RaftLogs>,
    _dir: tempfile::TempDir,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.logs.store().close();
    }
}

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine<ListMachine>, Guard> for Builder {
    async fn build(&self) -> Result<(Guard, LogStore, StateMachine<ListMachine>), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().unwrap();
        let (_store, logs) = open(dir.path());
        let ls = logs.log_store(3).unwrap();
        let sm = StateMachine::open(&logs, 3, ListMachine::default()).await.unwrap();
        Ok((Guard { logs, _dir: dir }, ls, sm))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openraft_conformance_suite() {
    Suite::test_all(Builder).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_vote_committed_truncation_and_purge_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, logs) = open(dir.path());
        let mut a = logs.log_store(7).unwrap();
        let mut b = logs.log_store(8).unwrap();
        append_flushed(&mut a, (0..20).map(|i| normal(7, 1, i)).collect()).await;
        append_flushed(&mut b, (0..3).map(|i| normal(8, 1, i)).collect()).await;
        a.save_vote(&Vote::new(2, 2)).await.unwrap();
        // A new leader's entries replace 16..20.
        a.truncate_after(Some(log_id(1, 1, 15))).await.unwrap();
        append_flushed(&mut a, (16..19).map(|i| normal(7, 2, i)).collect()).await;
        a.save_committed(Some(log_id(2, 1, 17))).await.unwrap();
        a.purge(log_id(1, 1, 5)).await.unwrap();
        // Purging again below what is purged changes nothing.
        a.purge(log_id(1, 1, 3)).await.unwrap();
        a.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
        store.close().unwrap();
    }
    let (store, logs) = open(dir.path());
    assert_eq!(logs.group_ids(), vec![7, 8]);
    let mut a = logs.log_store(7).unwrap();
    let state = a.get_log_state().await.unwrap();
    assert_eq!(state.last_purged_log_id, Some(log_id(1, 1, 5)));
    assert_eq!(state.last_log_id, Some(log_id(2, 1, 18)));
    let want: Vec<_> = (6..16).map(|i| normal(7, 1, i)).chain((16..19).map(|i| normal(7, 2, i))).collect();
    assert_eq!(all_entries(&mut a).await, want);
    assert_eq!(a.read_vote().await.unwrap(), Some(Vote::new_committed(2, 1)));
    assert_eq!(a.read_committed().await.unwrap(), Some(log_id(2, 1, 17)));
    let mut b = logs.log_store(8).unwrap();
    assert_eq!(all_entries(&mut b).await, (0..3).map(|i| normal(8, 1, i)).collect::<Vec<_>>());
    assert_eq!(b.read_vote().await.unwrap(), None);

    // Only the live records are kept: the purged and truncated ones were acked.
    let live = store.read(RAFT_LOG | 7, 0, 1000, usize::MAX).unwrap().messages.len();
    assert_eq!(live, 13, "entries 6..=18 are the only live records of group 7");
    let state_records = store.read(RAFT_STATE | 7, 0, 1000, usize::MAX).unwrap().messages.len();
    assert_eq!(state_records, 2, "one live hard-state record and one layout record");

    // The recovered log goes on: the next index after the last, nothing else.
    append_flushed(&mut a, vec![normal(7, 3, 19)]).await;
    assert!(a.append(vec![normal(7, 3, 21)], openraft::storage::IOFlushed::noop()).await.is_err(), "a hole is refused");
    assert_eq!(all_entries(&mut a).await.last(), Some(&normal(7, 3, 19)));
    assert_eq!(store.stats().seq_regressions, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_past_the_last_entry_and_a_truncation_of_everything_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, logs) = open(dir.path());
        let mut a = logs.log_store(1).unwrap();
        let mut b = logs.log_store(2).unwrap();
        append_flushed(&mut a, (0..5).map(|i| normal(1, 1, i)).collect()).await;
        // As after installing a snapshot at 9: the log is purged past its end.
        a.purge(log_id(1, 1, 9)).await.unwrap();
        append_flushed(&mut b, (0..5).map(|i| normal(2, 1, i)).collect()).await;
        b.truncate_after(None).await.unwrap();
        append_flushed(&mut b, vec![normal(2, 2, 0)]).await;
        store.close().unwrap();
    }
    let (_store, logs) = open(dir.path());
    let mut a = logs.log_store(1).unwrap();
    let state = a.get_log_state().await.unwrap();
    assert_eq!((state.last_purged_log_id, state.last_log_id), (Some(log_id(1, 1, 9)), Some(log_id(1, 1, 9))));
    assert!(all_entries(&mut a).await.is_empty());
    append_flushed(&mut a, vec![normal(1, 2, 10)]).await;
    assert_eq!(all_entries(&mut a).await, vec![normal(1, 2, 10)]);
    let mut b = logs.log_store(2).unwrap();
    assert_eq!(all_entries(&mut b).await, vec![normal(2, 2, 0)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_survives_a_restart_and_restores_the_machine() {
    let dir = tempfile::tempdir().unwrap();
    let entries: Vec<_> = (0..10).map(|i| normal(4, 1, i)).collect();
    let built = {
        let (store, logs) = open(dir.path());
        let mut ls = logs.log_store(4).unwrap();
        append_flushed(&mut ls, entries.clone()).await;
        let machine = ListMachine::default();
        let mut sm = StateMachine::open(&logs, 4, machine.clone()).await.unwrap();
        let stream = futures_util::stream::iter(entries[..8].iter().cloned().map(|e| Ok((e, None))));
        sm.apply(stream).await.unwrap();
        let snap = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
        assert_eq!(snap.meta.last_log_id, Some(log_id(1, 1, 7)));
        ls.purge(log_id(1, 1, 7)).await.unwrap();
        // A second snapshot replaces the first.
        let stream = futures_util::stream::iter(entries[8..].iter().cloned().map(|e| Ok((e, None))));
        sm.apply(stream).await.unwrap();
        let snap = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
        assert_eq!(snap.meta.last_log_id, Some(log_id(1, 1, 9)));
        store.close().unwrap();
        snap
    };
    let (store, logs) = open(dir.path());
    let machine = ListMachine::default();
    let mut sm = StateMachine::open(&logs, 4, machine.clone()).await.unwrap();
    assert_eq!(sm.applied_state().await.unwrap().0, Some(log_id(1, 1, 9)));
    assert_eq!(machine.commands(), entries.iter().map(|e| command(4, e.log_id.index, 1)).collect::<Vec<_>>());
    let current = sm.get_current_snapshot().await.unwrap().unwrap();
    assert_eq!(current.meta, built.meta);
    assert_eq!(current.snapshot, built.snapshot);
    assert_eq!(store.read(RAFT_STATE | 4, 0, 100, usize::MAX).unwrap().messages.len(), 3, "the hard state, the layout and the second snapshot: the first was acked");
    let mut ls = logs.log_store(4).unwrap();
    assert_eq!(all_entries(&mut ls).await, entries[8..].to_vec());

    // Installing a snapshot on a fresh node's group: the machine takes it, and it is stored.
    let other = ListMachine::default();
    let mut sm2 = StateMachine::open(&logs, 5, other.clone()).await.unwrap();
    sm2.install_snapshot(&current.meta, current.snapshot.clone()).await.unwrap();
    assert_eq!(other.commands(), machine.commands());
    drop(sm2);
    let again = ListMachine::default();
    let _sm3 = StateMachine::open(&logs, 5, again.clone()).await.unwrap();
    assert_eq!(again.commands(), machine.commands());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_group_is_gone_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, logs) = open(dir.path());
        let mut a = logs.log_store(9).unwrap();
        append_flushed(&mut a, (0..3).map(|i| normal(9, 1, i)).collect()).await;
        a.save_vote(&Vote::new(1, 1)).await.unwrap();
        let t = logs.remove_group(9).unwrap();
        store.wait_durable(t).unwrap();
        assert!(a.try_get_log_entries(0..).await.is_err(), "handles of a removed group fail");
        // Another group with the same id starts empty, at once.
        let mut b = logs.log_store(9).unwrap();
        assert!(all_entries(&mut b).await.is_empty());
        assert_eq!(b.read_vote().await.unwrap(), None);
        append_flushed(&mut b, vec![normal(9, 5, 0)]).await;
        assert_eq!(all_entries(&mut b).await, vec![normal(9, 5, 0)]);
        let t = logs.remove_group(9).unwrap();
        store.wait_durable(t).unwrap();
        store.close().unwrap();
    }
    let (store, logs) = open(dir.path());
    assert!(logs.group_ids().is_empty());
    // And after a restart: only what was appended after the removal.
    let mut c = logs.log_store(9).unwrap();
    append_flushed(&mut c, vec![normal(9, 7, 0), normal(9, 7, 1)]).await;
    store.close().unwrap();
    let (_store, logs) = open(dir.path());
    let mut c = logs.log_store(9).unwrap();
    assert_eq!(all_entries(&mut c).await, vec![normal(9, 7, 0), normal(9, 7, 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_are_readable_by_every_reader_as_soon_as_append_returns() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, logs) = open(dir.path());
    let mut ls = logs.log_store(1).unwrap();
    let mut reader = ls.get_log_reader().await;
    for round in 0..200u64 {
        let entries: Vec<_> = (round * 5..round * 5 + 5).map(|i| normal(1, 1, i)).collect();
        append_unflushed(&mut ls, entries.clone()).await;
        assert_eq!(reader.try_get_log_entries(round * 5..round * 5 + 5).await.unwrap(), entries);
    }
    assert_eq!(reader.try_get_log_entries(0..).await.unwrap().len(), 1000);
    let limited = reader.limited_get_log_entries(0, 1000).await.unwrap();
    assert!(!limited.is_empty() && limited[0] == normal(1, 1, 0));
}

/// A start reads only the entry records appended after a group's last layout record; the others
/// are found from it, and read back right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_reads_only_the_entries_after_the_last_layout() {
    let dir = tempfile::tempdir().unwrap();
    let mut want = Vec::new();
    {
        let (store, logs) = open(dir.path());
        let mut ls = logs.log_store(2).unwrap();
        for chunk in 0..100u64 {
            let entries: Vec<_> = (chunk * 10..chunk * 10 + 10).map(|i| normal(2, 1 + chunk / 30, i)).collect();
            want.extend(entries.clone());
            append_flushed(&mut ls, entries).await;
        }
        store.close().unwrap();
    }
    let stats = {
        let (store, logs) = open(dir.path());
        let mut ls = logs.log_store(2).unwrap();
        assert_eq!(all_entries(&mut ls).await, want);
        // A new term replaces the last 15 entries; the purge drops the first 100.
        ls.truncate_after(Some(log_id(4, 1, 984))).await.unwrap();
        want.truncate(985);
        let more: Vec<_> = (985..990).map(|i| normal(2, 5, i)).collect();
        want.extend(more.clone());
        append_flushed(&mut ls, more).await;
        ls.purge(log_id(1, 1, 99)).await.unwrap();
        want.drain(..100);
        ls.save_vote(&Vote::new(5, 1)).await.unwrap();
        let stats = logs.recovery_stats();
        store.close().unwrap();
        stats
    };
    assert_eq!(stats.entries, 1000);
    assert!(stats.records_read <= 256 + 10, "read {} records of 1000", stats.records_read);
    let (_store, logs) = open(dir.path());
    let mut ls = logs.log_store(2).unwrap();
    assert_eq!(all_entries(&mut ls).await, want);
    assert!(logs.recovery_stats().records_read <= 5, "{:?}", logs.recovery_stats());
}

/// A purge keeps the records of the entries the state machine pinned (the bodies of live messages
/// only in them): readable by index until unpinned, across restarts; at a start the retained
/// entries the machine does not pin again go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_keeps_pinned_entries_until_they_are_unpinned_and_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    // The store applies acks after their write: wait for the count to be reached.
    let live = |store: &warren_store::Store, want: usize| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let n = store.read(RAFT_LOG | 4, 0, 1000, usize::MAX).unwrap().messages.len();
            if n == want || std::time::Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    {
        let (store, logs) = open(dir.path());
        let mut ls = logs.log_store(4).unwrap();
        append_flushed(&mut ls, (0..20).map(|i| normal(4, 1, i)).collect()).await;
        for i in [3, 4, 10, 17] {
            logs.pin_entry(4, i).unwrap();
        }
        ls.purge(log_id(1, 1, 15)).await.unwrap();
        for i in [3, 4, 10, 17] {
            assert_eq!(logs.read_entry(4, i).unwrap(), Some(normal(4, 1, i)), "entry {i}");
        }
        assert_eq!(logs.read_entry(4, 5).unwrap(), None, "purged and not pinned");
        assert_eq!(all_entries(&mut ls).await, (16..20).map(|i| normal(4, 1, i)).collect::<Vec<_>>(), "openraft sees the purge");
        assert_eq!(live(&store, 3 + 4), 3 + 4);
        logs.unpin_entry(4, 4).unwrap();
        assert_eq!(logs.read_entry(4, 4).unwrap(), None);
        assert_eq!(live(&store, 2 + 4), 2 + 4);
        ls.save_vote(&Vote::new(1, 1)).await.unwrap();
        store.close().unwrap();
    }
    {
        let (store, logs) = open(dir.path());
        assert_eq!(logs.recovery_stats().retained, 2);
        let mut ls = logs.log_store(4).unwrap();
        assert_eq!(ls.get_log_state().await.unwrap().last_purged_log_id, Some(log_id(1, 1, 15)));
        for i in [3, 10] {
            assert_eq!(logs.read_entry(4, i).unwrap(), Some(normal(4, 1, i)), "entry {i} after a restart");
        }
        // The machine reads entry 3 still, not 10.
        logs.pin_entry(4, 3).unwrap();
        assert_eq!(logs.release_unpinned(4).unwrap(), 1);
        assert_eq!(logs.read_entry(4, 10).unwrap(), None);
        assert_eq!(live(&store, 1 + 4), 1 + 4);
        // A later purge keeps what is pinned and retained before.
        logs.pin_entry(4, 18).unwrap();
        ls.purge(log_id(1, 1, 19)).await.unwrap();
        assert_eq!(live(&store, 2), 2);
        ls.save_vote(&Vote::new(2, 1)).await.unwrap();
        store.close().unwrap();
    }
    let (store, logs) = open(dir.path());
    assert_eq!(logs.recovery_stats().retained, 2);
    for i in [3, 18] {
        assert_eq!(logs.read_entry(4, i).unwrap(), Some(normal(4, 1, i)), "entry {i} after a second restart");
    }
    assert_eq!(logs.release_unpinned(4).unwrap(), 2);
    assert_eq!(live(&store, 0), 0);
    assert_eq!(store.stats().seq_regressions, 0);
}

/// The state machine's stream of entries is read in chunks of a few MiB: every entry, in order,
/// across chunk boundaries, the purged beginning and the missing end left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_entries_stream_reads_in_chunks() {
    use futures_util::TryStreamExt;
    let dir = tempfile::tempdir().unwrap();
    let (_store, logs) = open(dir.path());
    let mut ls = logs.log_store(1).unwrap();
    let big = |i: u64| {
        let mut e = normal(1, 1, i);
        if let openraft::EntryPayload::Normal(c) = &mut e.payload {
            c.0 = Bytes::from(vec![i as u8; 40 << 10]);
        }
        e
    };
    let want: Vec<_> = (0..300).map(big).collect();
    for chunk in want.chunks(20) {
        append_flushed(&mut ls, chunk.to_vec()).await;
    }
    ls.purge(log_id(1, 1, 9)).await.unwrap();
    let got: Vec<_> = ls.entries_stream(0..400).await.try_collect().await.unwrap();
    assert_eq!(got, want[10..].to_vec());
    let got: Vec<_> = ls.entries_stream(100..=150).await.try_collect().await.unwrap();
    assert_eq!(got, want[100..=150].to_vec());
}

#[test]
fn group_ids_at_or_above_the_raft_bits_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, logs) = open(dir.path());
    assert!(logs.log_store(RAFT_STATE).is_err());
    assert!(logs.log_store(RAFT_STATE - 1).is_ok());
    let _ = Bytes::new();
}

/// The task that fires `IOFlushed` runs on the runtime of the first append; when that runtime is
/// gone, appends on another one are still reported durable.
#[test]
fn flush_reports_survive_the_runtime_that_started_them() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, logs) = open(dir.path());
    let mut ls = logs.log_store(1).unwrap();
    for round in 0..3u64 {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(append_flushed(&mut ls, vec![normal(1, 1, round)]));
        drop(rt);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    assert_eq!(rt.block_on(all_entries(&mut ls)).len(), 3);
}

/// Bytes the store writes for one settle (an appended entry and the unpin of a retained one), with
/// `retained` entries retained, every other one so that no two form a run.
async fn bytes_per_settle(retained: u64) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let (store, logs) = open(dir.path());
    let mut ls = logs.log_store(5).unwrap();
    let total = retained * 2;
    let mut index = 0;
    while index < total {
        let n = (total - index).min(4096);
        append_unflushed(&mut ls, (index..index + n).map(|i| normal(5, 1, i)).collect()).await;
        index += n;
    }
    for i in (0..total).step_by(2) {
        logs.pin_entry(5, i).unwrap();
    }
    ls.purge(log_id(1, 1, total - 1)).await.unwrap();
    append_flushed(&mut ls, vec![normal(5, 1, total)]).await;
    let before = store.stats().bytes_written;
    let settles = 512u64;
    for k in 0..settles {
        append_unflushed(&mut ls, vec![normal(5, 1, total + 1 + k)]).await;
        logs.unpin_entry(5, k * 2).unwrap();
    }
    append_flushed(&mut ls, vec![normal(5, 1, total + 1 + settles)]).await;
    let per = (store.stats().bytes_written - before) as f64 / settles as f64;
    ls.save_vote(&Vote::new(1, 1)).await.unwrap();
    store.close().unwrap();
    // A start finds the retained set those records describe, without reading the entries.
    let (store, logs) = open(dir.path());
    let stats = logs.recovery_stats();
    assert_eq!(stats.retained, retained - settles);
    assert!(stats.records_read < 1024, "{} records read at the start", stats.records_read);
    assert_eq!(logs.read_entry(5, 0).unwrap(), None, "released");
    assert_eq!(logs.read_entry(5, (settles - 1) * 2).unwrap(), None, "released");
    let kept = settles * 2;
    assert_eq!(logs.read_entry(5, kept).unwrap(), Some(normal(5, 1, kept)), "retained");
    assert_eq!(logs.read_entry(5, total - 2).unwrap(), Some(normal(5, 1, total - 2)), "retained");
    assert_eq!(logs.read_entry(5, total - 1).unwrap(), None, "never pinned");
    assert_eq!(store.stats().seq_regressions, 0);
    store.close().unwrap();
    per
}

/// A settle writes the same few bytes however many entries are retained (item 8 of issue 32: each
/// unpin used to rewrite a record naming every retained entry, megabytes each with 100k retained).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_writes_as_much_with_a_million_entries_retained_as_with_a_thousand() {
    let small = bytes_per_settle(1_000).await;
    let large = bytes_per_settle(1_000_000).await;
    println!("bytes written per settle: {small:.0} with 1k retained, {large:.0} with 1M retained");
    assert!(large < small * 1.5 + 64.0, "{large:.0} bytes per settle with 1M retained, {small:.0} with 1k");
    assert!(large < 1024.0, "{large:.0} bytes per settle");
}

/// Changes to the retained set, with whole sets written in between (every so many changes), come
/// back exactly after a restart; what was released is gone from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retained_set_after_many_changes_and_resets_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let pinned: Vec<u64> = (0..800).step_by(2).collect();
    // Released in a scattered order; ten stay.
    let mut released: Vec<u64> = pinned.iter().copied().filter(|i| i % 80 != 0).collect();
    released.sort_by_key(|i| (i * 7919) % 1009);
    let kept: Vec<u64> = pinned.iter().copied().filter(|i| i % 80 == 0).collect();
    {
        let (store, logs) = open(dir.path());
        let mut ls = logs.log_store(6).unwrap();
        append_flushed(&mut ls, (0..800).map(|i| normal(6, 1, i)).collect()).await;
        for i in &pinned[..200] {
            logs.pin_entry(6, *i).unwrap();
        }
        ls.purge(log_id(1, 1, 399)).await.unwrap();
        for i in &pinned[200..] {
            logs.pin_entry(6, *i).unwrap();
        }
        ls.purge(log_id(1, 1, 799)).await.unwrap();
        for i in &released {
            logs.unpin_entry(6, *i).unwrap();
        }
        append_flushed(&mut ls, vec![normal(6, 1, 800)]).await;
        ls.save_vote(&Vote::new(1, 1)).await.unwrap();
        store.close().unwrap();
    }
    let (store, logs) = open(dir.path());
    assert_eq!(logs.recovery_stats().retained, kept.len() as u64);
    for i in &kept {
        assert_eq!(logs.read_entry(6, *i).unwrap(), Some(normal(6, 1, *i)), "entry {i}");
    }
    for i in released.iter().take(50) {
        assert_eq!(logs.read_entry(6, *i).unwrap(), None, "entry {i} was released");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let live = store.read(RAFT_LOG | 6, 0, 10_000, usize::MAX).unwrap().messages.len();
        if live == kept.len() + 1 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{live} records live, want {}", kept.len() + 1);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(store.stats().seq_regressions, 0);
}
