//! The Raft groups of this node's quorum queues: the broker's [`QuorumHost`] and [`Replicator`]
//! over openraft (through `warren_cluster`), so that the broker crate stays free of the library.
//!
//! Each quorum queue is a group whose id is the queue's id; its state machine is the queue itself
//! ([`QueueMachine`] hands committed entries to `Queue::apply_replicated`, which applies them to the
//! queue's `QuorumMachine` and performs the effects on this node). Standalone (no `--peers`), a
//! group has one voter, this node: a commit is the local fsync of the entry, in the node's one WAL.
//!
//! A proposal that is not committed and applied within [`QUORUM_TIMEOUT`] (no leader, no majority:
//! the minority side of a partition) fails: its publishers get basic.nack (a retry may duplicate).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use warren_cluster::openraft::impls::ProgressResponder;
use warren_broker::queue::replica::{ProposeDone, QuorumHost, Replicator};
use warren_broker::Queue;
use warren_cluster::machine::StateMachine;
use warren_cluster::{start_single_voter, Command, GroupId, GroupMachine, NodeAddr, NodeId, RaftLogs};

/// How long a proposal may wait for its commit and apply before its publishers are nacked.
pub const QUORUM_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a (re)started single-voter group may take to lead (replaying its log first).
const LEAD_WITHIN: Duration = Duration::from_secs(60);

type QueueRaft = warren_cluster::types::Raft<StateMachine<QueueMachine>>;

/// A quorum queue as its group's state machine.
pub struct QueueMachine(Arc<Queue>);

impl GroupMachine for QueueMachine {
    fn apply(&mut self, index: u64, command: &Bytes) -> Bytes {
        self.0.apply_replicated(index, command)
    }

    fn snapshot(&self) -> Bytes {
        self.0.snapshot_replicated()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        self.0.restore_replicated(snapshot)
    }
}

/// The state of one group's Raft on this node.
#[derive(Clone)]
enum Running {
    Starting,
    Running(QueueRaft),
    Failed(String),
    Stopped,
}

/// One group, as the broker's replica proposes to it. Proposals go to the group in the order they
/// were made (one task submits them), several at a time: a reply is awaited on its own task.
pub struct Group {
    raft: watch::Receiver<Running>,
    proposals: mpsc::UnboundedSender<(Bytes, ProposeDone)>,
    runtime: tokio::runtime::Handle,
}

impl Group {
    fn new(raft: watch::Receiver<Running>, runtime: tokio::runtime::Handle) -> Group {
        let (proposals, rx) = mpsc::unbounded_channel();
        runtime.spawn(submit_in_order(raft.clone(), rx));
        Group { raft, proposals, runtime }
    }
}

impl Replicator for Group {
    fn propose(&self, entry: Bytes, done: ProposeDone) {
        if let Err(mpsc::error::SendError((_, done))) = self.proposals.send((entry, done)) {
            self.runtime.spawn(async move { done(Err("the queue's Raft group was stopped".to_string())) });
        }
    }

    fn is_leader(&self) -> bool {
        matches!(&*self.raft.borrow(), Running::Running(r) if r.is_leader())
    }
}

/// The group's Raft once it runs (waiting while it starts).
async fn running(raft: &mut watch::Receiver<Running>) -> Result<QueueRaft, String> {
    loop {
        match &*raft.borrow_and_update() {
            Running::Running(r) => return Ok(r.clone()),
            Running::Failed(e) => return Err(format!("the queue's Raft group did not start: {e}")),
            Running::Stopped => return Err("the queue's Raft group was stopped".to_string()),
            Running::Starting => {}
        }
        if raft.changed().await.is_err() {
            return Err("the queue's Raft group was stopped".to_string());
        }
    }
}

/// Submits a group's proposals in order; each one's reply (or its timeout) ends it.
async fn submit_in_order(mut raft: watch::Receiver<Running>, mut proposals: mpsc::UnboundedReceiver<(Bytes, ProposeDone)>) {
    while let Some((entry, done)) = proposals.recv().await {
        let deadline = tokio::time::Instant::now() + QUORUM_TIMEOUT;
        let group = match tokio::time::timeout_at(deadline, running(&mut raft)).await {
            Ok(Ok(group)) => group,
            Ok(Err(e)) => {
                done(Err(e));
                continue;
            }
            Err(_) => {
                done(Err(format!("the queue's Raft group did not start within {} s", QUORUM_TIMEOUT.as_secs())));
                continue;
            }
        };
        // The commit notice is not used, but its receiver must live until then (openraft warns otherwise).
        let (responder, committed, reply) = ProgressResponder::new();
        if let Err(e) = group.client_write_ff(Command(entry), Some(responder)).await {
            done(Err(e.to_string()));
            continue;
        }
        tokio::spawn(async move {
            let _committed = committed;
            let result = match tokio::time::timeout_at(deadline, reply).await {
                Ok(Ok(Ok(written))) => Ok(written.data.0),
                Ok(Ok(Err(e))) => Err(e.to_string()),
                Ok(Err(_)) => Err("the queue's Raft group stopped before applying the entry".to_string()),
                Err(_) => Err(format!("not committed within {} s", QUORUM_TIMEOUT.as_secs())),
            };
            done(result);
        });
    }
}

/// This node's quorum-queue groups.
pub struct QuorumGroups {
    logs: Arc<RaftLogs>,
    node: NodeId,
    addr: NodeAddr,
    runtime: tokio::runtime::Handle,
    groups: Mutex<HashMap<GroupId, watch::Sender<Running>>>,
}

impl QuorumGroups {
    pub fn new(logs: Arc<RaftLogs>, node: NodeId, addr: NodeAddr) -> Arc<QuorumGroups> {
        Arc::new(QuorumGroups { logs, node, addr, runtime: tokio::runtime::Handle::current(), groups: Mutex::new(HashMap::new()) })
    }

    /// Stops every group (shutdown), so none applies anything while the store closes.
    pub async fn shutdown(&self) {
        let senders: Vec<watch::Sender<Running>> = self.groups.lock().drain().map(|(_, tx)| tx).collect();
        for tx in senders {
            let previous = tx.send_replace(Running::Stopped);
            if let Running::Running(raft) = previous {
                let _ = raft.shutdown().await;
            }
        }
    }
}

impl QuorumHost for QuorumGroups {
    fn node_id(&self) -> u64 {
        self.node
    }

    fn start(&self, queue: Arc<Queue>) {
        let group = queue.id;
        let (tx, rx) = watch::channel(Running::Starting);
        {
            let mut groups = self.groups.lock();
            if groups.contains_key(&group) {
                return; // started already (declared while the node started)
            }
            groups.insert(group, tx.clone());
        }
        queue.attach_replicator(Arc::new(Group::new(rx, self.runtime.clone())));
        let (logs, node, addr) = (self.logs.clone(), self.node, self.addr.clone());
        self.runtime.spawn(async move {
            let name = queue.name.clone();
            match start_single_voter(&logs, group, node, addr, QueueMachine(queue), None, LEAD_WITHIN).await {
                Ok(raft) => {
                    tracing::debug!(queue = %name, group, "quorum queue's group leads on this node");
                    let mut stopped = false;
                    tx.send_if_modified(|state| match state {
                        Running::Stopped => {
                            stopped = true;
                            false
                        }
                        _ => {
                            *state = Running::Running(raft.clone());
                            true
                        }
                    });
                    if stopped {
                        // Deleted while it started.
                        let _ = raft.shutdown().await;
                    }
                }
                Err(e) => {
                    tracing::error!(queue = %name, group, error = %e, "could not start a quorum queue's Raft group");
                    let _ = tx.send(Running::Failed(e.to_string()));
                }
            }
        });
    }

    fn remove(&self, group: u64) {
        let Some(tx) = self.groups.lock().remove(&group) else { return };
        let logs = self.logs.clone();
        self.runtime.spawn(async move {
            if let Running::Running(raft) = tx.send_replace(Running::Stopped) {
                let _ = raft.shutdown().await;
            }
            if let Err(e) = logs.remove_group(group) {
                tracing::error!(group, error = %e, "could not remove a deleted quorum queue's Raft log");
            }
        });
    }
}
