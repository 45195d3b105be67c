//! Warren's cluster: Raft groups (group 0 for metadata, one per quorum queue) through openraft,
//! their logs in the node's write-ahead log. The plan and the contracts: docs/internals/cluster.md.

pub mod detector;
pub mod node;
pub mod transport;
pub mod types;

pub use node::{ClusterNode, ClusterStatus, NodeConfig, ProposeError};
pub use openraft;
pub use types::{Command, GroupId, NodeAddr, NodeId, Reply, TypeConfig, METADATA_GROUP};
