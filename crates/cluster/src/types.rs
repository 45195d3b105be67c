//! The openraft type configuration every group on a node shares, and the Warren-side values it carries.
//!
//! Only this module, the log-store and state-machine adapters and the transport name openraft types;
//! what is stored (`log_store`'s records) and what a state machine sees (`Command` bytes) are Warren's,
//! so the library can be swapped (docs/internals/cluster.md).

use std::fmt;

use bytes::Bytes;

/// A node of the cluster (`--node-id`).
pub type NodeId = u64;

/// A Raft group on the node. Group 0 is the cluster's metadata; a quorum queue's group is its queue id.
pub type GroupId = u64;

/// The metadata group (vhosts, users, exchanges, queues, bindings, policies).
pub const METADATA_GROUP: GroupId = 0;

/// Where a member listens: its cluster address (Raft and forwarding) and its AMQP address (for
/// clients told to reconnect, and for `warren ctl cluster-status`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeAddr {
    pub cluster_addr: String,
    pub amqp_addr: String,
}

/// A command proposed to a group: opaque to Raft, decoded by the group's state machine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Command(pub Bytes);

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "command({} bytes)", self.0.len())
    }
}

/// What applying a command returned to its proposer: opaque, encoded by the state machine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reply(pub Bytes);

openraft::declare_raft_types!(
    /// The type configuration of every Warren Raft group.
    pub TypeConfig:
        D = Command,
        R = Reply,
        NodeId = NodeId,
        Node = NodeAddr,
);

/// openraft's types under Warren's configuration.
pub type Raft<SM> = openraft::Raft<TypeConfig, SM>;
pub type Entry = <TypeConfig as openraft::RaftTypeConfig>::Entry;
/// (term, leader node): what a log id names its leader by.
pub type CommittedLeaderId = openraft::impls::leader_id_adv::LeaderId<u64, NodeId>;
pub type LogId = openraft::LogId<CommittedLeaderId>;
pub type Vote = <TypeConfig as openraft::RaftTypeConfig>::Vote;
pub type Membership = openraft::Membership<NodeId, NodeAddr>;
