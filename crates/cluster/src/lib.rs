//! Warren's cluster: Raft groups (group 0 for metadata, one per quorum queue) through openraft,
//! their logs in the node's write-ahead log. The plan and the contracts: docs/internals/cluster.md.

pub mod codec;
pub mod detector;
pub mod group;
pub mod handshake_slots;
pub mod log_store;
pub mod machine;
pub mod node;
pub mod single_voter;
pub mod test_hooks;
pub mod transport;
pub mod types;

pub use group::GroupRaft;
pub use node::{ClusterNode, ClusterStatus, MemberStatus, NodeConfig, ProposeError};
pub use types::{Command, GroupId, NodeAddr, NodeId, Reply, TypeConfig, METADATA_GROUP};
pub use log_store::{Compaction, LogStore, LogStoreError, LogsOptions, RaftLogs, RecoveryStats, RAFT_LOG, RAFT_STATE};
pub use machine::{GroupMachine, GroupSnapshot, SnapshotData, StateMachine};
pub use single_voter::{single_voter_config, start_single_voter};
