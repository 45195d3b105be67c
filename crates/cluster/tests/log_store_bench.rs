//! Speed of the Raft log store on the real disk (ignored by default; run alone, it prints figures):
//!
//! `cargo test --release -p warren-cluster --test log_store_bench -- --ignored --nocapture --test-threads 1`
//!
//! One entry = 32 commands of 1 KiB (what a quorum queue's entry carries under load). Every append
//! waits for its `IOFlushed` (fsync'd), as openraft does before it acknowledges; the log is purged
//! every 512 entries so the store deletes what is behind (as after a snapshot).

mod log_store_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use log_store_common::*;
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::type_config::TypeConfigExt;
use tokio::sync::Semaphore;
use warren_cluster::log_store::{LogStore, RaftLogs};
use warren_cluster::machine::testing::ListMachine;
use warren_cluster::types::{Command, Entry, TypeConfig};
use warren_cluster::{single_voter_config, start_single_voter};

const COMMANDS_PER_ENTRY: usize = 32;
const COMMAND: usize = 1024;
const RUN: Duration = Duration::from_secs(4);

fn entry(term: u64, index: u64, payload: &Bytes) -> Entry {
    let mut e = normal(0, term, index);
    e.payload = openraft::EntryPayload::Normal(Command(payload.clone()));
    e
}

/// One group appending for `RUN`, at most `window` appends not yet flushed. Returns entries appended.
async fn one_group(mut ls: LogStore, window: usize, payload: Bytes) -> u64 {
    let sem = Arc::new(Semaphore::new(window));
    let start = Instant::now();
    let mut index = 0u64;
    while start.elapsed() < RUN {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let (tx, rx) = TypeConfig::oneshot();
        ls.append(vec![entry(1, index, &payload)], IOFlushed::signal(tx)).await.unwrap();
        tokio::spawn(async move {
            rx.await.unwrap().unwrap();
            drop(permit);
        });
        if index % 512 == 511 {
            ls.purge(log_id(1, 1, index - 256)).await.unwrap();
        }
        index += 1;
    }
    let _ = sem.acquire_many(window as u32).await.unwrap();
    index
}

fn report(what: &str, logs: &RaftLogs, entries: u64, took: Duration, fsyncs_before: u64) {
    let s = took.as_secs_f64();
    let fsyncs = logs.store().stats().fsyncs - fsyncs_before;
    println!(
        "{what}: {:.0} entries/s = {:.0} commands/s = {:.0} MiB/s; {} fsyncs ({:.0}/s, {:.1} entries each)",
        entries as f64 / s,
        (entries * COMMANDS_PER_ENTRY as u64) as f64 / s,
        (entries * (COMMANDS_PER_ENTRY * COMMAND) as u64) as f64 / s / (1 << 20) as f64,
        fsyncs,
        fsyncs as f64 / s,
        entries as f64 / fsyncs.max(1) as f64
    );
}

fn payload() -> Bytes {
    Bytes::from(vec![b'm'; COMMANDS_PER_ENTRY * COMMAND])
}

/// The yardstick: the store alone, records of one entry's size, `window` appends not yet durable.
#[test]
#[ignore]
fn store_alone_throughput() {
    for window in [1usize, 16, 64] {
        let dir = tempfile::tempdir_in(std::env::var("WARREN_BENCH_DIR").unwrap_or_else(|_| std::env::temp_dir().display().to_string())).unwrap();
        let (store, logs) = open(dir.path());
        let before = store.stats().fsyncs;
        let body = payload();
        let start = Instant::now();
        let mut tickets = std::collections::VecDeque::new();
        let mut n = 0u64;
        while start.elapsed() < RUN {
            if tickets.len() == window {
                store.wait_durable(tickets.pop_front().unwrap()).unwrap();
            }
            tickets.push_back(store.append_enqueue(5, n, 0, &[&body]).unwrap());
            if n % 512 == 511 {
                let mut b = warren_store::Batch::new();
                b.ack_range(5, n - 511, n - 255, 256 * body.len() as u64);
                store.append(&mut b).unwrap();
            }
            n += 1;
        }
        for t in tickets {
            store.wait_durable(t).unwrap();
        }
        report(&format!("store alone, {window} append(s) in flight"), &logs, n, start.elapsed(), before);
        store.close().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn append_throughput() {
    for (groups, window) in [(1usize, 1usize), (1, 16), (1, 64), (100, 1), (100, 4)] {
        let dir = tempfile::tempdir_in(std::env::var("WARREN_BENCH_DIR").unwrap_or_else(|_| std::env::temp_dir().display().to_string())).unwrap();
        let (store, logs) = open(dir.path());
        let before = store.stats().fsyncs;
        let start = Instant::now();
        let tasks: Vec<_> = (0..groups as u64).map(|g| tokio::spawn(one_group(logs.log_store(g + 1).unwrap(), window, payload()))).collect();
        let mut entries = 0;
        for t in tasks {
            entries += t.await.unwrap();
        }
        report(&format!("{groups} group(s), {window} append(s) in flight each"), &logs, entries, start.elapsed(), before);
        store.close().unwrap();
    }
}

/// Through openraft: a single-voter group, `writers` concurrent `client_write`s of one 32 KiB
/// command each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn single_voter_client_write_throughput() {
    for writers in [1usize, 32] {
        let dir = tempfile::tempdir_in(std::env::var("WARREN_BENCH_DIR").unwrap_or_else(|_| std::env::temp_dir().display().to_string())).unwrap();
        let (store, logs) = open(dir.path());
        let addr = warren_cluster::NodeAddr { cluster_addr: "127.0.0.1:1".into(), amqp_addr: "127.0.0.1:2".into() };
        let config = openraft::Config { snapshot_policy: openraft::SnapshotPolicy::Never, ..single_voter_config(1) };
        let raft = start_single_voter(&logs, 1, 1, addr, Nothing, Some(config), Duration::from_secs(10)).await.unwrap();
        let before = store.stats().fsyncs;
        let start = Instant::now();
        let tasks: Vec<_> = (0..writers)
            .map(|_| {
                let raft = raft.clone();
                tokio::spawn(async move {
                    let mut n = 0u64;
                    let start = Instant::now();
                    while start.elapsed() < RUN {
                        raft.client_write(Command(payload())).await.unwrap();
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let mut entries = 0;
        for t in tasks {
            entries += t.await.unwrap();
        }
        report(&format!("single-voter Raft, {writers} writer(s)"), &logs, entries, start.elapsed(), before);
        raft.shutdown().await.unwrap();
        store.close().unwrap();
    }
    let _ = ListMachine::default();
}

/// A machine that keeps nothing (the log store is what is measured).
struct Nothing;

impl warren_cluster::GroupMachine for Nothing {
    fn apply(&mut self, _index: u64, _command: &Bytes) -> Bytes {
        Bytes::new()
    }
    fn snapshot(&self) -> Result<Bytes, String> {
        Ok(Bytes::new())
    }
    fn restore(&mut self, _snapshot: &[u8]) -> Result<(), String> {
        Ok(())
    }
}
