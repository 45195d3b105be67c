//! Start-up of this node's cluster member (`--node-id`, `--peers`, ...): the transport, the failure
//! detector and the metadata group (group 0). Without peers nothing here runs: no Raft, no cluster
//! port, no cost.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use warren_cluster::node::{group_config, NodeConfig};
use warren_broker::Broker;
use warren_cluster::{ClusterNode, GroupId, RaftLogs, StateMachine, METADATA_GROUP};

use crate::config::{ClusterSettings, Config};

/// Starts the cluster member: listens on the cluster port, connects to the peers, and starts the
/// metadata group with every node of `peers` as its voters, whose state machine is the broker's
/// durable topology (`crate::metadata_group`); from then on the broker's durable changes go
/// through it.
///
/// `rebuild`: groups whose stored log this node lost (`RaftLogs::open_discarding_damaged`): they
/// start empty and are rebuilt from the other members (`ClusterNode::rebuild_group`).
pub async fn start(config: &Config, settings: ClusterSettings, logs: &Arc<RaftLogs>, rebuild: &[GroupId], broker: &Arc<Broker>) -> Result<ClusterNode, String> {
    let node = ClusterNode::start(NodeConfig {
        node_id: settings.node_id,
        listen: settings.listen,
        peers: settings.peers.clone(),
        secret: settings.secret.into_bytes(),
        amqp_addr: config.amqp_addr().to_string(),
        raft: group_config(),
    })
    .await
    .map_err(|e| e.to_string())?;
    for &group in rebuild {
        node.rebuild_group(group);
    }
    let members: BTreeSet<u64> = settings.peers.iter().map(|(id, _)| *id).collect();
    let machine = StateMachine::open(logs, METADATA_GROUP, crate::metadata_group::TopologyMachine::new(broker.clone()))
        .await
        .map_err(|e| format!("cannot open the metadata group: {e}"))?;
    let log_store = logs.log_store(METADATA_GROUP).map_err(|e| format!("cannot open the metadata group's log: {e}"))?;
    node.start_group(METADATA_GROUP, &members, None, log_store, machine).await.map_err(|e| e.to_string())?;
    broker.set_metadata_group(Arc::new(crate::metadata_group::ClusterMetadata::new(node.clone())))?;
    tracing::info!(node_id = settings.node_id, members = ?members, "cluster member started: metadata group 0 running");
    Ok(node)
}

/// How often a cluster member asks whether it is still one (the first time, this long after start).
const MEMBERSHIP_CHECK_EVERY: Duration = Duration::from_secs(5);
/// How long a node found out of the cluster waits for its quorum queues' groups to let it go before
/// it stops: each group's leader moves this node's member elsewhere, and this node leaves the group
/// (`quorum::follow_members`; a queue whose only member was this node keeps it, and stays here).
const LEAVE_GROUPS_WAIT: Duration = Duration::from_secs(30);
/// How long a node out of a group's membership may take to leave the group itself (it hears of the
/// change through the group's log, a heartbeat later) before it stops anyway.
const LEAVE_GRACE: Duration = Duration::from_secs(5);

/// Completes once this node was taken out of the cluster (`warren ctl remove-node`, perhaps while
/// it was down: `ClusterNode::is_out_of_cluster`) and no quorum queue's group still counts it as a
/// member (or `LEAVE_GROUPS_WAIT` passed); the server then stops. No member replicates to a removed
/// node, so its topology and queues are stale from then on: serving clients with them (declaring
/// on an old view, reading queues that moved) is what it must not do. A RabbitMQ node removed with
/// `forget_cluster_node` refuses to boot in the same way.
pub async fn removed_from_cluster(node: ClusterNode, groups: Arc<crate::quorum::QuorumGroups>) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + MEMBERSHIP_CHECK_EVERY, MEMBERSHIP_CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if node.is_out_of_cluster().await {
            break;
        }
    }
    tracing::warn!(node_id = node.node_id(), "this node was removed from the cluster: stopping once its quorum queues' groups have let it go");
    let deadline = tokio::time::Instant::now() + LEAVE_GROUPS_WAIT;
    // Groups this node still runs: on a node removed while it ran, those whose leader has not moved
    // its member yet, and those it has but this node has not left yet (`quorum::follow_members`
    // cancels the group's consumers here, and what they held goes back, when it does). Stopping
    // before that closed the consumers' connections instead of cancelling them (seen in CI:
    // `test_remove_node_moves_its_members_to_another_node_and_loses_nothing`). A node removed while
    // down runs its groups from its stale view and never hears it is out: such a group counts as
    // let go `LEAVE_GRACE` after this node first found itself out of it.
    let mut holding = groups.member_of();
    let mut out_since: std::collections::HashMap<GroupId, tokio::time::Instant> = std::collections::HashMap::new();
    while !holding.is_empty() {
        let running: HashSet<GroupId> = groups.member_of().into_iter().collect();
        let mut still = Vec::new();
        for group in holding.into_iter().filter(|g| running.contains(g)) {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return;
            }
            let out = match out_since.get(&group) {
                Some(since) => Some(*since),
                None if node.is_out_of_group(group).await => Some(*out_since.entry(group).or_insert(now)),
                None => None,
            };
            if out.is_none_or(|since| now < since + LEAVE_GRACE) {
                still.push(group);
            }
        }
        holding = still;
        if !holding.is_empty() {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}
