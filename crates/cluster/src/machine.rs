//! The state machines of Warren's groups: the [`GroupMachine`] trait they implement (bytes in, bytes
//! out, no openraft type), and openraft's `RaftStateMachine` over any of them ([`StateMachine`]).
//!
//! Snapshots are the machine's own bytes ([`GroupMachine::snapshot`]), stored as a record of the
//! group's `RAFT_STATE` queue (see `log_store`): a snapshot is reported built only once that record
//! is durable, after which openraft may purge the log before it. At a start the machine is restored
//! from the stored snapshot and openraft applies the log after it again, up to the committed index.
//!
//! ### To ensure correctness
//! - A machine must be deterministic: the same commands in the same order give the same state and
//!   replies on every replica (no clock, no randomness, no I/O inside `apply`).
//! - `snapshot` must capture everything `apply` has changed; `restore` must replace the whole state.

use std::io;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine};
use openraft::Snapshot;
use openraft::{EntryPayload, OptionalSend};
use parking_lot::Mutex;

use crate::codec::{SnapshotMeta, StoredMembership};
use crate::log_store::{Group, LogStoreError, RaftLogs, Shared};
use crate::types::{GroupId, LogId, Reply, TypeConfig};

/// A group's state machine, as Warren writes them: commands are opaque bytes (`Command`), replies
/// too (`Reply`). Blank and membership entries do not reach it (they only advance the applied index).
///
/// To let other parts of the node see the state (e.g. a queue delivering to consumers), implement
/// this on a handle that shares it: the `Raft` owns the machine.
pub trait GroupMachine: Send + 'static {
    /// Applies the command of entry `index` (indexes rise; gaps are blank or membership entries)
    /// and returns the reply for its proposer. Must not fail: a command the machine cannot use is
    /// answered with an error reply, and every replica answers it the same way.
    fn apply(&mut self, index: u64, command: &Bytes) -> Bytes;

    /// The whole state, as bytes `restore` takes back. Taken on the state machine's task, right
    /// after the last entry applied; once the snapshot is stored, the log up to that entry may be
    /// purged, so whatever the machine still needs from those entries (a quorum queue: the bodies of
    /// its live messages) must be in the store or in entries it pinned ([`RaftLogs::pin_entry`])
    /// before this returns. An error fails the snapshot: nothing is purged.
    fn snapshot(&self) -> Result<Bytes, String>;

    /// Replaces the whole state by a snapshot's. An error is bad bytes (a damaged or foreign
    /// snapshot): the group stops rather than go on with a wrong state.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String>;

    /// A snapshot from the leader was just restored (not one of this node's own at a start): what
    /// the snapshot does not carry is fetched now (a quorum queue: the bodies of its live
    /// messages), before the snapshot is stored and before any later entry applies. Default:
    /// nothing. An error stops the install (the leader sends the snapshot again).
    fn installed(&mut self) -> crate::transport::BoxFuture<Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    /// At a start, after `restore` of this node's own stored snapshot: the machine pins the purged
    /// entries it still reads ([`RaftLogs::pin_entry`]); the log lets the other retained ones go
    /// once this returns. Default: nothing (every retained entry goes).
    fn restored_at_start(&mut self) {}
}

/// What openraft sends and installs as a snapshot: the machine's bytes.
pub type SnapshotData = Bytes;

/// A snapshot as openraft hands it around: metadata and the machine's bytes.
pub type GroupSnapshot = Snapshot<crate::types::CommittedLeaderId, crate::types::NodeId, crate::types::NodeAddr, SnapshotData>;

/// openraft's `RaftStateMachine` over a [`GroupMachine`].
pub struct StateMachine<M: GroupMachine> {
    group: Arc<Group>,
    shared: Arc<Shared>,
    machine: Arc<Mutex<M>>,
    applied: Option<LogId>,
    membership: StoredMembership,
}

impl<M: GroupMachine> StateMachine<M> {
    /// The state machine of `group`: `machine` is restored from the group's stored snapshot if it
    /// has one (openraft then applies the log after it).
    pub async fn open(logs: &RaftLogs, group: GroupId, mut machine: M) -> Result<StateMachine<M>, LogStoreError> {
        let g = logs.group(group)?;
        let shared = logs.shared().clone();
        let mut applied = None;
        let mut membership = StoredMembership::default();
        if let Some((meta, data)) = read_snapshot(&g, &shared).await.map_err(|e| store_error(group, e))? {
            machine.restore(&data).map_err(|e| store_error(group, io::Error::new(io::ErrorKind::InvalidData, format!("restoring the stored snapshot: {e}"))))?;
            machine.restored_at_start();
            applied = meta.last_log_id;
            membership = meta.last_membership;
        }
        // Retained entries the machine did not pin again: read by nothing now.
        match g.release_unpinned(&shared.store) {
            Ok(0) => {}
            Ok(n) => tracing::debug!(group, entries = n, "let go of retained Raft log entries nothing reads"),
            Err(e) => tracing::warn!(group, error = %e, "could not let go of retained Raft log entries nothing reads"),
        }
        Ok(StateMachine { group: g, shared, machine: Arc::new(Mutex::new(machine)), applied, membership })
    }

    /// The last applied log id.
    pub fn applied(&self) -> Option<LogId> {
        self.applied
    }
}

fn store_error(group: GroupId, e: io::Error) -> LogStoreError {
    LogStoreError::Store(warren_store::StoreError::Io { op: "restoring the snapshot of", path: format!("raft group {group}").into(), source: e })
}

/// The stored snapshot and its data (read back from the store once readable).
async fn read_snapshot(group: &Group, shared: &Shared) -> io::Result<Option<(SnapshotMeta, Bytes)>> {
    let mut tried = None;
    loop {
        let Some(stored) = group.inner.lock().snapshot.clone() else { return Ok(None) };
        if tried == Some(stored.seq) {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("group {}: the snapshot record {} is missing from the store", group.id, stored.seq)));
        }
        tried = Some(stored.seq);
        shared.readable(stored.ticket).await?;
        let got = shared.store.read(group.state_queue(), stored.seq, 1, usize::MAX).map_err(io::Error::other)?;
        // Not there: superseded meanwhile by a newer snapshot (its record acked); read that one.
        let Some(m) = got.messages.into_iter().next().filter(|m| m.seq == stored.seq) else { continue };
        return match crate::codec::decode_state(&m.payload) {
            Ok(crate::codec::StateRecord::Snapshot { meta, data }) => Ok(Some((meta, data))),
            Ok(_) => Err(io::Error::new(io::ErrorKind::InvalidData, "the snapshot record holds a hard state")),
            Err(e) => Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
        };
    }
}

/// Stores a snapshot and waits until it is durable.
async fn save_snapshot(group: &Group, shared: &Shared, meta: &SnapshotMeta, data: &[u8]) -> io::Result<()> {
    let ticket = {
        let queue = group.state_queue();
        group.inner.lock().save_snapshot(&shared.store, queue, meta, data)?
    };
    shared.durable(ticket).await
}

impl<M: GroupMachine> RaftStateMachine<TypeConfig> for StateMachine<M> {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        Ok((self.applied, self.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: futures_util::Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        while let Some(item) = entries.next().await {
            let (entry, responder) = item?;
            tracing::debug!(target: "warren_cluster::apply", group = self.group.id, log_id = %entry.log_id, "apply");
            let reply = match entry.payload {
                EntryPayload::Blank => Bytes::new(),
                EntryPayload::Normal(command) => self.machine.lock().apply(entry.log_id.index, &command.0),
                EntryPayload::Membership(m) => {
                    self.membership = StoredMembership::new(Some(entry.log_id), m);
                    Bytes::new()
                }
            };
            self.applied = Some(entry.log_id);
            if let Some(r) = responder {
                r.send(Reply(reply));
            }
        }
        if let Some(applied) = self.applied {
            self.group.applied(&self.shared.store, applied.index);
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        // Taken here, on the state machine's task, so it matches `applied` exactly.
        let data = self.machine.lock().snapshot();
        SnapshotBuilder {
            group: self.group.clone(),
            shared: self.shared.clone(),
            meta: SnapshotMeta { last_log_id: self.applied, last_membership: self.membership.clone() },
            data,
        }
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: SnapshotData) -> Result<(), io::Error> {
        self.machine.lock().restore(&snapshot).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("installing a snapshot: {e}")))?;
        let installed = self.machine.lock().installed();
        installed.await.map_err(|e| io::Error::other(format!("completing a snapshot's install: {e}")))?;
        self.applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        save_snapshot(&self.group, &self.shared, meta, &snapshot).await
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<GroupSnapshot>, io::Error> {
        Ok(read_snapshot(&self.group, &self.shared).await?.map(|(meta, snapshot)| Snapshot { meta, snapshot }))
    }
}

/// Builds (stores) a snapshot taken by `get_snapshot_builder`.
pub struct SnapshotBuilder {
    group: Arc<Group>,
    shared: Arc<Shared>,
    meta: SnapshotMeta,
    data: Result<Bytes, String>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<GroupSnapshot, io::Error> {
        let data = self.data.clone().map_err(|e| io::Error::other(format!("group {}: taking a snapshot: {e}", self.group.id)))?;
        save_snapshot(&self.group, &self.shared, &self.meta, &data).await?;
        Ok(Snapshot { meta: self.meta.clone(), snapshot: data })
    }
}

/// A machine for tests (of this crate and of the node): it records every command it applied, in a
/// list other handles can read, and replies with the entry's index.
pub mod testing {
    use std::sync::Arc;

    use bytes::{BufMut, Bytes, BytesMut};
    use parking_lot::Mutex;

    use super::GroupMachine;

    /// Every (index, command) applied, in order. Clones share the list.
    #[derive(Clone, Default)]
    pub struct ListMachine {
        pub applied: Arc<Mutex<Vec<(u64, Bytes)>>>,
    }

    impl ListMachine {
        pub fn commands(&self) -> Vec<Bytes> {
            self.applied.lock().iter().map(|(_, c)| c.clone()).collect()
        }
    }

    impl GroupMachine for ListMachine {
        fn apply(&mut self, index: u64, command: &Bytes) -> Bytes {
            self.applied.lock().push((index, command.clone()));
            Bytes::copy_from_slice(&index.to_le_bytes())
        }

        fn snapshot(&self) -> Result<Bytes, String> {
            let list = self.applied.lock();
            let mut out = BytesMut::new();
            for (index, command) in list.iter() {
                out.put_u64_le(*index);
                out.put_u32_le(command.len() as u32);
                out.put_slice(command);
            }
            Ok(out.freeze())
        }

        fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
            let mut list = Vec::new();
            let mut rest = snapshot;
            while !rest.is_empty() {
                if rest.len() < 12 {
                    return Err("truncated snapshot".into());
                }
                let index = u64::from_le_bytes(rest[..8].try_into().map_err(|_| "bad index")?);
                let len = u32::from_le_bytes(rest[8..12].try_into().map_err(|_| "bad length")?) as usize;
                if rest.len() < 12 + len {
                    return Err("truncated snapshot".into());
                }
                list.push((index, Bytes::copy_from_slice(&rest[12..12 + len])));
                rest = &rest[12 + len..];
            }
            *self.applied.lock() = list;
            Ok(())
        }
    }
}
