//! The cluster's metadata group (group 0) over the broker: its state machine is the broker's
//! durable topology (`Broker::apply_metadata_entry`, `metadata_snapshot`,
//! `restore_metadata_snapshot`), and the broker proposes through this node's `ClusterNode`
//! (docs/internals/cluster.md, "Metadata group"; docs/internals/metadata.md).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use warren_broker::metadata::group::{decode_reply, BoxFuture, Committed, MetadataGroup, ProposeFailed};
use warren_broker::queue::remote::wire::Request;
use warren_broker::Broker;
use warren_cluster::{ClusterNode, Command, GroupMachine, ProposeError, METADATA_GROUP};

/// Group 0's state machine: every committed entry goes to the broker, in log order.
pub struct TopologyMachine {
    broker: Arc<Broker>,
}

impl TopologyMachine {
    pub fn new(broker: Arc<Broker>) -> TopologyMachine {
        TopologyMachine { broker }
    }
}

impl GroupMachine for TopologyMachine {
    fn apply(&mut self, index: u64, command: &Bytes) -> Bytes {
        self.broker.apply_metadata_entry(index, command)
    }

    fn snapshot(&self) -> Result<Bytes, String> {
        Ok(self.broker.metadata_snapshot())
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        self.broker.restore_metadata_snapshot(snapshot)
    }
}

/// How the broker proposes to group 0: through the node (forwarded to the leader).
pub struct ClusterMetadata {
    node: ClusterNode,
}

impl ClusterMetadata {
    pub fn new(node: ClusterNode) -> ClusterMetadata {
        ClusterMetadata { node }
    }
}

impl MetadataGroup for ClusterMetadata {
    fn propose(&self, entry: Bytes, timeout: Duration) -> BoxFuture<Result<Committed, ProposeFailed>> {
        let node = self.node.clone();
        Box::pin(async move {
            // A leader without a quorum keeps an appended entry waiting for its commit: bound the
            // wait here. The entry may then still be committed later, so its outcome is unknown.
            let proposed = tokio::time::timeout(timeout, node.propose(METADATA_GROUP, Command(entry), timeout)).await;
            match proposed {
                Ok(Ok(reply)) => decode_reply(&reply.0).map_err(|e| ProposeFailed::NotCommitted(format!("refused: {e}"))),
                Ok(Err(e @ (ProposeError::Timeout(..) | ProposeError::NoGroup(_)))) => Err(ProposeFailed::NotCommitted(e.to_string())),
                Ok(Err(e @ (ProposeError::Unknown(..) | ProposeError::Fatal(..)))) => Err(ProposeFailed::Unknown(e.to_string())),
                Err(_) => Err(ProposeFailed::Unknown(format!("no quorum of the metadata group answered within {timeout:?}"))),
            }
        })
    }

    fn read_barrier(&self, timeout: Duration) -> Option<BoxFuture<Result<(), String>>> {
        let node = self.node.clone();
        Some(Box::pin(async move { node.linearize(METADATA_GROUP, timeout).await.map_err(|e| e.to_string()) }))
    }

    fn wait_applied_elsewhere(&self, index: u64, timeout: Duration) -> BoxFuture<Vec<u64>> {
        let node = self.node.clone();
        Box::pin(async move {
            let me = node.node_id();
            let request = Request::Applied { index }.encode();
            let mut asks = tokio::task::JoinSet::new();
            for peer in node.cluster_members().into_iter().filter(|peer| *peer != me && node.is_reachable(*peer)) {
                let (node, request) = (node.clone(), request.clone());
                asks.spawn(async move { (peer, node.classic_request(peer, &request, timeout).await.is_ok()) });
            }
            let mut lagging = Vec::new();
            while let Some(answer) = asks.join_next().await {
                if let Ok((peer, false)) = answer {
                    lagging.push(peer);
                }
            }
            lagging
        })
    }
}
