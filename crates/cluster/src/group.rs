//! A running Raft group as the rest of Warren drives it: submit a command and await its reply,
//! whether this node leads, compaction requests, shutdown. openraft stays inside this crate: the
//! server holds a [`GroupRaft`], never an `openraft::Raft`.

use std::future::Future;

use bytes::Bytes;
use openraft::impls::ProgressResponder;
use openraft::storage::RaftStateMachine;

use crate::types::{Command, TypeConfig};

/// A group's Raft on this node. Cheap to clone.
pub struct GroupRaft<SM: RaftStateMachine<TypeConfig>>(crate::types::Raft<SM>);

impl<SM: RaftStateMachine<TypeConfig>> Clone for GroupRaft<SM> {
    fn clone(&self) -> Self {
        GroupRaft(self.0.clone())
    }
}

impl<SM: RaftStateMachine<TypeConfig>> From<crate::types::Raft<SM>> for GroupRaft<SM> {
    fn from(raft: crate::types::Raft<SM>) -> Self {
        GroupRaft(raft)
    }
}

impl<SM: RaftStateMachine<TypeConfig>> GroupRaft<SM> {
    pub fn is_leader(&self) -> bool {
        self.0.is_leader()
    }

    /// Appends `command` (this node must lead: a follower's submit fails, forward instead) and
    /// returns, once it is in the leader's queue, the wait for its reply: the state machine's
    /// answer once committed and applied, or why there is none (the group stopped, leadership lost).
    pub async fn submit(&self, command: Bytes) -> Result<impl Future<Output = Result<Bytes, String>> + Send + 'static, String> {
        let (responder, committed, reply) = ProgressResponder::new();
        self.0.client_write_ff(Command(command), Some(responder)).await.map_err(|e| e.to_string())?;
        Ok(async move {
            // The commit notice is not used, but its receiver must live until the reply
            // (openraft warns otherwise).
            let _committed = committed;
            match reply.await {
                Ok(Ok(written)) => Ok(written.data.0),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("the group stopped before applying the entry".to_string()),
            }
        })
    }

    /// Asks for a snapshot now (returns once asked, not once taken).
    pub async fn snapshot(&self) {
        let _ = self.0.trigger().snapshot().await;
    }

    /// Asks for the log to be purged up to `index` (at most to the last snapshot).
    pub async fn purge_log(&self, index: u64) {
        let _ = self.0.trigger().purge_log(index).await;
    }

    pub async fn shutdown(&self) {
        let _ = self.0.shutdown().await;
    }
}
