//! Test-only switches of the cluster's transport, for in-process tests: they act only in a build
//! with the `test-hooks` feature (`make test` builds the tests with it); elsewhere they do nothing.

use crate::types::{GroupId, NodeId, TypeConfig};
use openraft::raft::AppendEntriesRequest;

#[cfg(feature = "test-hooks")]
static HELD_CONFIGS: parking_lot::Mutex<Vec<(NodeId, NodeId, GroupId)>> = parking_lot::Mutex::new(Vec::new());
#[cfg(feature = "test-hooks")]
static HELD_APPENDS: parking_lot::Mutex<Vec<(NodeId, NodeId, GroupId)>> = parking_lot::Mutex::new(Vec::new());
#[cfg(feature = "test-hooks")]
static CONFIGS_HELD: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// While set, node `from` fails every append-entries of `group` to node `to` that carries a
/// uniform membership configuration (as a link that drops them would): the leader has the
/// configuration appended, but cannot commit it without `to`. Heartbeats and other entries go.
pub fn hold_uniform_configs(from: NodeId, to: NodeId, group: GroupId, held: bool) {
    #[cfg(feature = "test-hooks")]
    {
        let mut list = HELD_CONFIGS.lock();
        list.retain(|l| *l != (from, to, group));
        if held {
            list.push((from, to, group));
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (from, to, group, held);
}

/// While set, node `from` fails every append-entries (heartbeats included) of `group` to node
/// `to`, as a replication stream that does not get through while the nodes still hear each other.
pub fn hold_appends(from: NodeId, to: NodeId, group: GroupId, held: bool) {
    #[cfg(feature = "test-hooks")]
    {
        let mut list = HELD_APPENDS.lock();
        list.retain(|l| *l != (from, to, group));
        if held {
            list.push((from, to, group));
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (from, to, group, held);
}

/// How many append-entries `hold_uniform_configs` failed so far.
pub fn uniform_configs_held() -> u64 {
    #[cfg(feature = "test-hooks")]
    {
        CONFIGS_HELD.load(std::sync::atomic::Ordering::Relaxed)
    }
    #[cfg(not(feature = "test-hooks"))]
    0
}

/// Whether `hold_appends` or `hold_uniform_configs` fails this append-entries from `from` to `to`.
pub(crate) fn holds_append(from: NodeId, to: NodeId, group: GroupId, req: &AppendEntriesRequest<TypeConfig>) -> bool {
    #[cfg(feature = "test-hooks")]
    {
        if HELD_APPENDS.lock().contains(&(from, to, group)) {
            return true;
        }
        let list = HELD_CONFIGS.lock();
        if list.is_empty() || !list.contains(&(from, to, group)) {
            return false;
        }
        let uniform = req.entries.iter().any(|e| matches!(&e.payload, openraft::EntryPayload::Membership(m) if m.get_joint_config().len() == 1));
        if uniform {
            CONFIGS_HELD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        uniform
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = (from, to, group, req);
        false
    }
}
