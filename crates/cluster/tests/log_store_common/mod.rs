//! Helpers shared by the log store's test files: store options, entries, appends that wait for
//! their `IOFlushed`, reads.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::type_config::TypeConfigExt;
use openraft::vote::RaftLeaderId;
use openraft::{EntryPayload, RaftLogReader};
use warren_cluster::codec::LeaderId;
use warren_cluster::log_store::{LogStore, RaftLogs};
use warren_cluster::types::{Command, Entry, LogId, TypeConfig};
use warren_store::{Store, StoreOptions};

/// Small segments and no idle checkpoints: tests see the WAL replayed, not only checkpoints.
pub fn opts() -> StoreOptions {
    StoreOptions { segment_size: 1 << 20, queue_segment_size: 256 << 10, checkpoint_idle_ms: 3_600_000, ..StoreOptions::default() }
}

pub fn open(dir: &Path) -> (Store, Arc<RaftLogs>) {
    let (store, recovery) = Store::open(dir, opts()).unwrap();
    let logs = RaftLogs::open(store.clone(), &recovery.queues).unwrap();
    (store, logs)
}

pub fn log_id(term: u64, node: u64, index: u64) -> LogId {
    LogId::new(LeaderId::new(term, node), index)
}

pub fn command(group: u64, index: u64, term: u64) -> Bytes {
    Bytes::from(format!("g{group}-i{index}-t{term}").into_bytes())
}

/// A normal entry whose command names its group, index and term.
pub fn normal(group: u64, term: u64, index: u64) -> Entry {
    Entry { log_id: log_id(term, 1, index), payload: EntryPayload::Normal(Command(command(group, index, term))) }
}

pub fn blank(term: u64, index: u64) -> Entry {
    Entry { log_id: log_id(term, 1, index), payload: EntryPayload::Blank }
}

/// Appends and waits until openraft would be told the entries are durable.
pub async fn append_flushed(ls: &mut LogStore, entries: Vec<Entry>) {
    let (tx, rx) = TypeConfig::oneshot();
    ls.append(entries, IOFlushed::signal(tx)).await.unwrap();
    rx.await.unwrap().unwrap();
}

/// Appends without waiting for durability.
pub async fn append_unflushed(ls: &mut LogStore, entries: Vec<Entry>) {
    ls.append(entries, IOFlushed::noop()).await.unwrap();
}

pub async fn all_entries(ls: &mut LogStore) -> Vec<Entry> {
    ls.try_get_log_entries(0..).await.unwrap()
}
