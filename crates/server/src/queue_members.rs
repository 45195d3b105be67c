//! `warren ctl remove-node` and `grow`: the members of quorum queues' groups, recorded in the
//! metadata group (`metadata::Op::QueueMembers`), which every group's leader then follows
//! (`quorum::follow_members`).
//!
//! - **remove-node N**: each queue with a member on N gets one on another node of the cluster in its
//!   place (the one its queue id picks among those it has no member on), so it keeps as many copies;
//!   where the cluster has no other node, it only loses N's. A queue whose only member is N keeps
//!   it when no other node can take its place.
//! - **grow N**: each queue without a member on N gets one (RabbitMQ's `rabbitmq-queues grow N all`);
//!   N must be a member of the cluster (`add-node` first).

use std::sync::{Arc, Weak};

use warren_broker::Broker;
use warren_cluster::node::{MembersChange, QueueMembers};
use warren_cluster::transport::BoxFuture;
use warren_cluster::{ClusterNode, GroupId, NodeId};

use crate::quorum::QuorumGroups;

/// A quorum queue's recorded members: (vhost, name, queue id, members).
type Recorded = (String, String, u64, Vec<u64>);

pub struct QueueMembersAdmin {
    broker: Weak<Broker>,
    node: ClusterNode,
    groups: Weak<QuorumGroups>,
}

impl QueueMembersAdmin {
    pub fn install(broker: &Arc<Broker>, node: &ClusterNode, groups: &Arc<QuorumGroups>) {
        let admin = QueueMembersAdmin { broker: Arc::downgrade(broker), node: node.clone(), groups: Arc::downgrade(groups) };
        node.set_queue_members(Arc::new(admin));
    }
}

impl QueueMembers for QueueMembersAdmin {
    fn change(&self, change: MembersChange) -> BoxFuture<Result<String, String>> {
        let (broker, cluster) = (self.broker.clone(), self.node.cluster_members());
        Box::pin(async move {
            let broker = broker.upgrade().ok_or("the node is stopping")?;
            // Off the runtime's workers: the read barrier and the commits wait for the group.
            tokio::task::spawn_blocking(move || {
                if let MembersChange::Remove(gone) = change {
                    refuse_stranding(gone, broker.classic_queues_homed_on(gone))?;
                }
                let (changes, summary) = plan(change, &cluster, broker.quorum_members())?;
                if !changes.is_empty() {
                    broker.set_quorum_members(changes)?;
                }
                Ok(summary)
            })
            .await
            .map_err(|e| e.to_string())?
        })
    }

    fn follows_recorded(&self, group: GroupId) -> bool {
        self.groups.upgrade().is_some_and(|g| g.follows_recorded(group))
    }
}

/// `remove-node` of a node that is the home of classic queues is refused: their messages are only
/// there (a classic queue is not replicated), so removing the node would strand them, with every
/// other node still routing to a queue no node serves. Delete them first, or move their messages
/// to a quorum queue.
fn refuse_stranding(gone: NodeId, homed: Vec<(String, String)>) -> Result<(), String> {
    if homed.is_empty() {
        return Ok(());
    }
    let named: Vec<String> = homed.iter().take(10).map(|(vhost, name)| format!("'{name}' (vhost '{vhost}')")).collect();
    let more = if homed.len() > 10 { format!(" and {} more", homed.len() - 10) } else { String::new() };
    Err(format!(
        "node {gone} is the home of {} classic queue(s): {}{more}. A classic queue's messages live only on its home \
         node, so removing it would strand them; delete those queues (or move their messages to a quorum queue) \
         first, then remove the node",
        homed.len(),
        named.join(", ")
    ))
}

/// The queues whose members change, with their new members, and what that is, in words.
fn plan(change: MembersChange, cluster: &[NodeId], queues: Vec<Recorded>) -> Result<(Vec<Recorded>, String), String> {
    let mut changes = Vec::new();
    match change {
        MembersChange::Remove(gone) => {
            let mut kept = 0;
            for (vhost, name, id, members) in queues {
                if !members.contains(&gone) {
                    continue;
                }
                let mut candidates: Vec<NodeId> = cluster.iter().copied().filter(|n| *n != gone && !members.contains(n)).collect();
                candidates.sort_unstable();
                let mut new: Vec<u64> = members.iter().copied().filter(|m| *m != gone).collect();
                if !candidates.is_empty() {
                    new.push(candidates[(id % candidates.len() as u64) as usize]);
                }
                if new.is_empty() {
                    kept += 1;
                    continue;
                }
                new.sort_unstable();
                changes.push((vhost, name, id, new));
            }
            let mut summary = format!("{} quorum queues move their member on node {gone} to another node or drop it", changes.len());
            if kept > 0 {
                summary.push_str(&format!("; {kept} whose only member is on node {gone} keep it (no other node can take it)"));
            }
            Ok((changes, summary))
        }
        MembersChange::Grow(node) => {
            if !cluster.contains(&node) {
                return Err(format!("node {node} is not a member of the cluster (add it with `warren ctl add-node` first)"));
            }
            for (vhost, name, id, mut members) in queues {
                if members.contains(&node) {
                    continue;
                }
                members.push(node);
                members.sort_unstable();
                changes.push((vhost, name, id, members));
            }
            let summary = format!("{} quorum queues get a member on node {node}", changes.len());
            Ok((changes, summary))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(id: u64, members: &[u64]) -> Recorded {
        ("/".to_string(), format!("q{id}"), id, members.to_vec())
    }

    #[test]
    fn a_removed_node_is_replaced_by_one_the_queue_has_no_member_on() {
        let (changes, _) = plan(MembersChange::Remove(3), &[1, 2, 3, 4, 5], vec![q(10, &[1, 2, 3]), q(11, &[1, 2, 3]), q(12, &[1, 2, 4])]).unwrap();
        assert_eq!(changes.len(), 2, "the queue without a member on 3 is left alone");
        // Candidates 4 and 5, picked by queue id: spread over them.
        assert_eq!(changes[0].3, vec![1, 2, 4]);
        assert_eq!(changes[1].3, vec![1, 2, 5]);
    }

    #[test]
    fn without_another_node_a_queue_only_loses_the_removed_member_and_never_its_last() {
        let (changes, _) = plan(MembersChange::Remove(3), &[1, 2, 3], vec![q(10, &[1, 2, 3])]).unwrap();
        assert_eq!(changes, vec![q(10, &[1, 2])]);
        // The only member moves to another node; with none, it stays.
        let (changes, _) = plan(MembersChange::Remove(3), &[1, 3], vec![q(11, &[3])]).unwrap();
        assert_eq!(changes, vec![q(11, &[1])]);
        let (changes, summary) = plan(MembersChange::Remove(3), &[3], vec![q(11, &[3])]).unwrap();
        assert!(changes.is_empty());
        assert!(summary.contains("1 whose only member is on node 3 keep it"), "{summary}");
    }

    #[test]
    fn grow_adds_the_node_where_it_is_missing_and_refuses_a_node_outside_the_cluster() {
        let (changes, _) = plan(MembersChange::Grow(4), &[1, 2, 3, 4], vec![q(10, &[1, 2, 3]), q(11, &[2, 4])]).unwrap();
        assert_eq!(changes, vec![q(10, &[1, 2, 3, 4])]);
        let e = plan(MembersChange::Grow(9), &[1, 2, 3], vec![q(10, &[1, 2, 3])]).unwrap_err();
        assert!(e.contains("add-node"), "{e}");
    }
}
