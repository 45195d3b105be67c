//! Start-up of this node's cluster member (`--node-id`, `--peers`, ...): the transport, the failure
//! detector and the metadata group (group 0). Without peers nothing here runs: no Raft, no cluster
//! port, no cost.

use std::collections::BTreeSet;
use std::sync::Arc;

use warren_cluster::node::{group_config, NodeConfig};
use warren_broker::Broker;
use warren_cluster::{ClusterNode, RaftLogs, StateMachine, METADATA_GROUP};

use crate::config::{ClusterSettings, Config};

/// Starts the cluster member: listens on the cluster port, connects to the peers, and starts the
/// metadata group with every node of `peers` as its voters, whose state machine is the broker's
/// durable topology (`crate::metadata_group`); from then on the broker's durable changes go
/// through it.
pub async fn start(config: &Config, settings: ClusterSettings, logs: &Arc<RaftLogs>, broker: &Arc<Broker>) -> Result<ClusterNode, String> {
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
