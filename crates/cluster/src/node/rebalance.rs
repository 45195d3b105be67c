//! `warren ctl rebalance` and the watch over leadership transfers started by `warren ctl`.
//!
//! Leaders are handed back automatically by the node's sweep (`ClusterNode::rebalance`, per group:
//! a leader whose group's preferred member has been up for `REBALANCE_SETTLE` and is caught up
//! transfers to it). This module adds what the sweep does not:
//!
//! - **`warren ctl rebalance`** runs a pass on every node at once (and one a second for
//!   [`FORCE_FOR`]): while a node leads more than its fair share (`ceil(Σ 1/voters)` over the queue
//!   groups it is a voter of), it hands groups it is not the preferred member of
//!   ([`preferred_member`]) to their preferred member, if that member is up and caught up (its
//!   matched index is the leader's last log index, so the pause is the transfer's own), at most
//!   [`PER_PASS`] per pass. It answers what each node leads and moved. A group only ever moves to its
//!   preferred member, so passes converge. The metadata group is left alone: its load is topology
//!   changes, not messages, and a move pauses every node's declares and read barriers.
//! - **Stuck transfers** started by `warren ctl transfer-leader`. A leader transferring leadership
//!   takes no writes and sends no heartbeats until the target has won; openraft never gives up on its
//!   own. If the target refused (log behind) or stopped meanwhile, the group would stay without a
//!   writable leader. So if this node still leads the group in the same term after
//!   [`TRANSFER_TIMEOUT`], the transfer is sent again, to the same target if it is up and caught up,
//!   else to another voter that is.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use openraft::{RaftMetrics, ServerState};
use parking_lot::Mutex;
use tokio::sync::watch;

use super::{matched_index, preferred_member, ClusterNode, GroupHandle, NodeInner};
use crate::types::{GroupId, NodeId, TypeConfig, METADATA_GROUP};

/// How often the watch (and a forced pass) runs.
pub const REBALANCE_EVERY: Duration = Duration::from_secs(1);
/// At most this many transfers start per pass on one node.
pub const PER_PASS: usize = 4;
/// A transfer not done after this long is sent again (openraft's target waits up to the election
/// timeout's minimum, 2 s, for its log to reach the leader's).
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(3);
/// How long after `warren ctl rebalance` passes keep running.
pub const FORCE_FOR: Duration = Duration::from_secs(60);

/// A transfer this node started and has not seen finish.
struct Pending {
    to: NodeId,
    /// This node's term as leader when it started: a new term means the leadership moved.
    term: u64,
    since: Instant,
}

/// The node's rebalancing state.
#[derive(Default)]
pub(super) struct Rebalancer {
    pending: Mutex<HashMap<GroupId, Pending>>,
    forced_until: Mutex<Option<Instant>>,
}

/// What one pass saw and did on one node.
#[derive(Debug, Default)]
pub(super) struct PassReport {
    pub led: usize,
    pub groups: usize,
    pub fair_share: usize,
    pub started: Vec<(GroupId, NodeId)>,
}

impl std::fmt::Display for PassReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "leads {} of its {} queue groups (fair share {})", self.led, self.groups, self.fair_share)?;
        if self.started.is_empty() {
            write!(f, ", no transfer started")
        } else {
            let moves: Vec<String> = self.started.iter().map(|(g, to)| format!("{g}→{to}")).collect();
            write!(f, ", transfers started (group→node): {}", moves.join(" "))
        }
    }
}

impl Rebalancer {
    /// Remembers a transfer this node started, so it is sent again if it does not finish.
    pub(super) fn started(&self, group: GroupId, to: NodeId, term: u64) {
        self.pending.lock().insert(group, Pending { to, term, since: Instant::now() });
    }

    pub(super) fn force(&self) {
        *self.forced_until.lock() = Some(Instant::now() + FORCE_FOR);
    }

    fn forced(&self) -> bool {
        self.forced_until.lock().is_some_and(|until| Instant::now() < until)
    }
}

/// Whether `peer`'s replicated index has reached the leader's last log index.
fn caught_up(m: &RaftMetrics<TypeConfig>, peer: NodeId) -> bool {
    let matched = matched_index(m, peer);
    matched.is_some() && matched == m.last_log_index
}

/// The groups' fair share of leaders for this node: each group counts 1/voters for each voter.
fn fair_share(voter_counts: impl Iterator<Item = usize>) -> usize {
    let share: f64 = voter_counts.filter(|n| *n > 0).map(|n| 1.0 / n as f64).sum();
    (share - 1e-9).ceil().max(0.0) as usize
}

impl ClusterNode {
    /// Whether `peer` may take leadership: up (as the failure detector hears it).
    pub(super) fn may_lead(&self, peer: NodeId) -> bool {
        self.inner.detector.is_up(peer)
    }

    /// Starts a leadership transfer of `group` (led here) to `to` and watches it.
    pub(super) async fn start_transfer(&self, group: GroupId, h: &Arc<dyn GroupHandle>, to: NodeId) -> Result<(), String> {
        let term = h.metrics().current_term;
        h.transfer_leader(to).await?;
        self.inner.rebalance.started(group, to, term);
        Ok(())
    }

    /// Sends again the transfers that did not finish in time; forgets the finished ones.
    async fn retry_stuck_transfers(&self, groups: &BTreeMap<GroupId, Arc<dyn GroupHandle>>) {
        let due: Vec<(GroupId, NodeId)> = {
            let mut pending = self.inner.rebalance.pending.lock();
            pending.retain(|g, p| {
                groups.get(g).is_some_and(|h| {
                    let m = h.metrics();
                    m.state == ServerState::Leader && m.current_term == p.term
                })
            });
            pending.iter().filter(|(_, p)| p.since.elapsed() >= TRANSFER_TIMEOUT).map(|(g, p)| (*g, p.to)).collect()
        };
        for (group, first_choice) in due {
            let Some(h) = groups.get(&group) else { continue };
            let m = h.metrics();
            let me = self.inner.id;
            let mut voters: Vec<NodeId> = m.membership_config.membership().voter_ids().filter(|v| *v != me).collect();
            voters.sort_by_key(|v| *v != first_choice);
            let Some(to) = voters.into_iter().find(|v| self.may_lead(*v) && caught_up(&m, *v)) else {
                tracing::warn!(group, to = first_choice, "leadership transfer not done and no live caught-up voter to send it to yet");
                continue;
            };
            tracing::warn!(group, to, first_choice, "leadership transfer not done in time: sending it again");
            if let Err(e) = self.start_transfer(group, h, to).await {
                tracing::warn!(group, to, error = %e, "cannot send the leadership transfer");
            }
        }
    }

    /// One rebalancing pass on this node (see the module docs).
    pub(super) async fn rebalance_pass(&self) -> PassReport {
        let me = self.inner.id;
        let groups: BTreeMap<GroupId, Arc<dyn GroupHandle>> = self
            .inner
            .groups
            .read()
            .iter()
            .filter(|(g, _)| **g != METADATA_GROUP)
            .map(|(g, h)| (*g, h.clone()))
            .collect();
        self.retry_stuck_transfers(&groups).await;
        let mut report = PassReport::default();
        let mut voter_counts = Vec::new();
        let mut candidates = Vec::new();
        for (group, h) in &groups {
            let m = h.metrics();
            let voters: std::collections::BTreeSet<NodeId> = m.membership_config.membership().voter_ids().collect();
            if !voters.contains(&me) {
                continue;
            }
            voter_counts.push(voters.len());
            if m.state != ServerState::Leader || self.inner.rebalance.pending.lock().contains_key(group) {
                // A group being handed over counts as gone.
                continue;
            }
            report.led += 1;
            if let Some(pref) = preferred_member(*group, &voters, h.preferred()).filter(|p| *p != me) {
                candidates.push((*group, h.clone(), pref, m));
            }
        }
        report.groups = voter_counts.len();
        report.fair_share = fair_share(voter_counts.into_iter());
        let excess = report.led.saturating_sub(report.fair_share).min(PER_PASS);
        for (group, h, pref, m) in candidates {
            if report.started.len() >= excess {
                break;
            }
            if !self.may_lead(pref) || !caught_up(&m, pref) {
                continue;
            }
            match self.start_transfer(group, &h, pref).await {
                Ok(()) => {
                    tracing::info!(group, to = pref, "rebalancing: leadership handed back to the group's preferred member");
                    report.started.push((group, pref));
                }
                Err(e) => tracing::warn!(group, to = pref, error = %e, "rebalancing: cannot start the leadership transfer"),
            }
        }
        report
    }
}

/// The node's task: every [`REBALANCE_EVERY`] the watch over `warren ctl` transfers, or a pass
/// while `warren ctl rebalance` asked for them.
pub(super) async fn run(node: Weak<NodeInner>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(REBALANCE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let Some(inner) = node.upgrade() else { return };
        let node = ClusterNode { inner };
        if node.inner.rebalance.forced() {
            node.rebalance_pass().await;
        } else {
            // Automatic hand-back is the sweep's (`node::rebalance` on each group it leads); here
            // only the transfers started by `warren ctl` are watched (usually none: then the
            // groups are not walked).
            if node.inner.rebalance.pending.lock().is_empty() {
                continue;
            }
            let groups = node.inner.groups.read().iter().map(|(g, h)| (*g, h.clone())).collect();
            node.retry_stuck_transfers(&groups).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fair_share;

    #[test]
    fn the_fair_share_rounds_up_the_sum_of_each_groups_share() {
        assert_eq!(fair_share([3, 3, 3, 3, 3, 3].into_iter()), 2);
        assert_eq!(fair_share([3, 3, 3, 3, 3, 3, 3].into_iter()), 3);
        assert_eq!(fair_share([1, 3, 3, 3].into_iter()), 2);
        assert_eq!(fair_share(std::iter::empty()), 0);
        assert_eq!(fair_share([0, 2, 2].into_iter()), 1);
    }
}
