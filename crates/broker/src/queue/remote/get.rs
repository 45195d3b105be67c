//! What a client asks of a classic queue once, on a node that is not its home: basic.get,
//! queue.purge, and the counts of queue.declare-ok.
//!
//! basic.get (`GET`): the home takes the message for a relay channel of its own, one per get, so a
//! message got with acks is held there until this node settles it (`SETTLE`, then `CLOSE`), and
//! goes back to the queue if this node's channel closes first (its unacked are requeued through
//! `Queue::settle`), if this node is down for a while or restarts (the home closes the relays of an
//! unreachable node, or of an earlier run). A get the home does not answer closes the client's
//! channel with 404 NOT_FOUND naming the home (as RabbitMQ does for a classic queue whose node is
//! down), not get-empty; its relay is closed, in case the home took a message for it.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Notify;

use super::wire::{self, Request};
use super::RemoteHome;
use crate::queue::DeliverySink;
use crate::error::{BrokerError, Result};
use crate::message::decode_stored;
use crate::queue::{Entry, GetWait, Got, Queue};

/// How `ask_counts` says the home did not answer in time.
const NO_ANSWER: &str = "no answer";
/// How long a rewind asked of the home may take (it seeks segments and waits for an fsync).
const REWIND_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a passive queue.declare waits for the home's counts before answering without them.
const STAT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
pub(super) struct Gets {
    waiting: Mutex<HashMap<u64, Getter>>,
    done: Notify,
}

/// A basic.get on its way to the home.
struct Getter {
    connection: u64,
    number: u16,
    /// Some(Ok(true)): get-ok sent; Some(Ok(false)): get-empty to send; Some(Err): the home did
    /// not answer.
    done: Option<std::result::Result<bool, String>>,
}

impl RemoteHome {
    /// basic.get: asks the home; the channel's connection waits ([`Got::Later`]) and asks again.
    pub(in crate::queue) fn get(&self, queue: &Arc<Queue>, channel: &dyn DeliverySink, no_ack: bool) -> Got {
        let relay = {
            let mut waiting = self.gets.waiting.lock();
            let mine = waiting.iter().find(|(_, g)| g.connection == channel.connection_id() && g.number == channel.number()).map(|(id, g)| (*id, g.done.clone()));
            match mine {
                Some((id, Some(outcome))) => {
                    waiting.remove(&id);
                    return match outcome {
                        Ok(true) => Got::Message,
                        Ok(false) => Got::Empty,
                        Err(e) => Got::Failed(e),
                    };
                }
                Some((id, None)) => return Got::Later(GetWait::Remote(id)),
                None => {}
            }
            let relay = super::relay::new_relay_id();
            waiting.insert(relay, Getter { connection: channel.connection_id(), number: channel.number(), done: None });
            relay
        };
        let weak_queue = Arc::downgrade(queue);
        let weak_channel = channel.weak_sink();
        self.request(
            &Request::Get { queue: super::queue_ref(queue), relay, no_ack },
            Box::new(move |answer| {
                let Some(queue) = weak_queue.upgrade() else { return };
                let Some(remote) = queue.relay_side() else { return };
                let outcome = remote.got(&queue, weak_channel, relay, no_ack, answer);
                if let Some(g) = remote.gets.waiting.lock().get_mut(&relay) {
                    g.done = Some(outcome);
                }
                remote.gets.done.notify_waiters();
            }),
        );
        Got::Later(GetWait::Remote(relay))
    }

    /// The home's answer to basic.get `relay`: hands the message to the channel. Whether it did, or
    /// why the home could not be asked (the channel's 404 text).
    fn got(&self, queue: &Arc<Queue>, channel: Weak<dyn DeliverySink>, relay: u64, no_ack: bool, answer: std::result::Result<bytes::Bytes, String>) -> std::result::Result<bool, String> {
        let got = match answer.and_then(|a| wire::decode_got(&a).map_err(|e| e.to_string())) {
            Ok(Some(got)) => got,
            Ok(None) => return Ok(false), // the home closed the relay itself
            Err(e) => {
                let home = self.home();
                tracing::warn!(queue = %queue.name, home, error = %e, "basic.get through {} failed", self.what());
                self.send_all(queue, vec![Request::Close { relay }]);
                if self.move_from(queue, home) {
                    return Err(format!(
                        "member node {home} of quorum queue '{}' did not answer basic.get ({e}); the next basic.get goes through another member",
                        queue.name
                    ));
                }
                return Err(format!(
                    "home node {home} of queue '{}' did not answer basic.get ({e}); the queue is reachable again once that node is back",
                    queue.name
                ));
            }
        };
        let channel = channel.upgrade().filter(|c| !c.is_closed());
        let (Some(channel), Some(stored)) = (channel, decode_stored(&got.delivery.message)) else {
            // The channel closed meanwhile (or the message does not decode): back to the queue.
            if !no_ack {
                self.send_all(queue, vec![Request::Close { relay }]);
            }
            return Ok(false);
        };
        let seq = if no_ack { 0 } else { self.relays.hold_got(relay, got.delivery.tag) };
        let entry = Entry { message: Arc::new(stored.message), seq, stored_bytes: 0, expires_at_ms: None, redelivered: got.delivery.redelivered, returned: 0 };
        channel.deliver_get(queue, entry, no_ack, got.remaining);
        Ok(true)
    }

    /// Returns once basic.get `relay` is answered.
    pub(in crate::queue) async fn wait_get(&self, relay: u64) {
        loop {
            let notified = self.gets.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.gets.waiting.lock().get(&relay).is_none_or(|g| g.done.is_some()) {
                return;
            }
            notified.await;
        }
    }

    /// queue.purge: the home removes the ready messages (a blocking wait, as a purge is rare).
    pub(in crate::queue) fn purge(&self, queue: &Arc<Queue>) -> Result<u32> {
        let counts = self.ask_counts(Request::Purge { queue: super::queue_ref(queue) }, super::REQUEST_TIMEOUT, 1);
        counts.map(|c| c[0].min(u32::MAX as u64) as u32).map_err(|e| {
            // Without an answer, the home may have purged the queue or may still do it.
            let outcome = if e.starts_with(NO_ANSWER) { "; its outcome is unknown: the home may still purge the queue" } else { "" };
            BrokerError::internal(format!("the purge of classic queue '{}' failed on its home node {}: {e}{outcome}", queue.name, self.home()))
        })
    }

    /// A rewind, done by the home (`Queue::rewind`); waits for its answer, at most `REWIND_TIMEOUT`.
    pub(in crate::queue) async fn rewind(&self, queue: &Arc<Queue>, to_ms: u64) -> Result<crate::queue::RewindOutcome> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.request(
            &Request::Rewind { queue: super::queue_ref(queue), to_ms },
            Box::new(move |answer| {
                let _ = tx.send(answer.and_then(|a| wire::decode_ids(&a).map_err(|e| e.to_string())));
            }),
        );
        let failed = |e: String| BrokerError::internal(format!("the rewind of classic queue '{}' failed on its home node {}: {e}", queue.name, self.home()));
        match tokio::time::timeout(REWIND_TIMEOUT, rx).await {
            Ok(Ok(Ok(c))) if c.len() == 3 => Ok(crate::queue::RewindOutcome { rewound: c[0], from_ms: c[1].checked_sub(1), clamped: c[2] != 0 }),
            Ok(Ok(Ok(c))) => Err(failed(format!("an answer of {} counts, not 3", c.len()))),
            // The home's refusal (no retention, ...) is its reply text: said as it is.
            Ok(Ok(Err(e))) => Err(BrokerError::precondition_failed(e)),
            Ok(Err(_)) => Err(failed("the request was dropped".into())),
            Err(_) => Err(failed(format!("{NO_ANSWER} within {} s; its outcome is unknown: the home may still rewind the queue", REWIND_TIMEOUT.as_secs()))),
        }
    }

    /// The home's counts of ready messages and consumers (queue.declare-ok); zeros if the home does
    /// not answer in time.
    pub(in crate::queue) fn counts(&self, queue: &Queue) -> (u32, u32) {
        match self.ask_counts(Request::Stat { queue: super::queue_ref(queue) }, STAT_TIMEOUT, 2) {
            Ok(c) => (c[0].min(u32::MAX as u64) as u32, c[1].min(u32::MAX as u64) as u32),
            Err(e) => {
                tracing::warn!(queue = %queue.name, home = self.home(), error = %e, "no counts from the home node of a classic queue; declare-ok says 0");
                (0, 0)
            }
        }
    }

    /// Sends `request` and waits (blocking, at most `timeout`) for its answer: `n` counts.
    /// An error starting with [`NO_ANSWER`]: the home may have done it.
    fn ask_counts(&self, request: Request, timeout: Duration, n: usize) -> std::result::Result<Vec<u64>, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.request(
            &request,
            Box::new(move |answer| {
                let _ = tx.send(answer.and_then(|a| wire::decode_ids(&a).map_err(|e| e.to_string())));
            }),
        );
        match crate::blocking::run(|| rx.recv_timeout(timeout)) {
            Ok(Ok(counts)) if counts.len() == n => Ok(counts),
            Ok(Ok(counts)) => Err(format!("an answer of {} counts, not {n}", counts.len())),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!("{NO_ANSWER} within {} s", timeout.as_secs())),
        }
    }
}

/// A classic queue's counts as its home has them (`STATS`: the management API's lists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HomeStats {
    pub ready: u64,
    pub unacked: u64,
    /// Every consumer, this node's and other nodes' (theirs are relays on the home).
    pub consumers: u64,
    /// Consumed messages kept for a rewind (`x-retention-seconds`).
    pub retained: u64,
}

/// What `STATS` answers for a queue that does not live on the asked node.
const NOT_HERE: u64 = u64::MAX;

impl HomeStats {
    /// The home's answer to `STATS` for each queue asked (`Request::Stats`).
    pub fn answer(stats: &[Option<HomeStats>]) -> bytes::Bytes {
        let flat: Vec<u64> = stats
            .iter()
            .flat_map(|s| match s {
                Some(s) => [s.ready, s.unacked, s.consumers, s.retained],
                None => [NOT_HERE; 4],
            })
            .collect();
        wire::encode_ids(&flat)
    }
}

impl RemoteHome {
    /// Asks this home for the counts of `queues` (all living there, as this queue does) in one
    /// request; None for one it does not have. The caller bounds the wait.
    pub fn ask_stats(&self, queues: &[Arc<Queue>]) -> impl std::future::Future<Output = std::result::Result<Vec<Option<HomeStats>>, String>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let request = Request::Stats { queues: queues.iter().map(|q| super::queue_ref(q)).collect() };
        self.request(&request, Box::new(move |answer| {
            let _ = tx.send(answer);
        }));
        let (home, n) = (self.home(), queues.len());
        async move {
            let answer = rx.await.map_err(|_| format!("node {home} did not answer"))??;
            let counts = wire::decode_ids(&answer).map_err(|e| format!("node {home}'s counts do not decode: {e}"))?;
            if counts.len() != 4 * n {
                return Err(format!("node {home} answered {} counts for {n} queues", counts.len()));
            }
            Ok(counts
                .chunks_exact(4)
                .map(|c| (c[0] != NOT_HERE).then(|| HomeStats { ready: c[0], unacked: c[1], consumers: c[2], retained: c[3] }))
                .collect())
        }
    }
}
