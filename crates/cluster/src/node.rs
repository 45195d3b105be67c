//! A cluster node: its transport, its Raft groups (group 0, the metadata, and one per quorum queue)
//! and what is done across them: forwarding a command to its group's leader, the failure detector's
//! elections, membership and leadership changes, and the cluster's status.
//!
//! **Bootstrap.** Every node starts with the same `peers`; a group is created on each of its members
//! with the same member set, and each calls openraft's `initialize` only if the group has no state
//! yet (a node restarted on its data skips it and rejoins with its log; a node that already received
//! the leader's entries gets `NotAllowed`, which is fine). The identical initial membership entry on
//! every member makes concurrent initialization safe.
//!
//! **Timers: one per node, not per group.** openraft's per-group tick is off (`enable_tick:
//! false`): at 1,000 groups its ticks and heartbeats alone kept a core busy. Instead one node task,
//! [`SWEEP_EVERY`], looks at every group:
//! - a group this node leads whose log or commit index moved since the last look gets one
//!   heartbeat (a backstop: openraft sends a new commit index to the followers itself); an idle
//!   group sends nothing, and is looked at only every [`LEADER_RECHECK`]; every [`LEADER_REFRESH`]
//!   a leader heartbeats anyway (a backstop);
//! - a group with no leader, or whose leader's node the failure detector says is down, gets an
//!   election from its live voters, one at a time: a per-group rank (rotating with the group id)
//!   staggers them by [`ELECTION_STAGGER`], after [`LEADERLESS_GRACE`] when the leader is merely
//!   unknown (a start), at once when its node is down; retried every [`ELECTION_RETRY`]. Only a
//!   node that hears from a majority of the voters campaigns, and every election starts with a
//!   pre-vote: a node that cannot win (its log is behind, the others still hear the leader) leaves
//!   the terms alone, so it neither outbids the voter that can win nor deposes a live leader when
//!   its link heals. A leader that asks for a vote leads no more (it restarted and came back a
//!   follower): its followers elect as if its node were down (`leader_gone`);
//! - a group this node leads whose preferred member (the one that first led it) has been back for
//!   [`REBALANCE_SETTLE`] and has caught up is handed back to it (leaders spread over the nodes
//!   again after a node returns). A transfer starts only once the target has taken a blank entry
//!   the leader appends first (see `Handle::transfer_leader`), off the sweep; one that does not
//!   land is asked again (openraft's leader takes no writes while a transfer is pending);
//! - when a node comes (back) up, the groups this node leads that include it are heartbeaten at
//!   once, so a restarted node learns its leaders before it would start elections.
//!
//! **Leases.** openraft's leader lease is [`LEADER_LEASE`], the failure detector's silence limit: a
//! follower refuses pre-votes until that long after its leader's last message, and a leader takes
//! no new writes when no quorum answered it for that long (so a leader cut off from the majority
//! stops taking writes; it could not commit them anyway). An idle group's leader heartbeats rarely,
//! so a write refused for an expired lease renews it with one heartbeat round and is retried. A
//! voter that sees the old leader's node down grants a vote despite its lease (the request is
//! marked as a leadership transfer). Warren never serves lease reads, so granting early does not
//! let a deposed leader answer stale reads; a deposed leader cut off from the others cannot commit
//! and steps down at the first message of the new term.
//!
//! **Forwarding.** A command is sent to the leader this node knows; a leader whose node the
//! detector says is down is not sent anything (the proposal waits for the election), and a command
//! already sent stops waiting, its outcome unknown, once the target falls silent or another leader
//! is known: a stopped or cut-off leader never answers, and this node's later proposals to the
//! group wait behind it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use openraft::error::{ClientWriteError, ForwardReason, InitializeError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest, TransferLeaderResponse,
    VoteRequest, VoteResponse,
};
use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::type_config::alias::WatchReceiverOf;
use openraft::{ChangeMembers, RaftMetrics, ServerState, Snapshot};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

mod members;
mod rebalance;
pub use members::{GroupMembership, MembersStep, CATCH_UP_LAG};

use crate::detector::{Change, Detector};
use crate::transport::raft::{GroupNetworkFactory, SnapshotChunk, SnapshotMessage, SnapshotWire, SNAPSHOT_CHUNK};
use crate::transport::wire::{self, Dec, DecodeError, Enc, Wire};
use crate::transport::{BoxFuture, Handler, LinkKind, Rpc, RpcError, Transport, TransportConfig};
use crate::types::{Command, GroupId, NodeAddr, NodeId, Reply, TypeConfig, METADATA_GROUP};

/// How often the node looks at its groups (the node's one timer for all of them).
pub const SWEEP_EVERY: Duration = Duration::from_millis(200);
/// How often the sweep looks for nodes added to the cluster it has no address for.
const LEARN_PEERS_EVERY: Duration = Duration::from_secs(1);
/// Delay between the candidates of one group (by rank).
pub const ELECTION_STAGGER: Duration = Duration::from_millis(300);
/// How long a group may have no known leader (its leader's node not known down) before an
/// election: at a start, a leader usually makes itself known sooner.
pub const LEADERLESS_GRACE: Duration = Duration::from_millis(1500);
/// A candidate whose election did not end with a leader tries again after this long (plus its
/// rank's stagger). Elections start with a pre-vote, so a try that cannot win changes nothing.
pub const ELECTION_RETRY: Duration = Duration::from_millis(500);
/// openraft's leader lease (`election_timeout_max` in [`group_config`]): a follower refuses pre-votes
/// until this long after the last message from its leader, and a leader refuses new writes when no
/// quorum answered it for this long. Equal to the detector's `DOWN_AFTER`: by the time a leader is
/// found silent, its followers' leases have run out.
pub const LEADER_LEASE: Duration = Duration::from_millis(1200);
/// How long a write refused for an expired lease waits for one heartbeat round to renew it.
const LEASE_RENEW_WAIT: Duration = Duration::from_millis(1000);
/// A leader heartbeats its followers at least this often, even when idle.
pub const LEADER_REFRESH: Duration = Duration::from_secs(30);
/// How long [`ClusterNode::propose`] keeps trying (elections, forwarding) by default.
pub const PROPOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Timeout of one forwarded command or admin request to a peer.
const PEER_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a forwarded command's wait looks at the target's health and the group's leader.
const FORWARD_CHECK_EVERY: Duration = Duration::from_millis(50);
/// How long a voter asked for a vote waits for its leader's answer to a ping (see `link_closed`).
const VOTE_PING_TIMEOUT: Duration = Duration::from_millis(100);
/// Timeout of a peer's answer to a status request.
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);
/// A rebuilding group's read barrier waits this long for the leader and for its replica to apply
/// (a large backlog to fetch takes several tries) ...
const REBUILD_BARRIER_TIMEOUT: Duration = Duration::from_secs(5);
/// ... and is tried again after this.
const REBUILD_RETRY: Duration = Duration::from_millis(500);
/// How long a node whose elections keep failing waits for each peer's log length.
const STUCK_ELECTION_ASK: Duration = Duration::from_millis(300);

/// The Raft configuration of every group: openraft's own tick is off (the node's sweep drives
/// heartbeats and elections, see the module docs). `election_timeout_max` is openraft's leader
/// lease ([`LEADER_LEASE`]); `election_timeout_min` only bounds vote requests (3/4 of it) and must
/// exceed `heartbeat_interval + heartbeat_min_interval` plus a tick; `heartbeat_interval` bounds
/// an AppendEntries request (3/4 of it).
///
/// A restarted leader never leads again in its old term (`enable_leader_restore` off, openraft's
/// default is on). A leader commits with two followers' fsyncs and none of its own, so a leader
/// killed with writes still queued comes back with a shorter log than the one it replicated.
/// Leading again in the same term, it would give its next entries the log ids of those lost ones;
/// the followers, holding entries with the same ids, would take them as already there and ack,
/// and the restarted leader would apply and confirm messages no other node has
/// (`tests/cluster/test_raft_safety.py`). It waits for an election instead, which the others'
/// longer logs win.
pub fn group_config() -> openraft::Config {
    openraft::Config {
        enable_leader_restore: Some(false),
        cluster_name: "warren".to_owned(),
        enable_tick: false,
        heartbeat_interval: 500,
        heartbeat_min_interval: Some(200),
        election_timeout_min: 1000,
        election_timeout_max: LEADER_LEASE.as_millis() as u64,
        install_snapshot_timeout: 30_000,
        enable_pre_vote: Some(true),
        ..snapshot_policy()
    }
}

/// Test-only: `WARREN_TEST_SNAPSHOT_EVERY=<n>` makes every group snapshot each `n` entries and keep
/// `n / 5` entries after it (default: openraft's 5,000 and 1,000), so a test brings a follower back
/// through a snapshot without writing thousands of entries.
fn snapshot_policy() -> openraft::Config {
    let default = openraft::Config::default();
    match warren_store::test_hooks::var("WARREN_TEST_SNAPSHOT_EVERY").and_then(|v| v.parse::<u64>().ok()).filter(|n| *n > 0) {
        Some(n) => openraft::Config {
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(n),
            max_in_snapshot_log_to_keep: n / 5,
            ..default
        },
        None => default,
    }
}

/// How a node starts.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: NodeId,
    /// Where the cluster port listens.
    pub listen: SocketAddr,
    /// Every node of the cluster (this one included): id and cluster address.
    pub peers: Vec<(NodeId, String)>,
    pub secret: Vec<u8>,
    /// This node's AMQP address (shown in the status; told to peers).
    pub amqp_addr: String,
    /// The groups' Raft configuration ([`group_config`] unless tests want faster timers).
    pub raft: openraft::Config,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot listen on the cluster address {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("invalid Raft configuration: {0}")]
    Config(#[from] openraft::ConfigError),
    #[error("group {0} is already running on this node")]
    GroupExists(GroupId),
    #[error("group {0} is not on this node")]
    NoGroup(GroupId),
    #[error("node {0} has no known address")]
    UnknownNode(NodeId),
    #[error("group {group}: {error}")]
    Raft { group: GroupId, error: String },
}

/// Why a proposal has no reply.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ProposeError {
    /// No leader accepted it within the timeout (elections, unreachable nodes): it was not applied.
    #[error("group {0}: no leader accepted the command within {1:?}")]
    Timeout(GroupId, Duration),
    /// The command reached a leader but its fate is unknown (the connection or the leadership was
    /// lost before the reply): it may be applied. State machines deduplicate retries.
    #[error("group {0}: the outcome is unknown ({1})")]
    Unknown(GroupId, String),
    /// The group does not exist on any reachable node.
    #[error("group {0} is not on any reachable node")]
    NoGroup(GroupId),
    #[error("group {0}: {1}")]
    Fatal(GroupId, String),
}

/// What a local write said.
enum WriteOutcome {
    Applied(Reply),
    /// Rejected before being appended: safe to send elsewhere.
    NotLeader(Option<NodeId>),
    Unknown(String),
    Fatal(String),
}

impl WriteOutcome {
    fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        let mut e = Enc(&mut b);
        match self {
            WriteOutcome::Applied(r) => {
                e.u8(0);
                e.bytes(&r.0);
            }
            WriteOutcome::NotLeader(hint) => {
                e.u8(1);
                e.u64(hint.unwrap_or(0));
            }
            WriteOutcome::Unknown(m) => {
                e.u8(2);
                e.str(m);
            }
            WriteOutcome::Fatal(m) => {
                e.u8(3);
                e.str(m);
            }
        }
        b.freeze()
    }

    fn decode(b: Bytes) -> Result<WriteOutcome, DecodeError> {
        let mut d = Dec::new(b);
        let o = match d.u8()? {
            0 => WriteOutcome::Applied(Reply(d.bytes()?)),
            1 => WriteOutcome::NotLeader(Some(d.u64()?).filter(|id| *id != 0)),
            2 => WriteOutcome::Unknown(d.string()?),
            3 => WriteOutcome::Fatal(d.string()?),
            tag => return Err(DecodeError::BadTag { what: "propose outcome", tag }),
        };
        d.finish()?;
        Ok(o)
    }
}

/// A group's Raft, whatever its state machine: what the node does with it.
trait GroupHandle: Send + Sync + 'static {
    fn append(&self, req: AppendEntriesRequest<TypeConfig>) -> BoxFuture<Result<AppendEntriesResponse<TypeConfig>, String>>;
    fn vote(&self, req: VoteRequest<TypeConfig>, pre: bool) -> BoxFuture<Result<VoteResponse<TypeConfig>, String>>;
    fn install_snapshot(&self, msg: SnapshotMessage) -> BoxFuture<Result<SnapshotResponse<TypeConfig>, String>>;
    fn transfer_leader_rpc(&self, req: TransferLeaderRequest<TypeConfig>) -> BoxFuture<Result<TransferLeaderResponse<TypeConfig>, String>>;
    fn write(&self, cmd: Command) -> BoxFuture<WriteOutcome>;
    /// On the leader: confirms its leadership with a quorum (ReadIndex) and answers (as the reply,
    /// u64 little-endian) the log index a linearizable read must wait to have applied.
    fn read_index(&self) -> BoxFuture<WriteOutcome>;
    /// Waits (at most `timeout`) until this replica has applied entry `index`; whether it has.
    fn wait_applied(&self, index: u64, timeout: Duration) -> BoxFuture<bool>;
    fn metrics(&self) -> RaftMetrics<TypeConfig>;
    /// Starts an election: with a pre-vote first (`pre_vote`), or at once (the leader's process
    /// is known dead: its lease, which a pre-vote respects, would only delay the failover).
    fn elect(&self, pre_vote: bool) -> BoxFuture<()>;
    /// openraft's `initialize`; a group that already has state (`NotAllowed`) is fine.
    fn initialize(&self, nodes: BTreeMap<NodeId, NodeAddr>) -> BoxFuture<Result<(), String>>;
    fn heartbeat(&self) -> BoxFuture<()>;
    /// The member recorded to lead the group first, if any (see [`preferred_member`]).
    fn preferred(&self) -> Option<NodeId>;
    /// What the sweep looks at: (state, leader, last log index, committed index).
    fn summary(&self) -> (ServerState, Option<NodeId>, Option<u64>, Option<u64>);
    /// For a leader: its term, the group's preferred member and every voter's lag behind the
    /// leader's last log index (None: not known to have anything yet).
    fn leader_view(&self, group: GroupId) -> Option<(u64, Option<NodeId>, Vec<(NodeId, Option<u64>)>)>;
    /// Hands the leadership to `to` (see the implementation for the entry appended first). Once
    /// this returned `Ok`, the leader takes no writes until the target won or the term changed.
    fn transfer_leader(&self, to: NodeId) -> BoxFuture<Result<(), String>>;
    /// Whether this node leads the group in the term it started a transfer in (so takes no writes).
    fn transfer_pending(&self) -> bool;
    fn change_membership(&self, change: ChangeMembers<NodeId, NodeAddr>, learner: Option<(NodeId, NodeAddr)>) -> BoxFuture<WriteOutcome>;
    fn shutdown(&self) -> BoxFuture<()>;
}

struct Handle<SM: RaftStateMachine<TypeConfig>> {
    raft: openraft::Raft<TypeConfig, SM>,
    /// The group's metrics, kept: `raft.metrics()` clones a watch receiver (atomic reference
    /// counting on a shared, usually cold, cache line), and the sweep reads every group's metrics
    /// five times a second (most of the node's idle CPU with 1,000 groups).
    metrics: WatchReceiverOf<TypeConfig, RaftMetrics<TypeConfig>>,
    /// The member recorded to lead the group first (see [`preferred_member`]).
    preferred: Option<NodeId>,
    /// The term in which this node, leading, last started a leadership transfer.
    transferring: Arc<parking_lot::Mutex<Option<u64>>>,
}

/// How long a transfer waits for its target to take the blank entry appended first.
const TRANSFER_PRIME_WAIT: Duration = Duration::from_secs(1);

/// On a leader: the index `peer` is known to have (None: nothing known yet).
fn matched_index(m: &RaftMetrics<TypeConfig>, peer: NodeId) -> Option<u64> {
    m.replication.as_ref().and_then(|r| r.get(&peer)).and_then(|l| l.as_ref()).map(|l| l.index)
}

fn write_outcome<T>(r: Result<T, RaftError<TypeConfig, ClientWriteError<TypeConfig>>>, ok: impl FnOnce(T) -> Reply) -> WriteOutcome {
    match r {
        Ok(t) => WriteOutcome::Applied(ok(t)),
        Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => not_leader(&f),
        Err(RaftError::APIError(e @ ClientWriteError::LogEntryDiscarded(_))) => WriteOutcome::Unknown(e.to_string()),
        Err(RaftError::APIError(e)) => WriteOutcome::Fatal(e.to_string()),
        Err(RaftError::Fatal(e)) => WriteOutcome::Fatal(e.to_string()),
    }
}

/// A command this replica refused because it does not lead (or no longer takes writes). A leader
/// handing its leadership over names the target, which does not lead yet and may never (it can be
/// stopped or cut off, not yet seen down): no hint then, so the caller retries through its own view
/// of the leader instead of sending the command where its outcome could only become unknown.
fn not_leader(f: &openraft::error::ForwardToLeader<TypeConfig>) -> WriteOutcome {
    match f.reason {
        ForwardReason::LeadershipTransfer => WriteOutcome::NotLeader(None),
        _ => WriteOutcome::NotLeader(f.leader_id),
    }
}

/// Heartbeats the group's followers and waits (at most [`LEASE_RENEW_WAIT`]) until a quorum has
/// answered one sent after the last quorum acknowledgement, so the leader takes writes again.
async fn renew_lease<SM: RaftStateMachine<TypeConfig>>(raft: &openraft::Raft<TypeConfig, SM>) {
    use openraft::async_runtime::WatchReceiver;
    let before = raft.metrics().borrow_watched().last_quorum_acked;
    if raft.trigger().heartbeat().await.is_err() {
        return;
    }
    let _ = raft
        .wait(Some(LEASE_RENEW_WAIT))
        .metrics(|m| m.state != ServerState::Leader || m.last_quorum_acked > before, "leader lease renewed")
        .await;
}

impl<SM> GroupHandle for Handle<SM>
where
    SM: RaftStateMachine<TypeConfig>,
    SM::SnapshotData: SnapshotWire,
{
    fn append(&self, req: AppendEntriesRequest<TypeConfig>) -> BoxFuture<Result<AppendEntriesResponse<TypeConfig>, String>> {
        let raft = self.raft.clone();
        Box::pin(async move { raft.append_entries(req).await.map_err(|e| e.to_string()) })
    }

    fn vote(&self, req: VoteRequest<TypeConfig>, pre: bool) -> BoxFuture<Result<VoteResponse<TypeConfig>, String>> {
        let raft = self.raft.clone();
        Box::pin(async move {
            let r = if pre { raft.pre_vote(req).await } else { raft.vote(req).await };
            r.map_err(|e| e.to_string())
        })
    }

    fn install_snapshot(&self, msg: SnapshotMessage) -> BoxFuture<Result<SnapshotResponse<TypeConfig>, String>> {
        let raft = self.raft.clone();
        Box::pin(async move {
            let data = SM::SnapshotData::from_wire(msg.data)?;
            raft.install_full_snapshot(msg.vote, Snapshot { meta: msg.meta, snapshot: data }).await.map_err(|e| e.to_string())
        })
    }

    fn transfer_leader_rpc(&self, req: TransferLeaderRequest<TypeConfig>) -> BoxFuture<Result<TransferLeaderResponse<TypeConfig>, String>> {
        let raft = self.raft.clone();
        Box::pin(async move { raft.handle_transfer_leader(req).await.map_err(|e| e.to_string()) })
    }

    fn write(&self, cmd: Command) -> BoxFuture<WriteOutcome> {
        let raft = self.raft.clone();
        Box::pin(async move {
            let mut renewed = false;
            loop {
                match raft.client_write(cmd.clone()).await {
                    // The leader's quorum lease ran out (an idle group heartbeats rarely, see
                    // `sweep`): the command was not appended. One heartbeat round renews the lease
                    // when a quorum still answers; a leader cut off from it stays refused.
                    Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))
                        if f.reason == ForwardReason::LeaseExpired && !renewed =>
                    {
                        renewed = true;
                        renew_lease(&raft).await;
                    }
                    r => return write_outcome(r, |r| r.data),
                }
            }
        })
    }

    fn read_index(&self) -> BoxFuture<WriteOutcome> {
        let raft = self.raft.clone();
        Box::pin(async move {
            use openraft::error::LinearizableReadError;
            match raft.get_read_log_id(openraft::raft::ReadPolicy::ReadIndex).await {
                Ok((read, _)) => WriteOutcome::Applied(Reply(Bytes::copy_from_slice(&read.log_id().index().to_le_bytes()))),
                Err(RaftError::APIError(LinearizableReadError::ForwardToLeader(f))) => not_leader(&f),
                // No quorum answered the leader: it may not lead any more; try again until the deadline.
                Err(RaftError::APIError(LinearizableReadError::QuorumNotEnough(_))) => WriteOutcome::NotLeader(None),
                Err(RaftError::Fatal(e)) => WriteOutcome::Fatal(e.to_string()),
            }
        })
    }

    fn wait_applied(&self, index: u64, timeout: Duration) -> BoxFuture<bool> {
        let raft = self.raft.clone();
        Box::pin(async move { raft.wait(Some(timeout)).applied_index_at_least(Some(index), "read barrier").await.is_ok() })
    }

    fn metrics(&self) -> RaftMetrics<TypeConfig> {
        use openraft::async_runtime::WatchReceiver;
        self.metrics.borrow_watched().clone()
    }

    fn elect(&self, pre_vote: bool) -> BoxFuture<()> {
        let raft = self.raft.clone();
        Box::pin(async move {
            // Pre-vote first, as a rule: a node that cannot win (its log is behind, the others
            // still hear the leader, it is cut off) leaves every term as it is, so it neither
            // disturbs a live leader when it comes back nor outbids the voter that can win.
            let _ = raft.trigger().elect(pre_vote).await;
        })
    }

    fn initialize(&self, nodes: BTreeMap<NodeId, NodeAddr>) -> BoxFuture<Result<(), String>> {
        let raft = self.raft.clone();
        Box::pin(async move {
            match raft.initialize(nodes).await {
                Ok(()) | Err(RaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        })
    }

    fn heartbeat(&self) -> BoxFuture<()> {
        let raft = self.raft.clone();
        Box::pin(async move {
            let _ = raft.trigger().heartbeat().await;
        })
    }

    fn preferred(&self) -> Option<NodeId> {
        self.preferred
    }

    fn summary(&self) -> (ServerState, Option<NodeId>, Option<u64>, Option<u64>) {
        use openraft::async_runtime::WatchReceiver;
        let m = self.metrics.borrow_watched();
        (m.state, m.current_leader, m.last_log_index, m.local_committed.map(|c| c.index))
    }

    fn leader_view(&self, group: GroupId) -> Option<(u64, Option<NodeId>, Vec<(NodeId, Option<u64>)>)> {
        use openraft::async_runtime::WatchReceiver;
        let m = self.metrics.borrow_watched();
        if m.state != ServerState::Leader {
            return None;
        }
        let voters: BTreeSet<NodeId> = m.membership_config.membership().voter_ids().collect();
        let last = m.last_log_index.unwrap_or(0);
        let lags = voters
            .iter()
            .map(|v| {
                (*v, matched_index(&m, *v).map(|i| last.saturating_sub(i)))
            })
            .collect();
        Some((m.current_term, preferred_member(group, &voters, self.preferred), lags))
    }

    fn transfer_leader(&self, to: NodeId) -> BoxFuture<Result<(), String>> {
        let raft = self.raft.clone();
        let transferring = self.transferring.clone();
        // A transfer already pending (sent again to another target) cannot append: the leader
        // takes no writes until it lands.
        let pending = self.transfer_pending();
        Box::pin(async move {
            if pending {
                return raft.trigger().transfer_leader(to).await.map_err(|e| e.to_string());
            }
            // openraft's target takes the leadership only once it has flushed, under this leader's
            // vote, an entry at or past the leader's last one. A target restarted since this
            // leader's last append has flushed nothing under it (openraft starts a node's flush
            // point at its vote alone, whatever its log holds), so it refuses every transfer of an
            // idle group, while the leader, its transfer pending, takes no writes and sends no
            // heartbeats, and nothing is ever appended again: the group stalls for good (a
            // dead-letter target, idle while its source elected, in CI on 2026-11-30). So append
            // a blank entry first and wait until the target has it.
            let mut renewed = false;
            let blank = loop {
                match raft.write_blank().await {
                    Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))
                        if f.reason == ForwardReason::LeaseExpired && !renewed =>
                    {
                        renewed = true;
                        renew_lease(&raft).await;
                    }
                    Ok(r) => break r.log_id.index,
                    Err(e) => return Err(format!("cannot append the entry the transfer target must have first: {e}")),
                }
            };
            let term = raft
                .wait(Some(TRANSFER_PRIME_WAIT))
                .metrics(|m| m.state != ServerState::Leader || matched_index(m, to).is_some_and(|i| i >= blank), "transfer target has the leader's blank entry")
                .await
                .map_err(|_| format!("no transfer started: node {to} did not take the leader's entry {blank} within {TRANSFER_PRIME_WAIT:?} (down, cut off or far behind?); the leader keeps the group"))
                .and_then(|m| if m.state == ServerState::Leader { Ok(m.current_term) } else { Err("no longer the leader".to_owned()) })?;
            raft.trigger().transfer_leader(to).await.map_err(|e| e.to_string())?;
            *transferring.lock() = Some(term);
            Ok(())
        })
    }

    fn transfer_pending(&self) -> bool {
        use openraft::async_runtime::WatchReceiver;
        let m = self.metrics.borrow_watched();
        m.state == ServerState::Leader && *self.transferring.lock() == Some(m.current_term)
    }

    fn change_membership(&self, change: ChangeMembers<NodeId, NodeAddr>, learner: Option<(NodeId, NodeAddr)>) -> BoxFuture<WriteOutcome> {
        let raft = self.raft.clone();
        Box::pin(async move {
            // As in `write`: a leader whose lease ran out (an idle group) renews it once.
            let lease_expired = |r: &Result<_, RaftError<TypeConfig, ClientWriteError<TypeConfig>>>| {
                matches!(r, Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) if f.reason == ForwardReason::LeaseExpired)
            };
            if let Some((id, addr)) = learner {
                let mut added = raft.add_learner(id, addr.clone(), true).await;
                if lease_expired(&added) {
                    renew_lease(&raft).await;
                    added = raft.add_learner(id, addr, true).await;
                }
                if let o @ (WriteOutcome::NotLeader(_) | WriteOutcome::Unknown(_) | WriteOutcome::Fatal(_)) = write_outcome(added, |_| Reply::default()) {
                    return o;
                }
            }
            let mut changed = raft.change_membership(change.clone(), false).await;
            if lease_expired(&changed) {
                renew_lease(&raft).await;
                changed = raft.change_membership(change, false).await;
            }
            write_outcome(changed, |_| Reply::default())
        })
    }

    fn shutdown(&self) -> BoxFuture<()> {
        let raft = self.raft.clone();
        Box::pin(async move {
            let _ = raft.shutdown().await;
        })
    }
}

struct NodeInner {
    id: NodeId,
    transport: Transport,
    /// Addresses of the nodes this node knows (the initial peers and nodes added since).
    addrs: RwLock<BTreeMap<NodeId, NodeAddr>>,
    groups: RwLock<HashMap<GroupId, Arc<dyn GroupHandle>>>,
    /// Bumped after every change of `groups`: the sweep rebuilds its list of groups only then.
    groups_version: AtomicU64,
    /// New groups waiting for their preferred member to initialize them: (voters, since).
    pending_init: parking_lot::Mutex<HashMap<GroupId, (BTreeMap<NodeId, NodeAddr>, Instant)>>,
    /// Groups whose log this node lost (store files missing or cut short) and rebuilds from the
    /// other members (see [`ClusterNode::rebuild_group`]): until it has applied everything committed,
    /// it grants no vote and does not campaign in them.
    rebuilding: parking_lot::Mutex<HashSet<GroupId>>,
    /// Groups whose leader, as this node knows it, asked for a (pre-)vote: it no longer leads
    /// (restarted: a restarted leader never leads again in its old term), though its node answers;
    /// and the term it campaigned in.
    deposed: parking_lot::Mutex<HashMap<GroupId, (NodeId, u64)>>,
    /// Bumped at every change the detector sees and every deposed leader: the sweep looks again
    /// at once at the groups it follows or leads quietly (otherwise only every
    /// [`FOLLOWER_RECHECK`], [`LEADER_RECHECK`]).
    liveness_version: AtomicU64,
    /// Wakes the sweep before its tick: a node went down, and the groups it led elect now.
    sweep_now: Arc<tokio::sync::Notify>,
    detector: Detector,
    raft_config: Arc<openraft::Config>,
    /// Leadership transfers under watch and rebalancing (`node::rebalance`).
    rebalance: rebalance::Rebalancer,
    stop: watch::Sender<bool>,
    /// Answers `Rpc::Bodies` (the server's quorum queues).
    body_source: RwLock<Option<BodySource>>,
    /// Snapshots arriving in pieces (`Rpc::SnapshotChunk`), by group: one at a time per group.
    snapshot_parts: parking_lot::Mutex<HashMap<GroupId, PartialSnapshot>>,
    /// Answers `Rpc::Classic` (the server's classic queues).
    classic_service: RwLock<Option<ClassicService>>,
    /// Records quorum queues' members (the server's broker, through the metadata group).
    queue_members: RwLock<Option<Arc<dyn QueueMembers>>>,
}

/// A change of the members of quorum queues' groups, asked by `warren ctl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MembersChange {
    /// Every group with a member on the node gets another member in its place (where the cluster
    /// has one), and loses that one.
    Remove(NodeId),
    /// Every group without a member on the node gets one.
    Grow(NodeId),
}

/// What records the members of quorum queues' groups (the server's broker, through the metadata
/// group). The groups' leaders then move their voters to them ([`ClusterNode::reconcile_members`]).
pub trait QueueMembers: Send + Sync {
    /// Records the change for every quorum queue it concerns; answers what it did.
    fn change(&self, change: MembersChange) -> BoxFuture<Result<String, String>>;
    /// Whether the group's members are recorded (its leader follows them, so `remove-node` leaves
    /// the group alone).
    fn follows_recorded(&self, group: GroupId) -> bool;
}

/// What answers a peer's body request for a group: (group, request) → answer.
pub type BodySource = Arc<dyn Fn(GroupId, Bytes) -> BoxFuture<Result<Bytes, String>> + Send + Sync>;

/// What answers a peer's request about classic queues: request → answer.
pub type ClassicService = Arc<dyn Fn(NodeId, Bytes) -> BoxFuture<Result<Bytes, String>> + Send + Sync>;

/// A cluster member. Cheap to clone.
#[derive(Clone)]
pub struct ClusterNode {
    inner: Arc<NodeInner>,
}

/// Membership and leadership operations `warren ctl` asks for.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum AdminRequest {
    /// Adds a node to the metadata group (as a learner, then a voter).
    AddNode { node: NodeId, addr: String },
    /// Removes a node from the cluster: quorum queues' groups get another member in its place
    /// (where the cluster has one), then it leaves the metadata group and every other group.
    RemoveNode { node: NodeId },
    /// Adds a member on `node` to every quorum queue's group that lacks one (RabbitMQ's
    /// `rabbitmq-queues grow`).
    Grow { node: NodeId },
    /// Moves a group's leadership to a node.
    TransferLeader { group: GroupId, node: NodeId },
    /// (between nodes) Remove `node` from the groups this node leads.
    RemoveFromLedGroups { node: NodeId },
    /// (between nodes) The group's membership as the node asked knows it ([`GroupMembership`]).
    GroupMembership { group: GroupId },
    /// Rebalances leadership on every node now (waiving the settle time for a while).
    Rebalance,
    /// (between nodes) Rebalance the groups this node leads now.
    RebalanceHere,
}

/// A member as one node sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemberStatus {
    pub id: NodeId,
    pub cluster_addr: String,
    pub amqp_addr: String,
    /// Answering the failure detector's pings (always true for the node asked).
    pub reachable: bool,
}

/// A follower as its group's leader sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FollowerStatus {
    pub id: NodeId,
    /// The last log index known replicated to it.
    pub matched: Option<u64>,
    /// Entries it is behind the leader's last log index.
    pub lag: Option<u64>,
}

/// One group on one node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GroupStatus {
    pub group: GroupId,
    /// The node this view is from.
    pub seen_by: NodeId,
    /// "leader", "follower", "candidate", "learner" or "shutdown".
    pub state: String,
    pub term: u64,
    pub leader: Option<NodeId>,
    pub voters: Vec<NodeId>,
    pub learners: Vec<NodeId>,
    pub last_log_index: Option<u64>,
    pub committed: Option<u64>,
    pub applied: Option<u64>,
    /// Only in the leader's view.
    pub followers: Vec<FollowerStatus>,
}

/// The cluster as seen from one node (and, in `groups`, from each group's leader when reachable).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClusterStatus {
    pub node_id: NodeId,
    pub members: Vec<MemberStatus>,
    pub groups: Vec<GroupStatus>,
}

fn group_status(group: GroupId, m: &RaftMetrics<TypeConfig>) -> GroupStatus {
    let state = match m.state {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    };
    let last = m.last_log_index;
    let followers = m
        .replication
        .as_ref()
        .map(|r| {
            r.iter()
                .filter(|(id, _)| **id != m.id)
                .map(|(id, matched)| {
                    let matched = matched.as_ref().map(|l| l.index);
                    let lag = last.map(|l| l.saturating_sub(matched.unwrap_or(0)));
                    FollowerStatus { id: *id, matched, lag }
                })
                .collect()
        })
        .unwrap_or_default();
    GroupStatus {
        group,
        seen_by: m.id,
        state: state.to_owned(),
        term: m.current_term,
        leader: m.current_leader,
        voters: m.membership_config.membership().voter_ids().collect(),
        learners: m.membership_config.membership().learner_ids().collect(),
        last_log_index: last,
        committed: m.local_committed.map(|c| c.index),
        applied: m.last_applied.map(|a| a.index),
        followers,
    }
}

impl ClusterNode {
    /// Listens on the cluster port, connects to the peers and starts the failure detector. Groups
    /// are started with [`ClusterNode::start_group`].
    pub async fn start(config: NodeConfig) -> Result<ClusterNode, NodeError> {
        let raft_config = Arc::new(config.raft.clone().validate()?);
        let transport = Transport::start(TransportConfig {
            node_id: config.node_id,
            listen: config.listen,
            peers: config.peers.clone(),
            secret: config.secret.clone(),
            amqp_addr: config.amqp_addr.clone(),
        })
        .await
        .map_err(|source| NodeError::Listen { addr: config.listen, source })?;
        let addrs = config
            .peers
            .iter()
            .map(|(id, addr)| {
                let amqp = if *id == config.node_id { config.amqp_addr.clone() } else { String::new() };
                (*id, NodeAddr { cluster_addr: addr.clone(), amqp_addr: amqp })
            })
            .collect();
        let (stop, _) = watch::channel(false);
        let inner = Arc::new(NodeInner {
            id: config.node_id,
            transport: transport.clone(),
            addrs: RwLock::new(addrs),
            groups: RwLock::new(HashMap::new()),
            groups_version: AtomicU64::new(0),
            pending_init: parking_lot::Mutex::new(HashMap::new()),
            rebuilding: parking_lot::Mutex::new(HashSet::new()),
            deposed: parking_lot::Mutex::new(HashMap::new()),
            liveness_version: AtomicU64::new(0),
            sweep_now: Arc::new(tokio::sync::Notify::new()),
            detector: Detector::default(),
            raft_config,
            rebalance: rebalance::Rebalancer::default(),
            stop,
            body_source: RwLock::new(None),
            snapshot_parts: parking_lot::Mutex::new(HashMap::new()),
            classic_service: RwLock::new(None),
            queue_members: RwLock::new(None),
        });
        transport.set_handler(Arc::new(NodeHandler(Arc::downgrade(&inner))));
        let node = ClusterNode { inner };
        for peer in transport.peers() {
            node.watch_peer(peer);
        }
        tokio::spawn(sweep(Arc::downgrade(&node.inner), node.inner.stop.subscribe()));
        tokio::spawn(rebalance::run(Arc::downgrade(&node.inner), node.inner.stop.subscribe()));
        tracing::info!(node_id = config.node_id, listen = %transport.local_addr(), peers = config.peers.len(), "cluster node started");
        Ok(node)
    }

    fn watch_peer(&self, peer: NodeId) {
        let weak = Arc::downgrade(&self.inner);
        let detector = self.inner.detector.clone();
        let transport = self.inner.transport.clone();
        let stop = self.inner.stop.subscribe();
        tokio::spawn(async move {
            detector
                .watch(transport, peer, stop, move |change| {
                    let Some(inner) = weak.upgrade() else { return };
                    inner.liveness_version.fetch_add(1, Ordering::Release);
                    match change {
                        Change::Up(p) => {
                            tracing::info!(peer = p, "cluster node up");
                            ClusterNode { inner }.announce_leadership_to(p);
                        }
                        Change::Down(p) => {
                            tracing::warn!(peer = p, "cluster node down: the groups it led elect new leaders");
                            inner.sweep_now.notify_one();
                        }
                    }
                })
                .await
        });
    }

    /// Links to a node not in this node's `--peers` (one added at runtime) and watches it. The node
    /// `warren ctl add-node` went to and the metadata group's leader learn it from the request; every
    /// other node from the metadata group's membership (`sweep`), or quorum groups with it as a
    /// member could not start here ("no known address").
    fn learn_peer(&self, node: NodeId, addr: &str) {
        if node == self.inner.id {
            return;
        }
        self.inner.transport.add_peer(node, addr);
        let added = self.inner.addrs.write().insert(node, NodeAddr { cluster_addr: addr.to_owned(), amqp_addr: String::new() }).is_none();
        if added {
            tracing::info!(peer = node, addr, "learnt a node added to the cluster");
            self.watch_peer(node);
        }
    }

    /// Learns the nodes of the metadata group's membership this node has no address for.
    fn learn_peers_from_metadata(&self) {
        let Some(h) = self.inner.groups.read().get(&METADATA_GROUP).cloned() else { return };
        let membership = h.metrics().membership_config;
        let unknown: Vec<(NodeId, String)> = {
            let addrs = self.inner.addrs.read();
            membership.nodes().filter(|(id, _)| **id != self.inner.id && !addrs.contains_key(*id)).map(|(id, a)| (*id, a.cluster_addr.clone())).collect()
        };
        for (node, addr) in unknown {
            self.learn_peer(node, &addr);
        }
    }

    pub fn node_id(&self) -> NodeId {
        self.inner.id
    }

    pub fn transport(&self) -> &Transport {
        &self.inner.transport
    }

    /// The Raft configuration groups are started with.
    pub fn raft_config(&self) -> Arc<openraft::Config> {
        self.inner.raft_config.clone()
    }

    /// Whether the failure detector hears from `peer`.
    pub fn is_reachable(&self, peer: NodeId) -> bool {
        peer == self.inner.id || self.inner.detector.is_up(peer)
    }

    /// Whether `peer` is known down: it answered once and no longer does, or never did for a
    /// while. A peer not heard from *yet* (just after a start) is not: a count that must include
    /// every live node asks it anyway.
    pub fn is_known_down(&self, peer: NodeId) -> bool {
        peer != self.inner.id && self.inner.detector.is_down(peer)
    }

    /// The address of a node this node knows.
    pub fn node_addr(&self, id: NodeId) -> Option<NodeAddr> {
        self.inner.addrs.read().get(&id).cloned()
    }

    /// Starts group `group` on this node with its log store and state machine, and registers it so
    /// the transport serves its RPCs. A group with no state yet is initialized with `members` as
    /// its voters (each member does the same; see the module docs) by its preferred member:
    /// `preferred` if it is one of them (a quorum queue's declaring node), else one picked by the
    /// group id ([`preferred_member`]), which the sweep also hands leadership back to. With no
    /// `members`, this node joins a group that runs elsewhere: nothing is initialized, and the
    /// group's leader adds it ([`ClusterNode::reconcile_members`]). Returns the group's `Raft`.
    pub async fn start_group<LS, SM>(
        &self,
        group: GroupId,
        members: &BTreeSet<NodeId>,
        preferred: Option<NodeId>,
        log_store: LS,
        machine: SM,
    ) -> Result<openraft::Raft<TypeConfig, SM>, NodeError>
    where
        LS: RaftLogStorage<TypeConfig>,
        SM: RaftStateMachine<TypeConfig>,
        SM::SnapshotData: SnapshotWire,
    {
        let raft_err = |e: &dyn std::fmt::Display| NodeError::Raft { group, error: e.to_string() };
        if self.inner.groups.read().contains_key(&group) {
            return Err(NodeError::GroupExists(group));
        }
        let mut nodes = BTreeMap::new();
        for id in members {
            nodes.insert(*id, self.node_addr(*id).ok_or(NodeError::UnknownNode(*id))?);
        }
        let network = GroupNetworkFactory::<SM::SnapshotData>::new(self.inner.transport.clone(), group);
        let raft = openraft::Raft::new(self.inner.id, self.inner.raft_config.clone(), network, log_store, machine)
            .await
            .map_err(|e| raft_err(&e))?;
        // (No lock guard may live across an await: the future must be Send.)
        let registered = {
            let mut groups = self.inner.groups.write();
            let fresh = !groups.contains_key(&group);
            if fresh {
                groups.insert(group, Arc::new(Handle { raft: raft.clone(), metrics: raft.metrics(), preferred, transferring: Default::default() }));
                self.inner.groups_version.fetch_add(1, Ordering::Release);
            }
            fresh
        };
        if !registered {
            let _ = raft.shutdown().await;
            return Err(NodeError::GroupExists(group));
        }
        if self.is_rebuilding(group) {
            // It joins the running group like a new member; initializing it here would give it a log
            // of its own.
            self.spawn_rebuild_watch(group);
            return Ok(raft);
        }
        // No members: this node joins a running group (`reconcile_members` on its leader adds it).
        if !members.is_empty() && !raft.is_initialized().await.map_err(|e| raft_err(&e))? {
            if preferred_member(group, members, preferred) == Some(self.inner.id) {
                match raft.initialize(nodes).await {
                    Ok(()) => tracing::debug!(group, "group initialized"),
                    // Entries from the leader arrived first: the group is already part of the cluster.
                    Err(RaftError::APIError(InitializeError::NotAllowed(_))) => {}
                    Err(e) => return Err(raft_err(&e)),
                }
            } else {
                self.inner.pending_init.lock().insert(group, (nodes, Instant::now()));
            }
        }
        Ok(raft)
    }

    /// Marks group `group` (not started yet) as rebuilding: this node lost its stored log and
    /// starts it empty, as a new member, and the leader brings it back (entries, or a snapshot and
    /// the message bodies it names). A member that forgot what it acknowledged must not help elect
    /// a leader that lacks it (Raft's safety counts on every vote coming from a log that holds what
    /// its node acknowledged), so until a linearizable read barrier says this replica has applied
    /// everything committed before it, the node grants no vote or pre-vote in the group and never
    /// campaigns there.
    pub fn rebuild_group(&self, group: GroupId) {
        self.inner.rebuilding.lock().insert(group);
    }

    /// Whether this node still rebuilds group `group` (see [`ClusterNode::rebuild_group`]).
    pub fn is_rebuilding(&self, group: GroupId) -> bool {
        self.inner.rebuilding.lock().contains(&group)
    }

    /// Ends the rebuild of `group` once a read barrier passes: the leader confirmed its leadership
    /// with a quorum and this replica applied its read index, so it holds every committed entry.
    fn spawn_rebuild_watch(&self, group: GroupId) {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let started = Instant::now();
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let node = ClusterNode { inner };
                if node.handle(group).is_none() {
                    node.inner.rebuilding.lock().remove(&group);
                    return; // stopped or removed meanwhile
                }
                match node.linearize(group, REBUILD_BARRIER_TIMEOUT).await {
                    Ok(()) => {
                        node.inner.rebuilding.lock().remove(&group);
                        let m = node.handle(group).map(|h| h.metrics());
                        tracing::warn!(group, applied = ?m.and_then(|m| m.last_applied.map(|l| l.index)), elapsed_ms = started.elapsed().as_millis() as u64,
                            "group rebuilt from the other members after this node lost its log: it votes again");
                        return;
                    }
                    Err(e) => tracing::info!(group, error = %e, "rebuilding the group from the other members: not caught up yet"),
                }
                drop(node);
                tokio::time::sleep(REBUILD_RETRY).await;
            }
        });
    }

    /// Stops group `group` on this node (its stored log stays; removing it is the caller's).
    pub async fn stop_group(&self, group: GroupId) -> Result<(), NodeError> {
        let h = self.inner.groups.write().remove(&group).ok_or(NodeError::NoGroup(group))?;
        self.inner.groups_version.fetch_add(1, Ordering::Release);
        self.inner.snapshot_parts.lock().remove(&group);
        h.shutdown().await;
        Ok(())
    }

    /// Sets what answers peers' body requests (`Rpc::Bodies`).
    pub fn set_body_source(&self, source: BodySource) {
        *self.inner.body_source.write() = Some(source);
    }

    /// Asks `peer` for bodies of `group` (its body source answers); the bytes are the caller's.
    pub async fn fetch_bodies(&self, peer: NodeId, group: GroupId, request: &[u8], timeout: Duration) -> Result<Bytes, RpcError> {
        self.inner.transport.request(peer, LinkKind::Bulk, Rpc::Bodies, group, request, timeout).await
    }

    /// Sets what records quorum queues' members (`warren ctl remove-node`, `grow`).
    pub fn set_queue_members(&self, service: Arc<dyn QueueMembers>) {
        *self.inner.queue_members.write() = Some(service);
    }

    /// Sets what answers peers' requests about classic queues (`Rpc::Classic`).
    pub fn set_classic_service(&self, service: ClassicService) {
        *self.inner.classic_service.write() = Some(service);
    }

    /// Sends a request about classic queues to `peer`; the bytes are the caller's.
    pub async fn classic_request(&self, peer: NodeId, request: &[u8], timeout: Duration) -> Result<Bytes, RpcError> {
        self.inner.transport.request(peer, LinkKind::Bulk, Rpc::Classic, 0, request, timeout).await
    }

    /// The groups running on this node.
    pub fn groups(&self) -> Vec<GroupId> {
        let mut g: Vec<GroupId> = self.inner.groups.read().keys().copied().collect();
        g.sort_unstable();
        g
    }

    fn handle(&self, group: GroupId) -> Option<Arc<dyn GroupHandle>> {
        self.inner.groups.read().get(&group).cloned()
    }

    /// The group's leader as this node knows it.
    pub fn leader(&self, group: GroupId) -> Option<NodeId> {
        self.handle(group).and_then(|h| h.metrics().current_leader)
    }

    /// Applies `command` in `group` through its leader, wherever it is, and returns the state
    /// machine's reply: written locally when this node leads, else forwarded to the leader (or,
    /// when the group is not on this node or has no known leader, to the peers in turn), following
    /// leader hints and retrying through elections for up to `timeout`.
    pub async fn propose(&self, group: GroupId, command: Command, timeout: Duration) -> Result<Reply, ProposeError> {
        self.to_leader(group, Some(command), timeout).await
    }

    /// A linearizable read barrier on `group`: once it returns, this node's replica has applied
    /// every entry committed before it was called. The group's leader confirms its leadership with
    /// a quorum (a heartbeat round: no log entry, no fsync) and names its read index; this node
    /// waits until it has applied that far.
    pub async fn linearize(&self, group: GroupId, timeout: Duration) -> Result<(), ProposeError> {
        let deadline = Instant::now() + timeout;
        let reply = self.to_leader(group, None, timeout).await?;
        let index = <[u8; 8]>::try_from(&reply.0[..])
            .map(u64::from_le_bytes)
            .map_err(|_| ProposeError::Fatal(group, format!("a read index of {} bytes", reply.0.len())))?;
        let Some(h) = self.handle(group) else { return Err(ProposeError::NoGroup(group)) };
        if h.wait_applied(index, deadline.saturating_duration_since(Instant::now())).await {
            Ok(())
        } else {
            Err(ProposeError::Timeout(group, timeout))
        }
    }

    /// `command` (None: a read index) for `group`'s leader: written here if this node leads,
    /// else forwarded to the leader, following hints, until `timeout`.
    async fn to_leader(&self, group: GroupId, command: Option<Command>, timeout: Duration) -> Result<Reply, ProposeError> {
        let deadline = Instant::now() + timeout;
        let (rpc, payload) = match &command {
            Some(c) => (Rpc::Propose, c.0.clone()),
            None => (Rpc::ReadIndex, Bytes::new()),
        };
        let mut hint: Option<NodeId> = None;
        let mut tried_peers: usize = 0;
        loop {
            if Instant::now() >= deadline {
                return Err(ProposeError::Timeout(group, timeout));
            }
            let local = self.handle(group);
            let target = hint.take().or_else(|| local.as_ref().and_then(|h| h.metrics().current_leader));
            let outcome = match (target, &local) {
                (Some(t), Some(h)) if t == self.inner.id => match &command {
                    Some(c) => h.write(c.clone()).await,
                    None => h.read_index().await,
                },
                // The leader's node is silent (dead, stopped or cut off): wait for the election
                // rather than for a call that cannot be answered.
                (Some(t), _) if self.leader_gone(group, t) => WriteOutcome::NotLeader(None),
                (Some(t), _) => self.forward(t, rpc, group, local.as_deref(), &payload, deadline).await,
                (None, Some(_)) => WriteOutcome::NotLeader(None),
                (None, None) => {
                    // The group is not here: ask the peers in turn.
                    let peers = self.inner.transport.peers();
                    if peers.is_empty() || tried_peers >= peers.len() * 3 {
                        return Err(ProposeError::NoGroup(group));
                    }
                    let p = peers[tried_peers % peers.len()];
                    tried_peers += 1;
                    self.forward(p, rpc, group, None, &payload, deadline).await
                }
            };
            match outcome {
                WriteOutcome::Applied(r) => return Ok(r),
                WriteOutcome::NotLeader(Some(l)) if l != self.inner.id || local.is_some() => {
                    hint = Some(l);
                    // A hint pointing back at a node that does not lead yet: let the election settle.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                WriteOutcome::NotLeader(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                WriteOutcome::Unknown(e) => return Err(ProposeError::Unknown(group, e)),
                WriteOutcome::Fatal(e) if e == NO_GROUP => {
                    if local.is_some() {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                WriteOutcome::Fatal(e) => return Err(ProposeError::Fatal(group, e)),
            }
        }
    }

    /// Sends a command to the node `to` (the group's leader, as far as this node knows) and returns
    /// what it said. The wait ends early, with the outcome unknown, when `to` falls silent (the
    /// failure detector says it is down) or when this node's replica of the group (`local`) learns
    /// of another leader: a leader that stopped or was cut off never answers, and waiting out the
    /// call's timeout would hold up this node's later proposals to the group.
    async fn forward(&self, to: NodeId, rpc: Rpc, group: GroupId, local: Option<&dyn GroupHandle>, payload: &[u8], deadline: Instant) -> WriteOutcome {
        let left = deadline.saturating_duration_since(Instant::now()).min(PEER_CALL_TIMEOUT);
        let call = self.inner.transport.request(to, LinkKind::Bulk, rpc, group, payload, left);
        let leader_now = || local.and_then(|h| h.metrics().current_leader);
        let known = leader_now(); // may differ from `to` (sent on a peer's hint)
        let abandoned = async {
            loop {
                tokio::time::sleep(FORWARD_CHECK_EVERY).await;
                if self.inner.detector.is_down(to) {
                    return format!("node {to} stopped answering");
                }
                if let Some(l) = leader_now().filter(|l| *l != to && Some(*l) != known) {
                    return format!("node {l} leads the group now");
                }
            }
        };
        let answer = tokio::select! {
            a = call => a,
            why = abandoned => return WriteOutcome::Unknown(format!("sent to node {to}, then {why}")),
        };
        match answer {
            Ok(answer) => WriteOutcome::decode(answer).unwrap_or_else(|e| WriteOutcome::Unknown(format!("bad answer from node {to}: {e}"))),
            // Not sent: safe to try again (maybe elsewhere).
            Err(RpcError::NotConnected(_)) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                WriteOutcome::NotLeader(None)
            }
            Err(e @ (RpcError::Lost(_) | RpcError::Timeout(..))) => WriteOutcome::Unknown(e.to_string()),
            Err(RpcError::Remote(_, e)) => WriteOutcome::Fatal(e),
            Err(e @ RpcError::TooLarge(_)) => WriteOutcome::Fatal(e.to_string()),
        }
    }

    /// Heartbeats the groups this node leads that include `peer` (it just came up).
    fn announce_leadership_to(&self, peer: NodeId) {
        let groups: Vec<Arc<dyn GroupHandle>> = self.inner.groups.read().values().cloned().collect();
        tokio::spawn(async move {
            for h in groups {
                let m = h.metrics();
                if m.state == ServerState::Leader && m.membership_config.membership().get_node(&peer).is_some() {
                    h.heartbeat().await;
                }
            }
        });
    }

    /// Whether `leader`, the leader of `group` as this node knows it, is gone: its node is down (as
    /// the failure detector says), or it asked for a vote since (see `serve`). Forgets a deposed
    /// leader once the group names another, or the same one for the term it campaigned in or a
    /// later one: a leader restarted with the others (kill -9 of all three) often wins again, and
    /// taking it for gone held this node's proposals until their timeout.
    fn leader_gone(&self, group: GroupId, leader: NodeId) -> bool {
        if self.inner.detector.is_down(leader) {
            return true;
        }
        let mut deposed = self.inner.deposed.lock();
        let Some(&(node, campaign_term)) = deposed.get(&group) else { return false };
        if node == leader {
            let reelected = self.handle(group).is_some_and(|h| {
                let m = h.metrics();
                m.current_leader == Some(leader) && m.vote.is_committed() && m.current_term >= campaign_term
            });
            if !reelected {
                return true;
            }
        }
        deposed.remove(&group);
        false
    }

    /// Whether `peer`'s control link is closed now (a ping cannot be sent, or is lost with its
    /// connection). A ping that merely goes unanswered for a moment says nothing: false.
    async fn link_closed(&self, peer: NodeId) -> bool {
        let ping = self.inner.transport.request(peer, LinkKind::Control, Rpc::Ping, 0, b"", VOTE_PING_TIMEOUT);
        matches!(ping.await, Err(RpcError::NotConnected(_)) | Err(RpcError::Lost(_)))
    }

    /// This node's rank among the live voters of `group` for an election (0 goes first), and
    /// whether a majority of the voters (this node included) answers the failure detector; None if
    /// this node is not a voter.
    fn election_rank(&self, group: GroupId, h: &dyn GroupHandle) -> Option<(usize, bool)> {
        let me = self.inner.id;
        let m = h.metrics();
        let voters: Vec<NodeId> = m.membership_config.membership().voter_ids().collect();
        let live: Vec<NodeId> = voters.iter().copied().filter(|id| *id == me || !self.inner.detector.is_down(*id)).collect();
        let pos = live.iter().position(|id| *id == me)?;
        let reachable = voters.iter().filter(|id| **id == me || self.inner.detector.is_up(**id)).count();
        Some(((pos + live.len() - (group as usize % live.len())) % live.len(), reachable * 2 > voters.len()))
    }

    /// This node's view: members, reachability and its groups.
    pub fn local_status(&self) -> ClusterStatus {
        let members = self
            .inner
            .addrs
            .read()
            .iter()
            .map(|(id, a)| {
                let amqp = match self.inner.transport.peer_addrs(*id) {
                    Some((_, amqp)) if !amqp.is_empty() => amqp,
                    _ => a.amqp_addr.clone(),
                };
                MemberStatus { id: *id, cluster_addr: a.cluster_addr.clone(), amqp_addr: amqp, reachable: self.is_reachable(*id) }
            })
            .collect();
        let handles: Vec<(GroupId, Arc<dyn GroupHandle>)> =
            self.inner.groups.read().iter().map(|(g, h)| (*g, h.clone())).collect();
        let mut groups: Vec<GroupStatus> = handles.iter().map(|(g, h)| group_status(*g, &h.metrics())).collect();
        groups.sort_by_key(|g| g.group);
        ClusterStatus { node_id: self.inner.id, members, groups }
    }

    /// The cluster's status: this node's view of the members, and each group as its leader sees it
    /// (asked of every reachable peer), or as this node sees it when its leader cannot be asked.
    /// Sends `payload` as `rpc` to every peer at once (a stopped one costs one timeout, not one
    /// each); await the answers, each with its peer, in peer order.
    fn ask_every_peer(&self, rpc: Rpc, payload: Bytes, timeout: Duration) -> Vec<tokio::task::JoinHandle<(NodeId, Result<Bytes, RpcError>)>> {
        self.inner
            .transport
            .peers()
            .into_iter()
            .map(|peer| {
                let (t, payload) = (self.inner.transport.clone(), payload.clone());
                tokio::spawn(async move { (peer, t.request(peer, LinkKind::Bulk, rpc, 0, &payload, timeout).await) })
            })
            .collect()
    }

    pub async fn cluster_status(&self) -> ClusterStatus {
        let mut status = self.local_status();
        let mut views: BTreeMap<GroupId, GroupStatus> = BTreeMap::new();
        for g in status.groups.drain(..) {
            views.insert(g.group, g);
        }
        for ask in self.ask_every_peer(Rpc::Status, Bytes::from_static(b"local"), STATUS_TIMEOUT) {
            let Ok((_, Ok(answer))) = ask.await else { continue };
            let Ok(theirs) = serde_json::from_slice::<ClusterStatus>(&answer) else { continue };
            for g in theirs.groups {
                let better = match views.get(&g.group) {
                    None => true,
                    Some(mine) => g.state == "leader" && (mine.state != "leader" || g.term > mine.term),
                };
                if better {
                    views.insert(g.group, g);
                }
            }
        }
        status.groups = views.into_values().collect();
        status
    }

    /// Applies an operator's request ([`AdminRequest`]) where it must run (the group's leader).
    pub async fn admin(&self, req: AdminRequest) -> Result<String, String> {
        match req {
            AdminRequest::AddNode { node, addr } => {
                self.learn_peer(node, &addr);
                let naddr = NodeAddr { cluster_addr: addr, amqp_addr: String::new() };
                self.on_group_leader(METADATA_GROUP, AdminRequest::AddNode { node, addr: naddr.cluster_addr.clone() }, move |h| {
                    h.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([node])), Some((node, naddr.clone())))
                })
                .await
                .map(|_| format!("node {node} added to the metadata group"))
            }
            AdminRequest::RemoveNode { node } => {
                let mut done = Vec::new();
                let service = self.inner.queue_members.read().clone();
                if let Some(service) = service {
                    done.push(service.change(MembersChange::Remove(node)).await?);
                }
                done.push(self.remove_from_led_groups(node).await?);
                for peer in self.inner.transport.peers() {
                    // The node itself too, if it is up: it may lead the metadata group (or a
                    // group from before members were recorded), and then it removes itself.
                    if peer == node && !self.is_reachable(node) {
                        continue;
                    }
                    let req = serde_json::to_vec(&AdminRequest::RemoveFromLedGroups { node }).map_err(|e| e.to_string())?;
                    match self.inner.transport.request(peer, LinkKind::Bulk, Rpc::Admin, 0, &req, PEER_CALL_TIMEOUT * 6).await {
                        Ok(b) => done.push(String::from_utf8_lossy(&b).into_owned()),
                        Err(e) => done.push(format!("node {peer}: {e}")),
                    }
                }
                Ok(done.join("; "))
            }
            AdminRequest::RemoveFromLedGroups { node } => self.remove_from_led_groups(node).await,
            AdminRequest::Grow { node } => {
                let service = self.inner.queue_members.read().clone();
                match service {
                    Some(service) => service.change(MembersChange::Grow(node)).await,
                    None => Err(format!("node {} runs no quorum queues", self.inner.id)),
                }
            }
            AdminRequest::TransferLeader { group, node } => {
                let this = self.clone();
                self.on_group_leader(group, AdminRequest::TransferLeader { group, node }, move |h| {
                    let this = this.clone();
                    Box::pin(async move {
                        if node == this.inner.id {
                            return WriteOutcome::Applied(Reply::default());
                        }
                        if !h.metrics().membership_config.membership().voter_ids().any(|v| v == node) {
                            return WriteOutcome::Fatal(format!("node {node} is not a voter of group {group}"));
                        }
                        // Watched: a transfer that does not finish is sent again (`rebalance`).
                        match this.start_transfer(group, &h, node).await {
                            Ok(()) => WriteOutcome::Applied(Reply::default()),
                            Err(e) => WriteOutcome::Fatal(e),
                        }
                    })
                })
                .await
                .map(|_| format!("group {group}: leadership transfer to node {node} started"))
            }
            AdminRequest::Rebalance => {
                let req = serde_json::to_vec(&AdminRequest::RebalanceHere).unwrap_or_default();
                let asks = self.ask_every_peer(Rpc::Admin, Bytes::from(req), PEER_CALL_TIMEOUT);
                let mut done = vec![self.rebalance_here().await];
                for ask in asks {
                    match ask.await {
                        Ok((_, Ok(b))) => done.push(String::from_utf8_lossy(&b).into_owned()),
                        Ok((peer, Err(e))) => done.push(format!("node {peer}: {e}")),
                        Err(e) => done.push(e.to_string()),
                    }
                }
                Ok(done.join("\n"))
            }
            AdminRequest::RebalanceHere => Ok(self.rebalance_here().await),
            AdminRequest::GroupMembership { group } => {
                let membership = self.group_membership(group).ok_or_else(|| format!("group {group} is not on node {}", self.inner.id))?;
                serde_json::to_string(&membership).map_err(|e| e.to_string())
            }
        }
    }

    async fn rebalance_here(&self) -> String {
        self.inner.rebalance.force();
        format!("node {}: {}", self.inner.id, self.rebalance_pass().await)
    }

    async fn remove_from_led_groups(&self, node: NodeId) -> Result<String, String> {
        let service = self.inner.queue_members.read().clone();
        let follows_recorded = |group: GroupId| group != METADATA_GROUP && service.as_ref().is_some_and(|s| s.follows_recorded(group));
        let handles: Vec<(GroupId, Arc<dyn GroupHandle>)> =
            self.inner.groups.read().iter().map(|(g, h)| (*g, h.clone())).collect();
        let mut removed = 0;
        for (group, h) in handles {
            let m = h.metrics();
            if m.state != ServerState::Leader || !m.membership_config.membership().voter_ids().any(|v| v == node) {
                continue;
            }
            // Its leader moves it to the members recorded for it, in its place (`reconcile_members`).
            if follows_recorded(group) {
                continue;
            }
            match h.change_membership(ChangeMembers::RemoveVoters(BTreeSet::from([node])), None).await {
                WriteOutcome::Applied(_) => removed += 1,
                WriteOutcome::NotLeader(_) => {}
                WriteOutcome::Unknown(e) | WriteOutcome::Fatal(e) => return Err(format!("group {group}: {e}")),
            }
        }
        Ok(format!("node {}: removed node {node} from {removed} groups", self.inner.id))
    }

    /// Runs `op` on the group's leader: here if this node leads, else sends `req` to the leader.
    async fn on_group_leader(
        &self,
        group: GroupId,
        req: AdminRequest,
        op: impl Fn(Arc<dyn GroupHandle>) -> BoxFuture<WriteOutcome>,
    ) -> Result<(), String> {
        let deadline = Instant::now() + PROPOSE_TIMEOUT;
        loop {
            let h = self.handle(group).ok_or_else(|| format!("group {group} is not on node {}", self.inner.id))?;
            let leader = h.metrics().current_leader;
            let outcome = match leader {
                Some(l) if l == self.inner.id => op(h).await,
                Some(l) => {
                    let payload = serde_json::to_vec(&req).map_err(|e| e.to_string())?;
                    return self
                        .inner
                        .transport
                        .request(l, LinkKind::Bulk, Rpc::Admin, group, &payload, PEER_CALL_TIMEOUT * 6)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string());
                }
                None => WriteOutcome::NotLeader(None),
            };
            match outcome {
                WriteOutcome::Applied(_) => return Ok(()),
                WriteOutcome::NotLeader(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
                WriteOutcome::NotLeader(_) => return Err(format!("group {group} has no leader")),
                WriteOutcome::Unknown(e) | WriteOutcome::Fatal(e) => return Err(e),
            }
        }
    }

    /// Stops every group and the transport.
    pub async fn shutdown(&self) {
        let _ = self.inner.stop.send(true);
        let handles: Vec<Arc<dyn GroupHandle>> = self.inner.groups.write().drain().map(|(_, h)| h).collect();
        self.inner.groups_version.fetch_add(1, Ordering::Release);
        for h in handles {
            h.shutdown().await;
        }
        self.inner.transport.shutdown();
    }
}

const NO_GROUP: &str = "no such group on this node";

/// The largest snapshot taken in pieces (the store keeps a snapshot as one record, at most 1 GiB).
const MAX_SNAPSHOT_BYTES: u64 = 1 << 30;

/// A snapshot arriving in pieces: the ones so far.
struct PartialSnapshot {
    /// Which snapshot: the last log id it covers.
    last_log_id: Option<crate::types::LogId>,
    vote: crate::types::Vote,
    total: u64,
    data: bytes::BytesMut,
}

impl ClusterNode {
    /// Adds a piece of a snapshot of `group`; returns the whole snapshot with its last piece. A
    /// first piece starts over (a new leader's, or a retry's); one out of order is refused, and
    /// the sender starts again from the first.
    fn snapshot_chunk(&self, group: GroupId, chunk: SnapshotChunk) -> Result<Option<SnapshotMessage>, String> {
        if chunk.total > MAX_SNAPSHOT_BYTES {
            return Err(format!("group {group}: a snapshot of {} bytes is over the {MAX_SNAPSHOT_BYTES} this node takes", chunk.total));
        }
        let mut parts = self.inner.snapshot_parts.lock();
        if chunk.offset == 0 {
            // Grown as pieces come, not taken at once on the first piece's word.
            let data = bytes::BytesMut::with_capacity((chunk.total as usize).min(4 * SNAPSHOT_CHUNK));
            parts.insert(group, PartialSnapshot { last_log_id: chunk.meta.last_log_id, vote: chunk.vote, total: chunk.total, data });
        }
        let Some(part) = parts.get_mut(&group) else {
            return Err(format!("group {group}: a snapshot piece at {} without its beginning; send it again from the start", chunk.offset));
        };
        let fits = chunk.offset.checked_add(chunk.data.len() as u64).is_some_and(|end| end <= part.total);
        if part.last_log_id != chunk.meta.last_log_id || part.vote != chunk.vote || part.total != chunk.total || part.data.len() as u64 != chunk.offset || !fits {
            // (The pieces so far stay: this one may be a deposed leader's, late.)
            return Err(format!("group {group}: a snapshot piece out of order (at {}); send it again from the start", chunk.offset));
        }
        part.data.extend_from_slice(&chunk.data);
        if (part.data.len() as u64) < part.total {
            return Ok(None);
        }
        let Some(part) = parts.remove(&group) else { return Ok(None) };
        Ok(Some(SnapshotMessage { vote: part.vote, meta: chunk.meta, data: part.data.freeze() }))
    }
}

/// The transport's handler: a weak reference, so a node that is dropped is not kept alive by its
/// own transport.
struct NodeHandler(Weak<NodeInner>);

impl Handler for NodeHandler {
    fn handle(&self, from: NodeId, rpc: Rpc, group: GroupId, payload: Bytes) -> BoxFuture<Result<Bytes, String>> {
        let Some(inner) = self.0.upgrade() else { return Box::pin(async { Err("the node is stopping".to_owned()) }) };
        let node = ClusterNode { inner };
        Box::pin(async move { node.serve(from, rpc, group, payload).await })
    }
}

fn decode<T: Wire>(payload: Bytes) -> Result<T, String> {
    wire::from_bytes(payload).map_err(|e| e.to_string())
}

impl ClusterNode {
    async fn serve(&self, from: NodeId, rpc: Rpc, group: GroupId, payload: Bytes) -> Result<Bytes, String> {
        // Operator requests come on ctl connections (from = 0) or from peers relaying them.
        match rpc {
            Rpc::Status => {
                let status = if &payload[..] == b"local" { self.local_status() } else { self.cluster_status().await };
                return serde_json::to_vec(&status).map(Bytes::from).map_err(|e| e.to_string());
            }
            Rpc::Admin => {
                let req: AdminRequest = serde_json::from_slice(&payload).map_err(|e| format!("bad admin request: {e}"))?;
                return self.admin(req).await.map(Bytes::from);
            }
            _ if from == 0 => return Err("only status and admin requests are accepted from warren ctl".to_owned()),
            Rpc::Bodies => {
                let source = self.inner.body_source.read().clone();
                return match source {
                    Some(source) => source(group, payload).await,
                    None => Err("this node serves no bodies".to_owned()),
                };
            }
            Rpc::Classic => {
                let service = self.inner.classic_service.read().clone();
                return match service {
                    Some(service) => service(from, payload).await,
                    None => Err("this node serves no classic queue requests yet (starting)".to_owned()),
                };
            }
            _ => {}
        }
        let Some(h) = self.handle(group) else {
            return match rpc {
                Rpc::Propose | Rpc::ReadIndex => Ok(WriteOutcome::Fatal(NO_GROUP.to_owned()).encode()),
                _ => Err(format!("group {group}: {NO_GROUP}")),
            };
        };
        match rpc {
            Rpc::AppendEntries => {
                let req: AppendEntriesRequest<TypeConfig> = decode(payload)?;
                Ok(wire::to_bytes(&h.append(req).await?))
            }
            Rpc::Vote | Rpc::PreVote => {
                let mut req: VoteRequest<TypeConfig> = decode(payload)?;
                if self.is_rebuilding(group) {
                    // Its log lacks what it acknowledged before the loss (see `rebuild_group`). The
                    // pre-vote is refused too: granted, it would let a stale candidate start real
                    // elections over and over, each raising the term under the up-to-date ones.
                    tracing::debug!(group, candidate = req.vote.leader_id.node_id, "vote refused: this node rebuilds the group's log");
                    return Ok(wire::to_bytes(&VoteResponse::<TypeConfig> { vote: req.vote, vote_granted: false, last_log_id: None }));
                }
                let leader = h.metrics().current_leader.filter(|l| *l != self.inner.id);
                let candidate = req.vote.leader_id.node_id;
                if leader == Some(candidate) {
                    // The leader this node follows campaigns: it leads no more (it restarted), even
                    // though its node answers. The sweep elects as for a leader that is down.
                    self.inner.deposed.lock().insert(group, (candidate, req.vote.leader_id.term));
                    self.inner.liveness_version.fetch_add(1, Ordering::Release);
                } else if rpc == Rpc::Vote && !req.leadership_transfer {
                    if let Some(l) = leader {
                        // The leader this node follows is down (as the detector says, or as a ping
                        // finds its link closed: the candidate may have seen the dead process's
                        // socket close a moment before this node did): grant despite the leader
                        // lease, as for a leadership transfer.
                        if self.leader_gone(group, l) || self.link_closed(l).await {
                            req.leadership_transfer = true;
                        }
                    }
                }
                Ok(wire::to_bytes(&h.vote(req, rpc == Rpc::PreVote).await?))
            }
            Rpc::Snapshot => {
                let msg: SnapshotMessage = decode(payload)?;
                Ok(wire::to_bytes(&h.install_snapshot(msg).await?))
            }
            Rpc::SnapshotChunk => {
                let chunk: SnapshotChunk = decode(payload)?;
                match self.snapshot_chunk(group, chunk)? {
                    Some(msg) => Ok(wire::to_bytes(&h.install_snapshot(msg).await?)),
                    None => Ok(Bytes::new()),
                }
            }
            Rpc::TransferLeader => {
                let req: TransferLeaderRequest<TypeConfig> = decode(payload)?;
                Ok(wire::to_bytes(&h.transfer_leader_rpc(req).await?))
            }
            // Forwarded commands are written here or refused with a hint, never forwarded again.
            Rpc::Propose => Ok(h.write(Command(payload)).await.encode()),
            Rpc::ReadIndex => Ok(h.read_index().await.encode()),
            Rpc::Ping | Rpc::Status | Rpc::Admin | Rpc::Bodies | Rpc::Classic => Err("unexpected".to_owned()),
        }
    }
}


/// The member that initializes a new group (and so first leads it), and that the sweep hands the
/// leadership back to: `recorded` if it is one of the voters (a quorum queue declared under
/// RabbitMQ's `client-local` leader locator records its declaring node); otherwise the voters in id
/// order, rotated by the group id, so leadership of new groups spreads over the nodes.
fn preferred_member(group: GroupId, members: &BTreeSet<NodeId>, recorded: Option<NodeId>) -> Option<NodeId> {
    if let Some(node) = recorded.filter(|n| members.contains(n)) {
        return Some(node);
    }
    if members.is_empty() {
        return None;
    }
    members.iter().nth(group as usize % members.len()).copied()
}

/// How long a new group waits for its preferred member to initialize it before this member does
/// (the preferred member may be down).
pub const INIT_FALLBACK: Duration = Duration::from_secs(3);

/// What the sweep remembers about a group between looks.
#[derive(Default)]
struct GroupTimer {
    /// (last log index, committed index) at the last heartbeat.
    seen: (Option<u64>, Option<u64>),
    last_heartbeat: Option<Instant>,
    leaderless_since: Option<Instant>,
    last_election: Option<Instant>,
    /// Elections this node started since the group last had a leader it saw.
    elections: u32,
    /// A leadership transfer this node asked for as the group's leader: (term, to, when, tries).
    transfer: Option<(u64, NodeId, Instant, u32)>,
    /// No rebalancing of this group before then (a transfer did not take).
    rebalance_after: Option<Instant>,
    /// The leader at the last look (to log changes).
    leader: Option<NodeId>,
    /// The group's preferred member and when it was last computed (a leader that is the preferred
    /// member has nothing to rebalance: most looks end there).
    preferred: Option<(Option<NodeId>, Instant)>,
    /// Since when this node leads the group, as the sweep first saw it (None: not leading).
    leading_since: Option<Instant>,
    /// A follower of a live leader, or a leader of a group that did not move, at the last look:
    /// not looked at again before then unless `liveness_version` moved from the value kept here.
    quiet_until: Option<(Instant, u64)>,
    /// When the sweep last logged why it does not hand the group back (`HANDBACK_BLOCKED_LOG`).
    handback_blocked_logged: Option<Instant>,
}

/// A hand-back to a preferred member up for this long that still does not happen is logged (at
/// most once per this long per group), with why: a fault test saw a leadership not come back in
/// 20 s once, and nothing said why.
const HANDBACK_BLOCKED_LOG: Duration = Duration::from_secs(5);

/// A leader hands its group back to the group's preferred member once that node has been up for
/// this long (it returned after a restart or a fault) and has caught up.
pub const REBALANCE_SETTLE: Duration = Duration::from_secs(1);
/// How far behind the leader's log the preferred member may be for a rebalancing transfer (the
/// leader takes no writes until the transfer is done, and the new leader first catches up).
const REBALANCE_MAX_LAG: u64 = 64;
/// A leader still leading this long after asking for a transfer asks again: openraft's leader takes
/// no writes while a transfer is pending, so one that never lands must not leave it stuck.
const TRANSFER_WAIT: Duration = Duration::from_secs(2);
/// How long a leader trusts its last look at the group's membership (that it is the preferred member).
const PREFERRED_RECHECK: Duration = Duration::from_secs(10);
/// After a transfer that did not land, the group is not rebalanced again for this long.
const REBALANCE_BACKOFF: Duration = Duration::from_secs(30);
/// A leader hands a group back only to a preferred member that came (back) up after this node took
/// the leadership, give or take this much (a node restarted at once can be back before the election
/// that replaced it ends: up to the 1.2 s lease after a kill). So leadership that was moved on
/// purpose (`warren ctl transfer-leader`) while every node was up stays where it was put.
const HANDBACK_SLACK: Duration = Duration::from_secs(2);
/// At most this many hand-backs start per sweep (200 ms) on a node: a node that returns to lead
/// hundreds of groups again gets them over a few seconds, not in one burst of elections.
const HANDBACKS_PER_SWEEP: u32 = 16;
/// How often the sweep looks at a group whose leader is another live node (it has nothing to do
/// there until that leader goes, which the detector or a vote request signals at once). Reading
/// 1,000 groups' metrics five times a second was the largest part of an idle node's CPU (cold cache
/// lines); leaderless groups are still looked at every sweep.
const FOLLOWER_RECHECK: Duration = Duration::from_secs(1);
/// How often the sweep looks at a group this node leads whose log and commit index did not move
/// since the last look and that has no transfer under way (a group that moves is looked at every
/// sweep). Its first move after that is seen up to this late: openraft sends a new commit index to
/// the followers itself (`ReplicateCommitted`), so the sweep's heartbeat after a move is a
/// backstop, and a hand-back waits `REBALANCE_SETTLE` anyway. Reading 333 led groups' metrics five
/// times a second was the largest part of an idle node's CPU.
const LEADER_RECHECK: Duration = Duration::from_secs(1);

impl ClusterNode {
    /// For a group this node leads: hands the leadership to the group's preferred member when it is
    /// back and caught up (leaders spread over the nodes again after a node returns), and sees a
    /// pending transfer through.
    fn rebalance(&self, group: GroupId, h: &Arc<dyn GroupHandle>, t: &mut GroupTimer, now: Instant, handbacks: &mut u32) {
        let me = self.inner.id;
        let fresh = t.preferred.is_some_and(|(p, at)| p == Some(me) && now.duration_since(at) < PREFERRED_RECHECK);
        if t.transfer.is_none() && fresh {
            return;
        }
        let Some((term, preferred, lags)) = h.leader_view(group) else { return };
        t.preferred = Some((preferred, now));
        let detector = &self.inner.detector;
        if let Some((at_term, to, at, tries)) = t.transfer {
            if at_term == term {
                if now.duration_since(at) < TRANSFER_WAIT {
                    return;
                }
                t.rebalance_after = Some(now + REBALANCE_BACKOFF);
                if !h.transfer_pending() {
                    // It never started (the target did not take the entry appended first, or it
                    // was refused): this node still takes writes. Try again after the backoff.
                    t.transfer = None;
                    return;
                }
                // Still leading, and taking no writes: ask again, the same node while it is up
                // (twice at most), else the most caught-up other voter that answers.
                let to = if tries < 2 && detector.is_up(to) {
                    Some(to)
                } else {
                    // Another than the one that did not take it first, if any.
                    let mut others: Vec<(NodeId, u64)> =
                        lags.iter().filter(|(v, _)| *v != me && detector.is_up(*v)).map(|(v, lag)| (*v, lag.unwrap_or(u64::MAX))).collect();
                    others.sort_by_key(|(v, lag)| (*v == to, *lag));
                    others.first().map(|(v, _)| *v)
                };
                if let Some(to) = to {
                    tracing::info!(group, to, tries, "a leadership transfer did not land: asking again");
                    t.transfer = Some((term, to, now, tries + 1));
                    self.spawn_transfer(group, h, to);
                }
                return;
            }
            t.transfer = None;
        }
        let Some(to) = preferred.filter(|p| *p != me) else { return };
        if *handbacks == 0 || t.rebalance_after.is_some_and(|after| now < after) {
            return;
        }
        let Some(up_for) = detector.up_for(to).filter(|d| *d >= REBALANCE_SETTLE) else { return };
        let leading_for = t.leading_since.map_or(Duration::ZERO, |at| now.duration_since(at));
        let lag = lags.iter().find(|(v, _)| *v == to).and_then(|(_, lag)| *lag);
        let blocked = |why: &str| {
            if up_for >= HANDBACK_BLOCKED_LOG && t.handback_blocked_logged.is_none_or(|at| now.duration_since(at) >= HANDBACK_BLOCKED_LOG) {
                tracing::info!(group, to, ?up_for, ?leading_for, ?lag, "not handing the leadership back to the group's preferred member: {why}");
                true
            } else {
                false
            }
        };
        if up_for >= leading_for + HANDBACK_SLACK {
            // It was up when this node took over: the leadership was moved here on purpose.
            if blocked("it was up when this node took over") {
                t.handback_blocked_logged = Some(now);
            }
            return;
        }
        if !lag.is_some_and(|l| l <= REBALANCE_MAX_LAG) {
            if blocked("it is not caught up") {
                t.handback_blocked_logged = Some(now);
            }
            return;
        }
        tracing::info!(group, to, "the group's preferred member is back: handing it the leadership");
        *handbacks -= 1;
        t.transfer = Some((term, to, now, 1));
        self.spawn_transfer(group, h, to);
    }

    /// Starts a leadership transfer off the sweep: it first waits for a commit and for the target
    /// to take it (see [`GroupHandle::transfer_leader`]), which must not hold up the other groups'
    /// elections. The sweep sees how it went through [`GroupHandle::transfer_pending`].
    fn spawn_transfer(&self, group: GroupId, h: &Arc<dyn GroupHandle>, to: NodeId) {
        let h = h.clone();
        tokio::spawn(async move {
            if let Err(e) = h.transfer_leader(to).await {
                tracing::warn!(group, to, error = %e, "cannot start a leadership transfer");
            }
        });
    }
}

/// The node's one timer for all its groups (see the module docs).
async fn sweep(node: Weak<NodeInner>, mut stop: watch::Receiver<bool>) {
    // The node's groups with their timers, rebuilt only when the set of groups changed (cloning
    // 1,000 handles five times a second was a fifth of an idle node's CPU).
    let mut swept: Vec<(GroupId, Arc<dyn GroupHandle>, GroupTimer)> = Vec::new();
    let mut swept_version = None;
    let mut last_learnt: Option<Instant> = None;
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let Some(sweep_now) = node.upgrade().map(|inner| inner.sweep_now.clone()) else { return };
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = sweep_now.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let Some(inner) = node.upgrade() else { return };
        let node = ClusterNode { inner };
        let me = node.inner.id;
        let version = node.inner.groups_version.load(Ordering::Acquire);
        if swept_version != Some(version) {
            swept_version = Some(version);
            let mut timers: HashMap<GroupId, GroupTimer> = swept.drain(..).map(|(g, _, t)| (g, t)).collect();
            swept = node.inner.groups.read().iter().map(|(g, h)| (*g, h.clone(), timers.remove(g).unwrap_or_default())).collect();
        }
        let now = Instant::now();
        if last_learnt.is_none_or(|at| now.duration_since(at) >= LEARN_PEERS_EVERY) {
            last_learnt = Some(now);
            node.learn_peers_from_metadata();
        }
        // New groups whose preferred member has not made itself heard: initialize them here.
        let pending: Vec<(GroupId, BTreeMap<NodeId, NodeAddr>)> = {
            let mut p = node.inner.pending_init.lock();
            if !p.is_empty() {
                let groups = node.inner.groups.read();
                p.retain(|g, _| groups.contains_key(g));
            }
            p.iter().filter(|(_, (_, since))| now.duration_since(*since) >= INIT_FALLBACK).map(|(g, (n, _))| (*g, n.clone())).collect()
        };
        for (group, nodes) in pending {
            let Some(h) = node.inner.groups.read().get(&group).cloned() else { continue };
            node.inner.pending_init.lock().remove(&group);
            let has_members = h.metrics().membership_config.membership().voter_ids().next().is_some();
            if !has_members {
                // Not if the group runs on another member already: this node may be one added later
                // (`reconcile_members`), restarted before it got anything from the group's leader.
                // Initialized here, it would hold a log of its own. Asked off the sweep.
                let node = node.clone();
                tokio::spawn(async move {
                    let members: BTreeSet<NodeId> = nodes.keys().copied().collect();
                    if node.group_runs_elsewhere(group, &members).await {
                        tracing::info!(group, "the group runs on other members: waiting for its leader to reach this node");
                        return;
                    }
                    tracing::info!(group, "the group's preferred member did not initialize it: initializing it here");
                    if let Err(e) = h.initialize(nodes).await {
                        tracing::warn!(group, error = %e, "cannot initialize the group");
                    }
                });
            }
        }
        let mut handbacks = HANDBACKS_PER_SWEEP;
        let liveness = node.inner.liveness_version.load(Ordering::Acquire);
        for (group, h, t) in swept.iter_mut() {
            let group = *group;
            if t.quiet_until.is_some_and(|(until, seen)| now < until && seen == liveness) {
                continue;
            }
            t.quiet_until = None;
            let (state, leader, last_log, committed) = h.summary();
            if leader != t.leader {
                tracing::debug!(group, ?leader, was = ?t.leader, "group leader changed");
                t.leader = leader;
            }
            if state == ServerState::Leader {
                t.leaderless_since = None;
                t.elections = 0;
                t.leading_since.get_or_insert(now);
                let moved = (last_log, committed) != t.seen;
                let stale = t.last_heartbeat.is_none_or(|at| now.duration_since(at) >= LEADER_REFRESH);
                if moved || stale {
                    t.seen = (last_log, committed);
                    t.last_heartbeat = Some(now);
                    h.heartbeat().await;
                }
                node.rebalance(group, h, t, now, &mut handbacks);
                if !moved && t.transfer.is_none() {
                    t.quiet_until = Some((now + LEADER_RECHECK, liveness));
                }
                continue;
            }
            t.transfer = None;
            t.leading_since = None;
            let leader_down = leader.is_some_and(|l| l != me && node.leader_gone(group, l));
            if leader.is_some_and(|l| l != me) && !leader_down {
                t.leaderless_since = None;
                t.elections = 0;
                t.quiet_until = Some((now + FOLLOWER_RECHECK, liveness));
                continue;
            }
            let since = *t.leaderless_since.get_or_insert(now);
            let Some((rank, quorum_reachable)) = node.election_rank(group, h.as_ref()) else { continue };
            if !quorum_reachable {
                continue; // cut off from the majority: no election could be won from here
            }
            // No grace either for a node that knows itself as the leader without leading (it
            // restarted): the others may still name it and wait for it.
            let grace = if leader_down || leader == Some(me) { Duration::ZERO } else { LEADERLESS_GRACE };
            let stagger = ELECTION_STAGGER * rank as u32;
            let due = since + grace + stagger;
            let retry_ok = t.last_election.is_none_or(|at| now.duration_since(at) >= ELECTION_RETRY + stagger);
            if now >= due && retry_ok && !node.is_rebuilding(group) {
                t.last_election = Some(now);
                t.elections += 1;
                // The leader's process is dead (its links closed): the first candidate skips the
                // pre-vote, which its own lease on the dead leader would refuse for up to
                // LEADER_LEASE; the voters grant it as a transfer (see `serve`). A leader merely
                // silent (stopped, cut off) may be alive: pre-vote as usual.
                let at_once = rank == 0 && leader.is_some_and(|l| l != me && node.inner.detector.closed_down(l));
                if t.elections > 1 {
                    // A round without a leader already. A candidate raises its own term even when
                    // its pre-vote fails, so a node whose log is behind, campaigning on, keeps its
                    // term ahead of the node that could win: it leaves the election to a peer
                    // with a longer log. And a pre-vote never raises the term a voter compares it
                    // with, so one that voted for itself in the term this node proposes (whose own
                    // election failed: a member down, or rebuilding its log) refuses it forever:
                    // every other round skips the pre-vote.
                    let (node, h) = (node.clone(), h.clone());
                    let voters: Vec<NodeId> = h.metrics().membership_config.membership().voter_ids().collect();
                    let pre_vote = t.elections % 2 == 0;
                    tokio::spawn(async move {
                        if node.has_longest_log(group, &voters, STUCK_ELECTION_ASK).await {
                            tracing::debug!(group, pre_vote, "electing again");
                            h.elect(pre_vote).await;
                        } else {
                            tracing::debug!(group, "a peer's log is longer: leaving the election to it");
                        }
                    });
                    continue;
                }
                tracing::debug!(group, rank, ?leader, leader_down, at_once, "electing");
                h.elect(!at_once).await;
            }
        }
    }
}
