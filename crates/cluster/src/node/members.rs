//! A group's voters follow the members recorded for it (`warren ctl remove-node`, `grow`): the
//! group's leader moves its Raft membership toward them one step at a time, and the caller (the
//! server's quorum groups, once a second) asks again until nothing is left to do.
//!
//! A step is one of, in this order:
//!
//! - **Add a recorded member that is not a voter.** It is added as a learner first, and becomes a
//!   voter (joint consensus) at a later call, once it is within [`CATCH_UP_LAG`] entries of the
//!   leader's log, so the quorum does not count on a node that has not got the log yet. The new
//!   member must have joined the group (`ClusterNode::start_group` with no members), or the
//!   learner never catches up. A large backlog reaches it as a snapshot, and the bodies follow.
//! - **Hand the leadership over**, if this node is not among the recorded members: to a recorded
//!   member that is a voter, up and caught up. A leader does not remove itself: the next leader
//!   removes it, so the group always has a leader that stays.
//! - **Remove the voters and learners that are not recorded.**
//!
//! Adds come before removals: replacing a member never leaves the group with fewer copies than
//! before, even for a moment.

use std::collections::{BTreeMap, BTreeSet};

use openraft::{ChangeMembers, RaftMetrics, ServerState};
use serde::{Deserialize, Serialize};

use super::{AdminRequest, ClusterNode, WriteOutcome, PEER_CALL_TIMEOUT};
use crate::transport::{LinkKind, Rpc};
use crate::types::{GroupId, NodeId, TypeConfig, METADATA_GROUP};

/// How many entries an added member may be behind the leader's log when it becomes a voter: a
/// few round trips' worth of a busy group's entries (each carries a batch of commands).
pub const CATCH_UP_LAG: u64 = 64;

/// How far `peer`'s replication is behind the leader's last log entry (None: nothing matched yet).
fn lag(m: &RaftMetrics<TypeConfig>, peer: NodeId) -> Option<u64> {
    let matched = m.replication.as_ref()?.get(&peer)?.as_ref()?.index;
    Some(m.last_log_index.unwrap_or(0).saturating_sub(matched))
}

/// What a node answers about a group's membership when another asks ([`ClusterNode::is_out_of`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GroupMembership {
    pub leader: bool,
    /// Not in a joint configuration.
    pub uniform: bool,
    /// Its voters and learners.
    pub nodes: Vec<NodeId>,
    /// The index of the last entry in its log (absent from older nodes' answers).
    #[serde(default)]
    pub last_log_index: Option<u64>,
}

/// What one step of [`ClusterNode::reconcile_members`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembersStep {
    /// This node does not lead the group (or does not run it): its leader does the steps.
    NotLeader,
    /// The voters are the recorded members.
    Done,
    /// One step was taken (what it was, for the log).
    Changed(String),
    /// This node, no longer a member, started handing its leadership to this member (which takes
    /// the next steps).
    HandedOver(NodeId),
    /// These nodes are no longer voters or learners of the group: what their consumers held is the
    /// caller's to return (a removed node that is down never does it itself).
    Removed(BTreeSet<NodeId>),
    /// The learner is catching up: it becomes a voter at a later call.
    CatchingUp(NodeId),
}

impl ClusterNode {
    /// On the group's leader: takes one step toward voters `wanted` (see the module's doc).
    pub async fn reconcile_members(&self, group: GroupId, wanted: &BTreeSet<NodeId>) -> Result<MembersStep, String> {
        let Some(h) = self.handle(group) else { return Ok(MembersStep::NotLeader) };
        let m = h.metrics();
        if m.state != ServerState::Leader {
            return Ok(MembersStep::NotLeader);
        }
        let membership = m.membership_config.membership();
        // In a joint configuration (a change that a leader before this one began), the newest half
        // is where the group is going: openraft completes it with the next change.
        let voters: BTreeSet<NodeId> = membership.get_joint_config().last().cloned().unwrap_or_default();
        let learners: BTreeSet<NodeId> = membership.learner_ids().collect();
        if wanted.is_empty() {
            return Ok(MembersStep::Done);
        }
        if let Some(&add) = wanted.difference(&voters).next() {
            if !learners.contains(&add) {
                let addr = self.node_addr(add).ok_or_else(|| format!("node {add} has no known address"))?;
                let mut nodes = BTreeMap::new();
                nodes.insert(add, addr);
                return match h.change_membership(ChangeMembers::AddNodes(nodes), None).await {
                    WriteOutcome::Applied(_) => Ok(MembersStep::Changed(format!("node {add} added as a learner: it catches up before it votes"))),
                    WriteOutcome::NotLeader(_) => Ok(MembersStep::NotLeader),
                    WriteOutcome::Unknown(e) | WriteOutcome::Fatal(e) => Err(format!("adding node {add} as a learner: {e}")),
                };
            }
            if lag(&m, add).is_none_or(|lag| lag > CATCH_UP_LAG) {
                return Ok(MembersStep::CatchingUp(add));
            }
            return match h.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([add])), None).await {
                WriteOutcome::Applied(_) => Ok(MembersStep::Changed(format!("node {add} caught up and is a voter"))),
                WriteOutcome::NotLeader(_) => Ok(MembersStep::NotLeader),
                WriteOutcome::Unknown(e) | WriteOutcome::Fatal(e) => Err(format!("making node {add} a voter: {e}")),
            };
        }
        let me = self.inner.id;
        if !wanted.contains(&me) {
            // The voter least behind (a busy group's followers are rarely at the very last entry:
            // the target waits for the leader's last entry before it campaigns).
            let to = wanted
                .iter()
                .copied()
                .filter(|v| voters.contains(v) && self.may_lead(*v))
                .filter_map(|v| Some((lag(&m, v).filter(|l| *l <= CATCH_UP_LAG)?, v)))
                .min()
                .map(|(_, v)| v);
            let Some(to) = to else { return Err("no recorded member is up and caught up to hand the leadership to".to_string()) };
            self.start_transfer(group, &h, to).await?;
            return Ok(MembersStep::HandedOver(to));
        }
        // Voters removed without being kept as learners (`change_membership(.., retain: false)`);
        // learners left over (an add that never finished) are removed on their own.
        let extra_voters: BTreeSet<NodeId> = membership.voter_ids().filter(|n| !wanted.contains(n)).collect();
        let extra_learners: BTreeSet<NodeId> = learners.iter().filter(|n| !wanted.contains(n)).copied().collect();
        let (change, extra) = if !extra_voters.is_empty() {
            (ChangeMembers::RemoveVoters(extra_voters.clone()), extra_voters)
        } else if !extra_learners.is_empty() {
            (ChangeMembers::RemoveNodes(extra_learners.clone()), extra_learners)
        } else {
            return Ok(MembersStep::Done);
        };
        match h.change_membership(change, None).await {
            WriteOutcome::Applied(_) => Ok(MembersStep::Removed(extra)),
            WriteOutcome::NotLeader(_) => Ok(MembersStep::NotLeader),
            WriteOutcome::Unknown(e) | WriteOutcome::Fatal(e) => Err(format!("removing nodes {extra:?}: {e}")),
        }
    }

    /// The group's last *committed* membership as this node knows it (None: the group does not run
    /// here). Not the effective one: a leader may have appended a configuration without a node and
    /// lose its leadership before committing it, and the next leader's joint configuration may still
    /// need that node; a node that left on the strength of it (`is_out_of`) would take a voter away
    /// from a group that counts on it.
    pub fn group_membership(&self, group: GroupId) -> Option<GroupMembership> {
        let m = self.handle(group)?.metrics();
        let membership = m.committed_membership_config.membership();
        Some(GroupMembership {
            leader: m.state == ServerState::Leader,
            uniform: membership.get_joint_config().len() == 1,
            nodes: membership.nodes().map(|(id, _)| *id).collect(),
            last_log_index: m.last_log_index,
        })
    }

    /// Whether no peer among `members` that answers within `timeout` has a longer log of `group`
    /// than this node: then a vote for this node cannot be refused for its log being behind.
    pub(super) async fn has_longest_log(&self, group: GroupId, members: &[NodeId], timeout: std::time::Duration) -> bool {
        let Some(h) = self.handle(group) else { return false };
        let mine = h.metrics().last_log_index;
        for peer in members.iter().copied().filter(|m| *m != self.inner.id) {
            let asked = tokio::time::timeout(timeout, self.ask_membership(peer, group)).await;
            if let Ok(Some(theirs)) = asked {
                if theirs.last_log_index > mine {
                    return false;
                }
            }
        }
        true
    }

    /// Whether this node is out of the group for good: the group's leader, asked among `members`,
    /// has committed a uniform configuration without it. Its own view cannot say: the leader stops sending
    /// to a node as soon as it appends the configuration without it, so the node may never hear
    /// of the change.
    pub async fn is_out_of(&self, group: GroupId, members: &BTreeSet<NodeId>) -> bool {
        let me = self.inner.id;
        let mut order: Vec<NodeId> = members.iter().copied().filter(|m| *m != me).collect();
        if let Some(leader) = self.leader(group).filter(|l| *l != me) {
            order.retain(|m| *m != leader);
            order.insert(0, leader);
        }
        for peer in order {
            if let Some(theirs) = self.ask_membership(peer, group).await.filter(|m| m.leader) {
                return theirs.uniform && !theirs.nodes.contains(&me);
            }
        }
        false
    }

    /// Whether this node was taken out of the cluster (`warren ctl remove-node`, perhaps while it was
    /// down): it was a member of the metadata group (its own view has a configuration) and the
    /// group's leader, asked among the nodes this one knows, has a uniform configuration without it.
    /// A node started to be added (`add-node` not run yet) has no configuration: it is not out.
    pub async fn is_out_of_cluster(&self) -> bool {
        let Some(mine) = self.group_membership(METADATA_GROUP) else { return false };
        if mine.nodes.is_empty() {
            return false;
        }
        self.is_out_of(METADATA_GROUP, &self.known_nodes()).await
    }

    /// [`ClusterNode::is_out_of`] `group`, asking every node this one knows (its own view of the
    /// group's members may be stale: a node that was down when it was moved elsewhere).
    pub async fn is_out_of_group(&self, group: GroupId) -> bool {
        self.is_out_of(group, &self.known_nodes()).await
    }

    /// Every node this one knows of: its peers (those it was started with and those it learnt) and
    /// the metadata group's members as it sees them.
    fn known_nodes(&self) -> BTreeSet<NodeId> {
        let members = self.group_membership(METADATA_GROUP).map(|m| m.nodes).unwrap_or_default();
        self.inner.transport.peers().into_iter().chain(members).filter(|n| *n != self.inner.id).collect()
    }

    /// Whether another of `members` runs the group with members (it was initialized).
    pub(super) async fn group_runs_elsewhere(&self, group: GroupId, members: &BTreeSet<NodeId>) -> bool {
        for peer in members.iter().copied().filter(|m| *m != self.inner.id) {
            if self.ask_membership(peer, group).await.is_some_and(|theirs| !theirs.nodes.is_empty()) {
                return true;
            }
        }
        false
    }

    /// The group's membership as `peer` knows it (None: it did not answer, or does not run it).
    async fn ask_membership(&self, peer: NodeId, group: GroupId) -> Option<GroupMembership> {
        let payload = serde_json::to_vec(&AdminRequest::GroupMembership { group }).ok()?;
        let answer = self.inner.transport.request(peer, LinkKind::Bulk, Rpc::Admin, group, &payload, PEER_CALL_TIMEOUT).await.ok()?;
        serde_json::from_slice(&answer).ok()
    }

    /// The cluster's nodes: the metadata group's voters, as this node knows them.
    pub fn cluster_members(&self) -> Vec<NodeId> {
        let Some(h) = self.handle(METADATA_GROUP) else { return vec![self.inner.id] };
        h.metrics().membership_config.membership().voter_ids().collect()
    }
}
