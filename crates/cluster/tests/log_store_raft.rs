//! A single-voter openraft `Raft` on the log store, end to end: commands written through it are
//! applied in order, and after a restart on the same store a fresh machine gets every one of them
//! again (from the stored snapshot and the log after it).

mod log_store_common;

use std::time::Duration;

use bytes::Bytes;
use log_store_common::*;
use openraft::async_runtime::WatchReceiver;
use openraft::SnapshotPolicy;
use warren_cluster::machine::testing::ListMachine;
use warren_cluster::types::{Command, NodeAddr};
use warren_cluster::{single_voter_config, start_single_voter};

fn addr() -> NodeAddr {
    NodeAddr { cluster_addr: "127.0.0.1:4001".into(), amqp_addr: "127.0.0.1:5672".into() }
}

fn cmd(i: u64) -> Bytes {
    Bytes::from(format!("command-{i}").into_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_voter_group_applies_its_commands_again_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let lead = Duration::from_secs(10);
    // Snapshots every 20 entries, the log kept 5 entries behind them: the restart needs both.
    let config = || openraft::Config { snapshot_policy: SnapshotPolicy::LogsSinceLast(20), max_in_snapshot_log_to_keep: 5, purge_batch_size: 1, ..single_voter_config(11) };
    let written: Vec<Bytes> = (0..57).map(cmd).collect();
    {
        let (store, logs) = open(dir.path());
        let machine = ListMachine::default();
        let raft = start_single_voter(&logs, 11, 1, addr(), machine.clone(), Some(config()), lead).await.unwrap();
        for (i, c) in written.iter().enumerate() {
            let reply = raft.client_write(Command(c.clone())).await.unwrap();
            assert_eq!(reply.log_id.index.to_le_bytes().as_slice(), &reply.data.0[..], "write {i}: the machine's reply comes back");
        }
        assert_eq!(machine.commands(), written);
        raft.shutdown().await.unwrap();
        let state = logs.log_store(11).unwrap().log_state();
        assert!(state.last_purged_log_id.is_some(), "the log was purged after a snapshot: {state:?}");
        store.close().unwrap();
    }
    let (store, logs) = open(dir.path());
    let machine = ListMachine::default();
    let raft = start_single_voter(&logs, 11, 1, addr(), machine.clone(), Some(config()), lead).await.unwrap();
    // Leading again means the log up to the new leader's blank entry is committed and applied.
    raft.wait(Some(lead)).applied_index_at_least(Some(written.len() as u64 + 1), "re-applied").await.unwrap();
    assert_eq!(machine.commands(), written, "every command, once, in order");
    let more = raft.client_write(Command(cmd(1000))).await.unwrap();
    assert!(more.log_id.index > written.len() as u64);
    assert_eq!(machine.commands().last(), Some(&cmd(1000)));
    raft.shutdown().await.unwrap();
    store.close().unwrap();
}

/// With openraft's timers off (`single_voter_config`), only the explicit election at start makes
/// the group lead: at first start and after each restart on its data it leads again, keeps leading
/// while idle, and applies new commands after the old ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_voter_group_without_timers_leads_again_after_each_restart() {
    let dir = tempfile::tempdir().unwrap();
    let lead = Duration::from_secs(10);
    let mut written = Vec::new();
    for start in 0..3u64 {
        let (store, logs) = open(dir.path());
        let machine = ListMachine::default();
        let raft = start_single_voter(&logs, 12, 1, addr(), machine.clone(), None, lead).await.unwrap();
        assert!(!raft.config().enable_tick && !raft.config().enable_elect && !raft.config().enable_heartbeat);
        // Leading means its blank entry, the last in the log, commits; everything before it applies.
        let last = raft.metrics().borrow_watched().last_log_index;
        raft.wait(Some(lead)).applied_index_at_least(last, "re-applied").await.unwrap();
        assert_eq!(machine.commands(), written, "start {start}: the old commands, once, in order");
        // Idle longer than any election timeout: nothing steps it down or elects anew.
        let term = raft.metrics().borrow_watched().current_term;
        tokio::time::sleep(Duration::from_millis(700)).await;
        let m = raft.metrics().borrow_watched().clone();
        assert_eq!((m.current_leader, m.current_term), (Some(1), term), "start {start}: still the leader, same term");
        for i in 0..5 {
            let c = cmd(start * 100 + i);
            raft.client_write(Command(c.clone())).await.unwrap();
            written.push(c);
        }
        assert_eq!(machine.commands(), written, "start {start}: the new commands applied after the old");
        raft.shutdown().await.unwrap();
        store.close().unwrap();
    }
}
