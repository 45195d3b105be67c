//! The Raft groups of this node's quorum queues: the broker's [`QuorumHost`] and [`Replicator`]
//! over openraft (through `warren_cluster`), so that the broker crate stays free of the library.
//!
//! Each quorum queue is a group whose id is the queue's id; its state machine is the queue itself
//! ([`QueueMachine`] hands committed entries to `Queue::apply_replicated`, which applies them to the
//! queue's `QuorumMachine` and performs the effects on this node). Standalone (no `--peers`), a
//! group has one voter, this node: a commit is the local fsync of the entry, in the node's one WAL.
//!
//! In a cluster (`--peers`), a queue's group has `x-quorum-initial-group-size` members (default 3, at
//! most the cluster's size), chosen from the queue id: every node computes the same members from the
//! same peers (`members_of`). Members start the group on the cluster node (`ClusterNode::start_group`);
//! proposals from any node go through `ClusterNode::propose`, which forwards them to the leader. They
//! are submitted one at a time per group: a publisher session's seqs must be applied in the order
//! they were proposed (the machine drops a seq at or below the last applied one as a duplicate).
//! When the failure detector sees a node go down, the leaders of its groups on this node propose
//! `ConsumerDown(that node)`: its consumers' unacked messages come back redelivered.
//!
//! A proposal that is not committed and applied within [`QUORUM_TIMEOUT`] (no leader, no majority:
//! the minority side of a partition) fails: its publishers get basic.nack (a retry may duplicate).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use tokio::sync::{mpsc, watch};
use warren_broker::queue::quorum::{ProposeDone, QuorumHost, Replicator};
use warren_broker::queue_args::LeaderLocator;
use warren_broker::Queue;
use std::collections::BTreeSet;
use std::sync::Weak;
use warren_cluster::machine::StateMachine;
use warren_cluster::node::MembersStep;
use warren_cluster::{start_single_voter, ClusterNode, Command, GroupId, GroupMachine, GroupRaft, NodeAddr, NodeId, RaftLogs};

/// How long a proposal may wait for its commit and apply before its publishers are nacked.
pub const QUORUM_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a (re)started single-voter group may take to lead (replaying its log first).
const LEAD_WITHIN: Duration = Duration::from_secs(60);

type QueueRaft = GroupRaft<StateMachine<QueueMachine>>;

/// A quorum queue as its group's state machine. In a cluster it also knows where to fetch the
/// bodies a snapshot from the leader does not carry.
pub struct QueueMachine(Arc<Queue>, Option<BodyPeers>);

/// Where a replica that installed a snapshot fetches the bodies of its live messages.
#[derive(Clone)]
struct BodyPeers {
    node: ClusterNode,
    group: GroupId,
    members: BTreeSet<NodeId>,
    /// The group's state on this node: a stopped group stops fetching.
    running: watch::Receiver<Running>,
}

impl GroupMachine for QueueMachine {
    fn apply(&mut self, index: u64, command: &Bytes) -> Bytes {
        if let Some(delay) = get_apply_delay_for_tests() {
            // Test-only: this node applies its own basic.gets late (after the leader answered
            // them and past the getter's wait), as a slow follower would.
            if self.0.has_own_dequeue(command) {
                std::thread::sleep(delay);
            }
        }
        self.0.apply_replicated(index, command)
    }

    fn snapshot(&self) -> Result<Bytes, String> {
        Ok(self.0.snapshot_replicated())
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        self.0.restore_replicated(snapshot)
    }

    fn restored_at_start(&mut self) {
        self.0.restored_at_start()
    }

    fn installed(&mut self) -> warren_cluster::transport::BoxFuture<Result<(), String>> {
        let queue = self.0.clone();
        let peers = self.1.clone();
        Box::pin(async move {
            let Some(request) = queue.snapshot_installed()? else { return Ok(()) };
            match peers {
                Some(peers) => fetch_bodies(&queue, peers, request).await,
                None => Err("a snapshot was installed on a node without peers to fetch its bodies from".to_string()),
            }
        })
    }
}

/// Test-only (`WARREN_TEST_GET_APPLY_DELAY_MS`, test-hooks builds): how late this node applies the
/// entries with its own basic.gets (`Dequeue`), blocking its apply meanwhile.
fn get_apply_delay_for_tests() -> Option<Duration> {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| warren_store::test_hooks::millis("WARREN_TEST_GET_APPLY_DELAY_MS", "this node applies its own basic.gets late"))
}

/// What one body request may take.
const BODY_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Fetches the bodies of a just-installed snapshot's live messages: from the group's leader first
/// (it sent the snapshot), else another member; a peer that cannot answer (behind, down, a bad
/// answer) is skipped, and the round starts again after a pause, until every body is here or the
/// group stops. Nothing later in the group applies meanwhile (the store's records rise by msg id).
async fn fetch_bodies(queue: &Arc<Queue>, peers: BodyPeers, first: Bytes) -> Result<(), String> {
    let me = peers.node.node_id();
    let mut request = first;
    let mut pause = Duration::from_millis(100);
    loop {
        let mut order: Vec<NodeId> = peers.members.iter().copied().filter(|m| *m != me).collect();
        if let Some(leader) = peers.node.leader(peers.group).filter(|l| *l != me) {
            order.retain(|m| *m != leader);
            order.insert(0, leader);
        }
        let mut progressed = false;
        'peers: for peer in order {
            loop {
                if matches!(*peers.running.borrow(), Running::Stopped) || queue.is_deleted() {
                    return Err("the queue's group stopped while fetching a snapshot's bodies".to_string());
                }
                let answer = match peers.node.fetch_bodies(peer, peers.group, &request, BODY_CALL_TIMEOUT).await {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(queue = %queue.name, peer, error = %e, "could not fetch a snapshot's bodies from a peer; trying another");
                        continue 'peers;
                    }
                };
                match queue.bodies_fetched(&request, answer) {
                    Ok(Some(next)) => {
                        request = next;
                        progressed = true;
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        tracing::warn!(queue = %queue.name, peer, error = %e, "a peer's answer with a snapshot's bodies was refused; trying another");
                        continue 'peers;
                    }
                }
            }
        }
        if progressed {
            pause = Duration::from_millis(100);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// Answers a peer's body request from the queue of `group` on this node (store reads: blocking).
async fn serve_bodies(groups: Weak<QuorumGroups>, group: GroupId, request: Bytes) -> Result<Bytes, String> {
    let queue = groups
        .upgrade()
        .and_then(|g| g.groups.lock().get(&group).and_then(|(_, q, _)| q.upgrade()))
        .ok_or_else(|| format!("no quorum queue of group {group} on this node"))?;
    tokio::task::spawn_blocking(move || queue.serve_bodies(&request)).await.map_err(|e| e.to_string())?
}

/// The state of one group's Raft on this node.
#[derive(Clone)]
enum Running {
    Starting,
    Running(QueueRaft),
    /// In a cluster, this node is not one of the group's members: proposals are forwarded.
    NotMember,
    Failed(String),
    Stopped,
}

/// One group, as the broker's replica proposes to it. Proposals go to the group in the order they
/// were made (one task submits them), several at a time: a reply is awaited on its own task.
pub struct Group {
    raft: watch::Receiver<Running>,
    proposals: mpsc::UnboundedSender<(Bytes, ProposeDone)>,
    runtime: tokio::runtime::Handle,
    /// In a cluster: this node and the group's members (a node outside the group relays its
    /// consumers through one of them), kept to the recorded ones by [`follow_members`].
    members: Option<(ClusterNode, Relay)>,
    /// The node's Raft logs and this group's id: the replica pins and reads entries there.
    logs: Arc<RaftLogs>,
    id: GroupId,
}

/// A group's recorded members, as the nodes outside it relay through them.
type Relay = Arc<RwLock<BTreeSet<NodeId>>>;

impl Group {
    fn new(raft: watch::Receiver<Running>, runtime: tokio::runtime::Handle, logs: Arc<RaftLogs>, id: GroupId, cluster: Option<(ClusterNode, GroupId, Relay)>) -> Group {
        let (proposals, rx) = mpsc::unbounded_channel();
        let members = match cluster {
            None => {
                runtime.spawn(submit_in_order(raft.clone(), rx));
                None
            }
            Some((node, group, members)) => {
                runtime.spawn(forward_in_order(node.clone(), group, raft.clone(), rx));
                Some((node, members))
            }
        };
        Group { raft, proposals, runtime, members, logs, id }
    }
}

impl Replicator for Group {
    fn propose(&self, entry: Bytes, done: ProposeDone) {
        if let Err(mpsc::error::SendError((_, done))) = self.proposals.send((entry, done)) {
            self.runtime.spawn(async move { done(Err("the queue's Raft group was stopped".to_string())) });
        }
    }

    fn is_leader(&self) -> bool {
        matches!(&*self.raft.borrow(), Running::Running(r) if r.is_leader())
    }

    fn is_member(&self) -> bool {
        !matches!(&*self.raft.borrow(), Running::NotMember)
    }

    fn relay_member(&self, avoid: Option<u64>) -> Option<u64> {
        let (node, members) = self.members.as_ref()?;
        // Starting at this node's place among them, so the nodes outside spread over the members.
        let members: Vec<NodeId> = members.read().iter().copied().collect();
        let start = (node.node_id() as usize) % members.len().max(1);
        let order = || members[start..].iter().chain(&members[..start]).copied().filter(|&m| Some(m) != avoid);
        order().find(|&m| node.is_reachable(m)).or_else(|| order().next()).or_else(|| members.first().copied())
    }

    fn pin_entry(&self, index: u64) -> Result<(), String> {
        self.logs.pin_entry(self.id, index).map_err(|e| e.to_string())
    }

    fn unpin_entry(&self, index: u64) -> Result<(), String> {
        self.logs.unpin_entry(self.id, index).map_err(|e| e.to_string())
    }

    fn read_entry(&self, index: u64) -> Result<Option<Bytes>, String> {
        self.logs.read_command(self.id, index).map_err(|e| e.to_string())
    }
}

/// The group's Raft once it runs (waiting while it starts).
async fn running(raft: &mut watch::Receiver<Running>) -> Result<QueueRaft, String> {
    loop {
        match &*raft.borrow_and_update() {
            Running::Running(r) => return Ok(r.clone()),
            Running::NotMember => return Err("this node is not a member of the queue's Raft group".to_string()),
            Running::Failed(e) => return Err(format!("the queue's Raft group did not start: {e}")),
            Running::Stopped => return Err("the queue's Raft group was stopped".to_string()),
            Running::Starting => {}
        }
        if raft.changed().await.is_err() {
            return Err("the queue's Raft group was stopped".to_string());
        }
    }
}

/// Submits a group's proposals in order; each one's reply (or its timeout) ends it.
async fn submit_in_order(mut raft: watch::Receiver<Running>, mut proposals: mpsc::UnboundedReceiver<(Bytes, ProposeDone)>) {
    while let Some((entry, done)) = proposals.recv().await {
        let deadline = tokio::time::Instant::now() + QUORUM_TIMEOUT;
        let group = match tokio::time::timeout_at(deadline, running(&mut raft)).await {
            Ok(Ok(group)) => group,
            Ok(Err(e)) => {
                done(Err(e));
                continue;
            }
            Err(_) => {
                done(Err(format!("the queue's Raft group did not start within {} s", QUORUM_TIMEOUT.as_secs())));
                continue;
            }
        };
        let reply = match group.submit(entry).await {
            Ok(reply) => reply,
            Err(e) => {
                done(Err(e));
                continue;
            }
        };
        tokio::spawn(async move {
            let result = match tokio::time::timeout_at(deadline, reply).await {
                Ok(result) => result,
                Err(_) => Err(format!("not committed within {} s", QUORUM_TIMEOUT.as_secs())),
            };
            done(result);
        });
    }
}

/// Submits a group's proposals through the cluster node (forwarded to the leader wherever it is),
/// one at a time: the next waits for the previous one's reply, so entries apply in proposal order.
async fn forward_in_order(
    node: ClusterNode,
    group: GroupId,
    mut raft: watch::Receiver<Running>,
    mut proposals: mpsc::UnboundedReceiver<(Bytes, ProposeDone)>,
) {
    while let Some((entry, done)) = proposals.recv().await {
        let deadline = tokio::time::Instant::now() + QUORUM_TIMEOUT;
        // A member proposes once its own group runs (else nobody may have the group yet).
        if matches!(*raft.borrow(), Running::Starting) {
            let _ = tokio::time::timeout_at(deadline, raft.wait_for(|r| !matches!(r, Running::Starting))).await;
        }
        let result = loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match node.propose(group, Command(entry.clone()), left).await {
                // The group is still starting on its members: proposed nowhere, so try again.
                Err(warren_cluster::node::ProposeError::NoGroup(_)) if !left.is_zero() => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => break other,
            }
        };
        done(result.map(|reply| reply.0).map_err(|e| e.to_string()));
    }
}

/// The members of a quorum queue's group in a cluster: `size` nodes (at least 1, at most all) of
/// `peers`, starting at the queue id's place among them, so groups spread over the nodes. Every node
/// computes the same set from the same peers.
pub fn members_of(group: GroupId, peers: &[NodeId], size: u32) -> BTreeSet<NodeId> {
    let mut sorted = peers.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let n = sorted.len();
    if n == 0 {
        return BTreeSet::new();
    }
    let k = (size.max(1) as usize).min(n);
    let start = (group % n as u64) as usize;
    (0..k).map(|i| sorted[(start + i) % n]).collect()
}

/// The members of a quorum queue's group led first by node `me` (RabbitMQ's `client-local`): `me`
/// and `size - 1` of the other peers, picked as [`members_of`] picks them.
pub fn members_with(me: NodeId, group: GroupId, peers: &[NodeId], size: u32) -> BTreeSet<NodeId> {
    let others: Vec<NodeId> = peers.iter().copied().filter(|p| *p != me).collect();
    let mut members = if size > 1 { members_of(group, &others, size - 1) } else { BTreeSet::new() };
    members.insert(me);
    members
}

/// The default `x-quorum-initial-group-size`, as RabbitMQ.
const DEFAULT_GROUP_SIZE: u32 = 3;

/// This node's quorum-queue groups.
pub struct QuorumGroups {
    logs: Arc<RaftLogs>,
    node: NodeId,
    addr: NodeAddr,
    /// In a cluster: the cluster node and every node's id.
    cluster: Option<(ClusterNode, Vec<NodeId>)>,
    runtime: tokio::runtime::Handle,
    groups: Mutex<HashMap<GroupId, (watch::Sender<Running>, Weak<Queue>, Relay)>>,
    /// In a cluster: what [`follow_members`] keeps between its passes.
    following: Following,
    /// In a cluster: requests about classic queues go through it (`classic_home`).
    pub classic: std::sync::OnceLock<Arc<crate::classic_home::ClassicHome>>,
}

/// What [`follow_members`] keeps between its passes.
#[derive(Default)]
struct Following {
    /// Woken when a queue's recorded members change.
    changed: Arc<tokio::sync::Notify>,
    /// The groups whose members were changed since their declaration (`Queue::members_changed`),
    /// the only ones a pass looks at: a group whose members never changed has the recorded ones as
    /// its voters from its start. Walking every group each second was a tenth of an idle node's CPU.
    reconfigured: Mutex<std::collections::HashSet<GroupId>>,
    /// Groups whose voters are the recorded members (nothing to do), with those members.
    settled: Mutex<HashMap<GroupId, BTreeSet<NodeId>>>,
    /// Groups a membership step (or a leave) is under way for.
    stepping: Mutex<std::collections::HashSet<GroupId>>,
    /// When a step toward a group's recorded members last failed with a warning (once a minute).
    warned: Mutex<HashMap<GroupId, tokio::time::Instant>>,
}

impl QuorumGroups {
    /// A node without peers: every group has this node as its only voter.
    pub fn new(logs: Arc<RaftLogs>, node: NodeId, addr: NodeAddr) -> Arc<QuorumGroups> {
        let groups = Arc::new(QuorumGroups {
            logs,
            node,
            addr,
            cluster: None,
            runtime: tokio::runtime::Handle::current(),
            groups: Mutex::new(HashMap::new()),
            following: Following::default(),
            classic: std::sync::OnceLock::new(),
        });
        groups.runtime.spawn(compact_logs(Arc::downgrade(&groups)));
        groups
    }

    /// A cluster member: groups have members on several nodes (`members_of`).
    pub fn clustered(logs: Arc<RaftLogs>, node: ClusterNode, peers: Vec<NodeId>) -> Arc<QuorumGroups> {
        let id = node.node_id();
        let addr = node.node_addr(id).unwrap_or_default();
        let groups = Arc::new(QuorumGroups {
            logs,
            node: id,
            addr,
            cluster: Some((node, peers)),
            runtime: tokio::runtime::Handle::current(),
            groups: Mutex::new(HashMap::new()),
            following: Following::default(),
            classic: std::sync::OnceLock::new(),
        });
        groups.runtime.spawn(watch_nodes(Arc::downgrade(&groups)));
        groups.runtime.spawn(follow_members(Arc::downgrade(&groups)));
        groups.runtime.spawn(compact_logs(Arc::downgrade(&groups)));
        if let Some((node, _)) = &groups.cluster {
            let weak = Arc::downgrade(&groups);
            node.set_body_source(Arc::new(move |group, request| Box::pin(serve_bodies(weak.clone(), group, request))));
        }
        groups
    }

    /// The groups this node runs as a member (not those it only forwards to).
    pub fn member_of(&self) -> Vec<GroupId> {
        self.groups.lock().iter().filter(|(_, (tx, _, _))| matches!(&*tx.borrow(), Running::Running(_))).map(|(g, _)| *g).collect()
    }

    /// Stops every group (shutdown), so none applies anything while the store closes.
    pub async fn shutdown(&self) {
        let senders: Vec<(GroupId, watch::Sender<Running>)> = self.groups.lock().drain().map(|(g, (tx, _, _))| (g, tx)).collect();
        for (group, tx) in senders {
            let previous = tx.send_replace(Running::Stopped);
            if let Some((node, _)) = &self.cluster {
                let _ = node.stop_group(group).await;
            } else if let Running::Running(raft) = previous {
                let _ = raft.shutdown().await;
            }
        }
    }

    /// Starts the group of `queue` on this node, one of its `members`. A group with no state yet is
    /// initialized with voters `init` (`ClusterNode::start_group`); with none, this node joins the
    /// group where it runs (its leader adds it: [`follow_members`]).
    fn start_member(
        &self,
        node: &ClusterNode,
        queue: Arc<Queue>,
        members: BTreeSet<NodeId>,
        init: BTreeSet<NodeId>,
        preferred: Option<NodeId>,
        tx: watch::Sender<Running>,
    ) {
        let group = queue.id;
        let (logs, node, runtime) = (self.logs.clone(), node.clone(), self.runtime.clone());
        let peers = BodyPeers { node: node.clone(), group, members: members.clone(), running: tx.subscribe() };
        // `ClusterNode::start_group`'s future is not `Send`: it runs on a blocking thread of its
        // own (the group's tasks it spawns run on the runtime as any other).
        self.runtime.spawn_blocking(move || {
            let name = queue.name.clone();
            let started = async {
                let machine = StateMachine::open(&logs, group, QueueMachine(queue, Some(peers))).await.map_err(|e| e.to_string())?;
                let log_store = logs.log_store(group).map_err(|e| e.to_string())?;
                node.start_group(group, &init, preferred, log_store, machine).await.map(GroupRaft::from).map_err(|e| e.to_string())
            };
            match runtime.block_on(started) {
                Ok(raft) => {
                    tracing::debug!(queue = %name, group, ?members, "quorum queue's group started on this node");
                    tx.send_if_modified(|state| match state {
                        Running::Stopped => false,
                        _ => {
                            *state = Running::Running(raft.clone());
                            true
                        }
                    });
                }
                Err(e) => {
                    tracing::error!(queue = %name, group, error = %e, "could not start a quorum queue's Raft group");
                    let _ = tx.send(Running::Failed(e));
                }
            }
        });
    }

    /// Whether the group's members are recorded (its leader follows them: [`follow_members`]).
    pub fn follows_recorded(&self, group: GroupId) -> bool {
        let queue = self.groups.lock().get(&group).and_then(|(_, q, _)| q.upgrade());
        queue.is_some_and(|q| q.recorded_members().is_some_and(|m| !m.is_empty()))
    }

    /// The groups this node leads now, with their queues.
    fn led(&self) -> Vec<Arc<Queue>> {
        self.groups
            .lock()
            .values()
            .filter(|(tx, _, _)| matches!(&*tx.borrow(), Running::Running(r) if r.is_leader()))
            .filter_map(|(_, q, _)| q.upgrade())
            .collect()
    }
}

/// How often every group's log is looked at for a snapshot and a purge.
const COMPACT_EVERY: Duration = Duration::from_secs(1);

/// Asks each group running on this node for the snapshots and purges its log wants (by bytes, when
/// quiet, and when the node's logs together pass their budget: `RaftLogs::compaction`,
/// `RaftLogs::over_node_budget`), so a log is given back once its messages are settled rather than
/// after openraft's 5,000 entries, however large they are.
async fn compact_logs(groups: Weak<QuorumGroups>) {
    let mut tick = tokio::time::interval(COMPACT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Under a steady load the budget is passed every few seconds: said once a minute at most.
    let mut said_over: Option<tokio::time::Instant> = None;
    loop {
        tick.tick().await;
        let Some(groups) = groups.upgrade() else { return };
        let pressed = groups.logs.over_node_budget();
        if !pressed.is_empty() && said_over.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
            said_over = Some(tokio::time::Instant::now());
            tracing::info!(
                log_mib = groups.logs.log_bytes() >> 20,
                groups = pressed.len(),
                "the quorum queues' Raft logs on this node are over their budget: the largest give theirs back"
            );
        }
        // Only the groups that want something (most of 1,000 idle ones want nothing), and of
        // those the ones running here (`compaction` remembers what it asked).
        for group in groups.logs.wanting_compaction(&pressed) {
            let raft = match groups.groups.lock().get(&group).map(|(tx, _, _)| tx.borrow().clone()) {
                Some(Running::Running(raft)) => raft,
                _ => continue,
            };
            // A request waits for room in the group's command channel: a busy or stopping group is
            // passed over rather than hold up every other group's (a snapshot is asked again 10 s
            // later, a purge at the group's next snapshot).
            let wanted = groups.logs.compaction(group, pressed.contains(&group));
            if wanted.snapshot {
                tracing::debug!(group, "asking for a snapshot of the group's log");
                let _ = tokio::time::timeout(COMPACT_EVERY, raft.snapshot()).await;
            }
            if let Some(upto) = wanted.purge_upto {
                tracing::debug!(group, upto, "asking for the group's log to be purged");
                let _ = tokio::time::timeout(COMPACT_EVERY, raft.purge_log(upto)).await;
            }
        }
    }
}

/// How often a step toward a group's recorded members that keeps failing is logged as a warning.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// How often [`follow_members`] looks at the groups whose members were changed (and at once when
/// recorded members change).
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// In a cluster: keeps each group's members on this node to the recorded ones
/// (`QueueDef::members`, changed by `warren ctl remove-node` and `grow`):
///
/// - a node newly recorded as a member joins the group (starts it with no voters of its own; the
///   leader adds it as a learner, then a voter, once it has caught up);
/// - the leader moves the group's voters to the recorded members, one step at a time
///   (`ClusterNode::reconcile_members`: adds first, then hands over its own leadership if it is no
///   longer a member, then removes);
/// - a node no longer recorded leaves once the group's leader has a uniform configuration without
///   it (`ClusterNode::is_out_of`): its consumers are cancelled, its copy of the queue dropped, its
///   group stopped and its log removed (`Queue::leave_group`).
async fn follow_members(groups: Weak<QuorumGroups>) {
    loop {
        let Some(this) = groups.upgrade() else { return };
        let changed = this.following.changed.clone();
        let notified = changed.notified();
        this.follow_members_once();
        drop(this);
        let _ = tokio::time::timeout(FOLLOW_EVERY, notified).await;
    }
}

impl QuorumGroups {
    fn follow_members_once(self: &Arc<Self>) {
        let Some((node, _)) = &self.cluster else { return };
        type Followed = (GroupId, watch::Sender<Running>, Arc<Queue>, Relay);
        let entries: Vec<Followed> = {
            let reconfigured = self.following.reconfigured.lock();
            let groups = self.groups.lock();
            reconfigured
                .iter()
                .filter_map(|g| groups.get(g).and_then(|(tx, q, relay)| Some((*g, tx.clone(), q.upgrade()?, relay.clone()))))
                .collect()
        };
        for (group, tx, queue, relay) in entries {
            let Some(recorded) = queue.recorded_members() else { continue };
            let recorded: BTreeSet<NodeId> = recorded.into_iter().collect();
            if recorded.is_empty() || self.following.settled.lock().get(&group) == Some(&recorded) {
                continue;
            }
            if *relay.read() != recorded {
                *relay.write() = recorded.clone();
            }
            let member = recorded.contains(&self.node);
            let state = tx.borrow().clone();
            match state {
                Running::NotMember if member => {
                    tracing::info!(queue = %queue.name, group, members = ?recorded, "this node is a new member of the quorum queue's group: joining it");
                    tx.send_replace(Running::Starting);
                    self.start_member(node, queue, recorded, BTreeSet::new(), None, tx);
                }
                Running::NotMember => {
                    self.following.settled.lock().insert(group, recorded);
                }
                Running::Running(raft) if !member && !raft.is_leader() => {
                    if self.following.stepping.lock().insert(group) {
                        let (this, node) = (self.clone(), node.clone());
                        self.runtime.spawn(async move {
                            if node.is_out_of(group, &recorded).await {
                                this.leave(&node, group, queue, tx);
                            }
                            this.following.stepping.lock().remove(&group);
                        });
                    }
                }
                Running::Running(raft) if raft.is_leader() => {
                    if self.following.stepping.lock().insert(group) {
                        let (this, node) = (self.clone(), node.clone());
                        self.runtime.spawn(async move {
                            let step = node.reconcile_members(group, &recorded).await;
                            this.following.stepping.lock().remove(&group);
                            match step {
                                Ok(MembersStep::Done) => {
                                    this.following.warned.lock().remove(&group);
                                    this.following.settled.lock().insert(group, recorded);
                                }
                                Ok(MembersStep::Changed(what)) => {
                                    tracing::info!(queue = %queue.name, group, members = ?recorded, "{what}");
                                    // The next step at once, not at the next pass.
                                    this.following.changed.notify_one();
                                }
                                Ok(MembersStep::NotLeader) => {}
                                Ok(MembersStep::Removed(gone)) => {
                                    tracing::info!(queue = %queue.name, group, members = ?recorded, removed = ?gone, "removed from the group");
                                    // Their consumers are served by no replica now (a removed node that
                                    // is up leaves and proposes the same; one that is down never does).
                                    for node in gone {
                                        queue.consumers_down(node);
                                    }
                                    this.following.changed.notify_one();
                                }
                                Ok(MembersStep::HandedOver(to)) => {
                                    tracing::info!(queue = %queue.name, group, to, "this node is no longer a member: handing the group's leadership over")
                                }
                                Ok(MembersStep::CatchingUp(learner)) => tracing::debug!(queue = %queue.name, group, learner, "the new member is catching up"),
                                // Tried again at the next pass; said once a minute per group.
                                Err(e) => {
                                    let now = tokio::time::Instant::now();
                                    let say = this.following.warned.lock().get(&group).is_none_or(|at| now.duration_since(*at) >= WARN_EVERY);
                                    if say {
                                        this.following.warned.lock().insert(group, now);
                                        tracing::warn!(queue = %queue.name, group, members = ?recorded, error = %e, "cannot move the group to its recorded members yet");
                                    } else {
                                        tracing::debug!(queue = %queue.name, group, members = ?recorded, error = %e, "cannot move the group to its recorded members yet");
                                    }
                                }
                            }
                        });
                    }
                }
                _ => {}
            }
        }
    }

    /// This node leaves group `group` (see [`follow_members`]).
    fn leave(&self, node: &ClusterNode, group: GroupId, queue: Arc<Queue>, tx: watch::Sender<Running>) {
        tracing::info!(queue = %queue.name, group, "this node is no longer a member of the quorum queue's group: leaving it");
        tx.send_replace(Running::NotMember);
        let (node, logs) = (node.clone(), self.logs.clone());
        self.runtime.spawn(async move {
            // Stopped first: nothing more is applied to the replica it resets.
            let _ = node.stop_group(group).await;
            queue.leave_group();
            if let Err(e) = logs.remove_group(group) {
                tracing::error!(group, error = %e, "could not remove the Raft log of a group this node left");
            }
        });
    }
}

/// How long a node must stay unreachable before the groups this node leads return what its
/// consumers held: a node restarted sooner returns them itself (`ConsumerDown` first thing).
const CONSUMERS_DOWN_AFTER: Duration = Duration::from_secs(5);

/// In a cluster: when the failure detector has seen a node down for `CONSUMERS_DOWN_AFTER`, the
/// groups this node leads return what that node's consumers held (`Queue::consumers_down`).
async fn watch_nodes(groups: Weak<QuorumGroups>) {
    let mut down_since: HashMap<NodeId, Option<tokio::time::Instant>> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let Some(groups) = groups.upgrade() else { return };
        let Some((node, peers)) = &groups.cluster else { return };
        // The nodes it started with, and those added since (the metadata group's voters).
        let mut watched = node.cluster_members();
        watched.extend(peers.iter().copied());
        watched.sort_unstable();
        watched.dedup();
        for &peer in watched.iter().filter(|p| **p != groups.node) {
            if node.is_reachable(peer) {
                down_since.remove(&peer);
                continue;
            }
            let since = down_since.entry(peer).or_insert_with(|| Some(tokio::time::Instant::now()));
            if since.is_some_and(|t| t.elapsed() >= CONSUMERS_DOWN_AFTER) {
                *since = None; // once per outage
                for queue in groups.led() {
                    tracing::info!(queue = %queue.name, node = peer, "a node of the cluster is down: returning what its consumers held");
                    queue.consumers_down(peer);
                }
            }
        }
    }
}

impl QuorumHost for QuorumGroups {
    fn node_id(&self) -> u64 {
        self.node
    }

    fn classic_request(&self, node: u64, request: Bytes, done: warren_broker::queue::remote::RequestDone) {
        match self.classic.get() {
            Some(classic) => classic.request(node, request, done),
            None => done(Err("this node is not in a cluster".to_string())),
        }
    }

    fn placement(&self, group: u64, size: Option<u32>, locator: LeaderLocator) -> Option<(Vec<u64>, Option<u64>)> {
        let (_, peers) = self.cluster.as_ref()?;
        let size = size.unwrap_or(DEFAULT_GROUP_SIZE);
        Some(match locator {
            LeaderLocator::Balanced => (members_of(group, peers, size).into_iter().collect(), None),
            LeaderLocator::ClientLocal => (members_with(self.node, group, peers, size).into_iter().collect(), Some(self.node)),
        })
    }

    fn start(&self, queue: Arc<Queue>) {
        let group = queue.id;
        let members = match (&self.cluster, queue.recorded_members()) {
            (None, _) => BTreeSet::from([self.node]),
            // Recorded at the declaration: the same on every node, whatever its own peers.
            (Some(_), Some(recorded)) if !recorded.is_empty() => recorded.iter().copied().collect(),
            (Some((_, peers)), _) => members_of(group, peers, queue.args.quorum_initial_group_size.unwrap_or(DEFAULT_GROUP_SIZE)),
        };
        let member = members.contains(&self.node);
        let (tx, rx) = watch::channel(if member { Running::Starting } else { Running::NotMember });
        let relay: Relay = Arc::new(RwLock::new(members.clone()));
        {
            let mut groups = self.groups.lock();
            if groups.contains_key(&group) {
                return; // started already (declared while the node started)
            }
            groups.insert(group, (tx.clone(), Arc::downgrade(&queue), relay.clone()));
        }
        if queue.members_changed() {
            self.following.reconfigured.lock().insert(group);
        }
        let cluster = self.cluster.as_ref().map(|(node, _)| (node.clone(), group, relay));
        queue.attach_replicator(Arc::new(Group::new(rx, self.runtime.clone(), self.logs.clone(), group, cluster)));
        if !member {
            return;
        }
        if let Some((node, _)) = &self.cluster {
            let preferred = queue.recorded_leader();
            // Members changed since the declaration: the group runs, a member with no state of it
            // joins it (it was added and restarted before it got anything).
            let init = if queue.members_changed() { BTreeSet::new() } else { members.clone() };
            self.start_member(node, queue, members, init, preferred, tx);
            return;
        }
        let (logs, node, addr) = (self.logs.clone(), self.node, self.addr.clone());
        self.runtime.spawn(async move {
            let name = queue.name.clone();
            match start_single_voter(&logs, group, node, addr, QueueMachine(queue, None), None, LEAD_WITHIN).await.map(GroupRaft::from) {
                Ok(raft) => {
                    tracing::debug!(queue = %name, group, "quorum queue's group leads on this node");
                    let mut stopped = false;
                    tx.send_if_modified(|state| match state {
                        Running::Stopped => {
                            stopped = true;
                            false
                        }
                        _ => {
                            *state = Running::Running(raft.clone());
                            true
                        }
                    });
                    if stopped {
                        // Deleted while it started.
                        let _ = raft.shutdown().await;
                    }
                }
                Err(e) => {
                    tracing::error!(queue = %name, group, error = %e, "could not start a quorum queue's Raft group");
                    let _ = tx.send(Running::Failed(e.to_string()));
                }
            }
        });
    }

    fn members_changed(&self, group: u64) {
        self.following.reconfigured.lock().insert(group);
        self.following.settled.lock().remove(&group);
        self.following.changed.notify_one();
    }

    fn remove(&self, group: u64) {
        let Some((tx, _, _)) = self.groups.lock().remove(&group) else { return };
        self.following.reconfigured.lock().remove(&group);
        self.following.settled.lock().remove(&group);
        let logs = self.logs.clone();
        let node = self.cluster.as_ref().map(|(node, _)| node.clone());
        self.runtime.spawn(async move {
            let previous = tx.send_replace(Running::Stopped);
            match node {
                Some(node) => {
                    let _ = node.stop_group(group).await;
                }
                None => {
                    if let Running::Running(raft) = previous {
                        let _ = raft.shutdown().await;
                    }
                }
            }
            if let Err(e) = logs.remove_group(group) {
                tracing::error!(group, error = %e, "could not remove a deleted quorum queue's Raft log");
            }
        });
    }
}
