//! A group with one voter, this node: a `Raft` on the node's log store that never talks to another
//! node. Commits need only the local fsync. For quorum queues of `x-quorum-initial-group-size: 1`, a
//! node without peers, and end-to-end tests of the storage.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use openraft::errors::{RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse};
use openraft::{Config, RaftMetrics, ServerState};

use crate::log_store::{LogStoreError, RaftLogs};
use crate::machine::{GroupMachine, SnapshotData, StateMachine};
use crate::types::{GroupId, NodeAddr, NodeId, Raft, TypeConfig, Vote};

/// Why a single-voter group did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Storage(#[from] LogStoreError),
    #[error("invalid Raft configuration: {0}")]
    Config(#[from] openraft::ConfigError),
    #[error("group {group}: {error}")]
    Raft { group: GroupId, error: String },
    #[error("group {group}: no leader after {waited:?}")]
    NoLeader { group: GroupId, waited: Duration },
}

/// No timers for a group with one voter: there is nobody to hear heartbeats and nobody to
/// lose, so once it leads it never needs an election again. openraft's tick is off (at 1,000
/// idle groups their ticks and heartbeats kept a third of a core busy); `start_single_voter`
/// elects explicitly at start.
pub fn single_voter_config(group: GroupId) -> Config {
    Config {
        cluster_name: format!("warren-group-{group}"),
        enable_tick: false,
        enable_heartbeat: false,
        enable_elect: false,
        heartbeat_interval: 100,
        election_timeout_min: 150,
        election_timeout_max: 300,
        ..Config::default()
    }
}

/// Starts group `group` with this node (`node`, at `addr`) as its only voter, on the node's logs:
/// opens its log store and state machine (restoring `machine` from the stored snapshot; openraft
/// then applies the committed log after it), initializes the group the first time, and returns
/// once this node leads it (at most `lead_within`). `config`: `single_voter_config` if `None`.
pub async fn start_single_voter<M: GroupMachine>(
    logs: &RaftLogs,
    group: GroupId,
    node: NodeId,
    addr: NodeAddr,
    machine: M,
    config: Option<Config>,
    lead_within: Duration,
) -> Result<Raft<StateMachine<M>>, StartError> {
    let raft_error = |e: &dyn std::fmt::Display| StartError::Raft { group, error: e.to_string() };
    let config = Arc::new(config.unwrap_or_else(|| single_voter_config(group)).validate()?);
    let log_store = logs.log_store(group)?;
    let machine = StateMachine::open(logs, group, machine).await?;
    let raft = Raft::new(node, config, NoPeers, log_store, machine).await.map_err(|e| raft_error(&e))?;
    match lead(&raft, group, node, addr, lead_within).await {
        Ok(()) => Ok(raft),
        Err(e) => {
            // Its tasks would go on writing to the group's log.
            let _ = raft.shutdown().await;
            Err(e)
        }
    }
}

/// Initializes the group the first time, elects this node (with the tick off nothing else
/// would), and waits until it leads.
async fn lead<M: GroupMachine>(raft: &Raft<StateMachine<M>>, group: GroupId, node: NodeId, addr: NodeAddr, lead_within: Duration) -> Result<(), StartError> {
    let raft_error = |e: &dyn std::fmt::Display| StartError::Raft { group, error: e.to_string() };
    if !raft.is_initialized().await.map_err(|e| raft_error(&e))? {
        raft.initialize(BTreeMap::from([(node, addr)])).await.map_err(|e| raft_error(&e))?;
    }
    // At first start and after a restart alike: with the tick off (`single_voter_config`) no
    // election timer would ever elect it. A failure to send shows as no leader below.
    let _ = raft.trigger().elect(false).await;
    let is_leader = move |m: &RaftMetrics<TypeConfig>| m.state == ServerState::Leader && m.current_leader == Some(node);
    raft.wait(Some(lead_within))
        .metrics(is_leader, "single voter leads")
        .await
        .map_err(|_| StartError::NoLeader { group, waited: lead_within })?;
    Ok(())
}

/// The network of a group with one voter: there is no one to reach.
pub struct NoPeers;

/// A connection to a peer that does not exist.
pub struct NoPeer;

fn unreachable() -> Unreachable<TypeConfig> {
    Unreachable::from_string("a single-voter group has no peers")
}

impl RaftNetworkFactory<TypeConfig> for NoPeers {
    type Network = NoPeer;

    async fn new_client(&mut self, _target: NodeId, _node: &NodeAddr) -> NoPeer {
        NoPeer
    }
}

impl RaftNetworkV2<TypeConfig> for NoPeer {
    type SnapshotData = SnapshotData;

    async fn append_entries(&mut self, _rpc: AppendEntriesRequest<TypeConfig>, _option: RPCOption) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        Err(RPCError::Unreachable(unreachable()))
    }

    async fn vote(&mut self, _rpc: VoteRequest<TypeConfig>, _option: RPCOption) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        Err(RPCError::Unreachable(unreachable()))
    }

    async fn full_snapshot(
        &mut self,
        _vote: Vote,
        _snapshot: crate::machine::GroupSnapshot,
        _cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        Err(StreamingError::Unreachable(unreachable()))
    }
}
