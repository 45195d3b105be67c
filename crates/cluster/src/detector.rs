//! The node-level failure detector: every [`PING_EVERY`] each peer is pinged on the control link,
//! and at once when that link closes. A peer is **down** as soon as its control link is gone (a
//! killed process's socket closes at once: down *by a closed link*, see [`Detector::closed_down`])
//! or after [`DOWN_AFTER`] without an answer (a stopped or cut-off node); it is **up** again at its
//! first answer. Transitions are reported to the node, which then starts elections in the
//! groups the dead node led (see `node`), so failover does not wait for each group's own election
//! timeout while idle groups send nothing extra.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::transport::{LinkKind, Rpc, RpcError, Transport};
use crate::types::NodeId;

pub const PING_EVERY: Duration = Duration::from_millis(200);
/// Silence after which a peer is down. Equal to openraft's leader lease (`node::LEADER_LEASE`).
pub const DOWN_AFTER: Duration = Duration::from_millis(1200);
/// A ping round that starts this long after the one before shows that this process did not run
/// meanwhile (stopped, or starved of CPU): the silence was its own, not the peers'.
const OWN_PAUSE: Duration = Duration::from_millis(1000);

#[derive(Debug, Clone, Copy)]
struct Health {
    up: bool,
    /// When it last came up (its first answer after being down or unknown).
    up_since: Option<Instant>,
    last_ok: Option<Instant>,
    /// When watching began: a peer never heard from counts as down only [`DOWN_AFTER`] later.
    since: Instant,
    /// Down because its link closed or could not be opened (its process is gone), not because it
    /// fell silent (stopped, or cut off by the network).
    closed: bool,
}

impl Health {
    fn new() -> Health {
        Health { up: false, up_since: None, last_ok: None, since: Instant::now(), closed: false }
    }
}

/// Who is reachable, as the pings say.
#[derive(Clone, Default)]
pub struct Detector {
    health: Arc<Mutex<HashMap<NodeId, Health>>>,
}

/// A change the detector saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Up(NodeId),
    Down(NodeId),
}

impl Detector {
    /// Whether the peer answered recently (false for a peer never heard from).
    pub fn is_up(&self, peer: NodeId) -> bool {
        self.health.lock().get(&peer).is_some_and(|h| h.up)
    }

    /// How long the peer has been answering without a break (None while it is not up).
    pub fn up_for(&self, peer: NodeId) -> Option<Duration> {
        self.health.lock().get(&peer).filter(|h| h.up).and_then(|h| h.up_since).map(|t| t.elapsed())
    }

    /// Whether the peer is known down: it answered once and no longer does, or it has not answered
    /// for [`DOWN_AFTER`] since watching began. A peer not heard from *yet* is not down: at start
    /// its first ping may still be on its way, and calling it down would elect against a live
    /// leader (a spurious election on every start).
    pub fn is_down(&self, peer: NodeId) -> bool {
        self.health.lock().get(&peer).is_some_and(|h| !h.up && (h.last_ok.is_some() || h.since.elapsed() >= DOWN_AFTER))
    }

    /// Whether the peer is down because its link closed (its process died: the kernel closed its
    /// sockets), not merely silent. Such a leader cannot be serving anyone, so its followers may
    /// elect without waiting out its lease (see `node`'s sweep).
    pub fn closed_down(&self, peer: NodeId) -> bool {
        self.health.lock().get(&peer).is_some_and(|h| !h.up && h.closed)
    }

    /// Pings `peer` until `stop` is set, calling `on_change` at each transition.
    pub async fn watch(
        &self,
        transport: Transport,
        peer: NodeId,
        mut stop: watch::Receiver<bool>,
        on_change: impl Fn(Change) + Send + Sync + 'static,
    ) {
        self.health.lock().insert(peer, Health::new());
        let mut tick = tokio::time::interval(PING_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last_round_end = Instant::now();
        // Until then, a failed ping does not make the peer down (see `OWN_PAUSE`).
        let mut grace_until: Option<Instant> = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                // A ping now finds the link gone: down at once, not at the next tick.
                _ = transport.control_link_closed(peer) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            // This process was stopped (SIGSTOP) or starved: its peers heard nothing from it and may
            // have closed their links to it. That says nothing of theirs: they get `DOWN_AFTER` to
            // answer again before they are down. Before, a node resumed after 5 s found every link
            // closed, took its peers' processes for dead and started elections without pre-votes in
            // the groups they led, deposing healthy leaders.
            let round = Instant::now();
            if round.duration_since(last_round_end) >= PING_EVERY + OWN_PAUSE {
                grace_until = Some(self.own_pause(peer, round));
            }
            let answer = tokio::select! {
                a = transport.request(peer, LinkKind::Control, Rpc::Ping, 0, b"", DOWN_AFTER) => a,
                _ = stop.wait_for(|s| *s) => return,
            };
            let now = Instant::now();
            // Stopped while the ping was out (its timeout is `DOWN_AFTER`): the same.
            if now.duration_since(round) >= DOWN_AFTER + OWN_PAUSE {
                grace_until = Some(self.own_pause(peer, now));
            }
            let change = {
                let mut health = self.health.lock();
                let h = health.entry(peer).or_insert_with(Health::new);
                let ok = answer.is_ok();
                let gone = matches!(answer, Err(RpcError::NotConnected(_)) | Err(RpcError::Lost(_)));
                if ok {
                    h.last_ok = Some(now);
                }
                let silent = h.last_ok.is_none_or(|t| now.duration_since(t) >= DOWN_AFTER);
                let in_grace = grace_until.is_some_and(|until| now < until);
                match (h.up, ok, (gone || silent) && !in_grace) {
                    (false, true, _) => {
                        h.up = true;
                        h.up_since = Some(now);
                        Some(Change::Up(peer))
                    }
                    (true, false, true) => {
                        h.up = false;
                        h.closed = gone;
                        Some(Change::Down(peer))
                    }
                    _ => None,
                }
            };
            if let Some(c) = change {
                on_change(c);
            }
            last_round_end = Instant::now();
        }
    }

    /// This process did not run for a while (seen at `now`): a peer that was up counts as heard
    /// from now, and none goes down before the returned grace ends.
    fn own_pause(&self, peer: NodeId, now: Instant) -> Instant {
        if let Some(h) = self.health.lock().get_mut(&peer).filter(|h| h.up) {
            h.last_ok = Some(now);
        }
        now + DOWN_AFTER
    }
}
