//! Start-up of this node's cluster member (`--node-id`, `--peers`, ...): the transport, the failure
//! detector and the metadata group (group 0). Without peers nothing here runs: no Raft, no cluster
//! port, no cost.

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;
use warren_cluster::node::{group_config, NodeConfig};
use warren_cluster::{ClusterNode, GroupMachine, RaftLogs, StateMachine, METADATA_GROUP};

use crate::config::{ClusterSettings, Config};

/// The metadata group's state machine until the cluster's metadata (vhosts, exchanges, queues,
/// bindings) moves into it: it keeps only how many commands it applied, so the group elects, commits
/// and reports its leader, and `warren ctl cluster-status` shows the cluster working.
#[derive(Default)]
pub struct MetadataMachine {
    applied: u64,
}

impl GroupMachine for MetadataMachine {
    fn apply(&mut self, _index: u64, _command: &Bytes) -> Bytes {
        self.applied += 1;
        Bytes::copy_from_slice(&self.applied.to_le_bytes())
    }

    fn snapshot(&self) -> Bytes {
        Bytes::copy_from_slice(&self.applied.to_le_bytes())
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        let bytes: [u8; 8] = snapshot.try_into().map_err(|_| format!("a metadata snapshot of {} bytes, not 8", snapshot.len()))?;
        self.applied = u64::from_le_bytes(bytes);
        Ok(())
    }
}

/// Starts the cluster member: listens on the cluster port, connects to the peers, and starts the
/// metadata group with every node of `peers` as its voters.
pub async fn start(config: &Config, settings: ClusterSettings, logs: &Arc<RaftLogs>) -> Result<ClusterNode, String> {
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
    let machine = StateMachine::open(logs, METADATA_GROUP, MetadataMachine::default())
        .await
        .map_err(|e| format!("cannot open the metadata group: {e}"))?;
    let log_store = logs.log_store(METADATA_GROUP).map_err(|e| format!("cannot open the metadata group's log: {e}"))?;
    node.start_group(METADATA_GROUP, &members, log_store, machine).await.map_err(|e| e.to_string())?;
    tracing::info!(node_id = settings.node_id, members = ?members, "cluster member started: metadata group 0 running");
    Ok(node)
}
