//! A durable classic queue in a cluster lives on one node, its home (the node whose client declared
//! it, as RabbitMQ's `client-local` placement). Every node has the queue (the metadata group
//! declares it everywhere, so every node routes to it), but only the home's copy holds messages:
//! another node forwards what its publishers route to the queue to the home, in batches over the
//! cluster transport, and confirms them once the home answers that they are durable there (or
//! nacks them: the home refused, is down, or did not answer in time).
//!
//! Order: a node has at most one batch per queue on its way to the home; what is published
//! meanwhile waits for the next, so one node's publishes reach the queue in the order they were
//! made. Memory: publishers pause (`Queue::wait_until_drained`) while `PAUSE_BYTES` wait, and are
//! refused (basic.nack) past `REFUSE_BYTES`.
//!
//! Consumers, basic.get and queue.purge are served by the home only: on another node they are
//! refused with a reply that names the home (relaying deliveries is not built yet).
//!
//! The batch format (a request of `Rpc::Publish`), owned by the broker, the cluster only carries
//! the bytes; decoding never panics:
//! `version u8 | vhost (varint len, bytes) | queue name (varint len, bytes) | queue id varint |
//!  count varint | count × (varint len, the message's store encoding)`.
//! The answer: `version u8 | count varint | count × u8 (0 taken, 1 refused)`.

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

use super::replica::QuorumRuntime;
use crate::error::{BrokerError, Result};
use crate::message::{encode_header, MessageRef};
use crate::publisher::{Publisher, PublisherSession};
use crate::quorum::codec::{err, put_var, DecodeError, Reader};

const VERSION: u8 = 1;

/// A batch carries at most this much (messages beyond it wait for the next batch; a single larger
/// message goes alone).
const MAX_BATCH_BYTES: usize = 4 << 20;
/// Publishers pause while this much waits to be forwarded...
const PAUSE_BYTES: usize = 16 << 20;
/// ... and what comes while this much waits (the home stalls: a paused publisher still reads a
/// little every `FLOW_WAIT`) is refused (basic.nack), so memory stays bounded.
const REFUSE_BYTES: usize = 4 * PAUSE_BYTES;
/// How long the home may take to answer a batch before its messages are nacked.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(15);

/// What sends a batch to a queue's home (the server, over the cluster transport): `done` is called
/// exactly once, with the home's answer or why there is none.
pub type ForwardDone = Box<dyn FnOnce(std::result::Result<Bytes, String>) + Send>;

/// The forwarding side of a classic queue whose home is another node.
pub struct RemoteHome {
    /// The home node's id.
    pub home: u64,
    runtime: Arc<QuorumRuntime>,
    pending: Mutex<Pending>,
    drained: Notify,
}

#[derive(Default)]
struct Pending {
    /// Encoded messages waiting for the next batch, with their publishers (None: nothing waits).
    messages: Vec<(Bytes, Option<(Arc<PublisherSession>, u64)>)>,
    bytes: usize,
    in_flight: bool,
}

impl RemoteHome {
    pub fn new(home: u64, runtime: Arc<QuorumRuntime>) -> RemoteHome {
        RemoteHome { home, runtime, pending: Mutex::new(Pending::default()), drained: Notify::new() }
    }

    /// Whether the home is another node (false on the home itself, and before the node knows its id).
    pub fn is_elsewhere(&self) -> bool {
        let me = self.runtime.node();
        me != 0 && me != self.home
    }

    pub(super) fn refusal(&self, queue: &str, what: &str) -> BrokerError {
        BrokerError::precondition_failed(format!(
            "classic queue '{queue}' lives on node {} of the cluster: {what} through a connection to that node \
             (or use a quorum queue, served by every node)",
            self.home
        ))
    }

    /// Takes a message routed to the queue: it leaves in the next batch to the home.
    pub(super) fn publish(&self, queue: &Arc<super::Queue>, message: &MessageRef, now_ms: u64, publisher: Option<Publisher>) -> super::Enqueued {
        if self.pending.lock().bytes >= REFUSE_BYTES {
            return super::Enqueued::Rejected;
        }
        let mut encoded = BytesMut::with_capacity(64 + message.body.len());
        encode_header(message, Some(now_ms), &mut encoded);
        encoded.extend_from_slice(&message.body);
        let waiter = publisher.map(|p| {
            p.session.sent(queue.id, p.seq);
            (p.session.clone(), p.seq)
        });
        let slow_publishers = {
            let mut p = self.pending.lock();
            p.bytes += encoded.len();
            p.messages.push((encoded.freeze(), waiter));
            p.bytes >= PAUSE_BYTES
        };
        self.send_next(queue);
        super::Enqueued::Accepted { ticket: None, slow_publishers, store_behind: false }
    }

    /// Sends the next batch if none is on its way.
    fn send_next(&self, queue: &Arc<super::Queue>) {
        let (batch, waiters) = {
            let mut p = self.pending.lock();
            if p.in_flight || p.messages.is_empty() {
                return;
            }
            let mut size = 0;
            let mut n = 0;
            for (m, _) in &p.messages {
                if n > 0 && size + m.len() > MAX_BATCH_BYTES {
                    break;
                }
                size += m.len();
                n += 1;
            }
            let taken: Vec<_> = p.messages.drain(..n).collect();
            p.bytes -= size;
            p.in_flight = true;
            let vhost = queue.vhost_name();
            let batch = encode_batch(&vhost, &queue.name, queue.id, taken.iter().map(|(m, _)| m));
            (batch, taken.into_iter().map(|(_, w)| w).collect::<Vec<_>>())
        };
        self.drained.notify_waiters();
        let Some(host) = self.runtime.host() else {
            self.answered(queue, waiters, Err("this node runs no cluster".to_string()));
            return;
        };
        let weak = Arc::downgrade(queue);
        host.forward_to_home(
            self.home,
            batch,
            Box::new(move |answer| {
                if let Some(queue) = weak.upgrade() {
                    if let Some(remote) = queue.remote_home() {
                        remote.answered(&queue, waiters, answer);
                    }
                } else {
                    resolve(0, waiters, None);
                }
            }),
        );
    }

    fn answered(&self, queue: &Arc<super::Queue>, waiters: Vec<Option<(Arc<PublisherSession>, u64)>>, answer: std::result::Result<Bytes, String>) {
        let outcomes = match answer.and_then(|a| decode_answer(&a, waiters.len()).map_err(|e| e.to_string())) {
            Ok(o) => Some(o),
            Err(e) => {
                tracing::warn!(queue = %queue.name, home = self.home, messages = waiters.len(), error = %e,
                    "messages for a classic queue on another node were not taken there; their publishers get basic.nack");
                None
            }
        };
        resolve(queue.id, waiters, outcomes);
        self.pending.lock().in_flight = false;
        self.send_next(queue);
    }

    /// Waits (at most `max`) until less waits to be forwarded than makes publishers pause.
    pub(super) async fn wait_until_drained(&self, max: Duration) {
        let notified = self.drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.pending.lock().bytes < PAUSE_BYTES {
            return;
        }
        let _ = tokio::time::timeout(max, notified).await;
    }
}

/// Tells each publisher its outcome: taken (`outcomes[i]` false) or refused; all refused without outcomes.
fn resolve(queue: u64, waiters: Vec<Option<(Arc<PublisherSession>, u64)>>, outcomes: Option<Vec<bool>>) {
    for (i, w) in waiters.into_iter().enumerate() {
        if let Some((session, seq)) = w {
            let refused = outcomes.as_ref().is_none_or(|o| o.get(i).copied().unwrap_or(true));
            session.resolved(queue, [(seq, refused)]);
        }
    }
}

/// A batch of messages for a classic queue's home.
#[derive(Debug, PartialEq, Eq)]
pub struct HomeBatch {
    pub vhost: String,
    pub queue: String,
    pub queue_id: u64,
    /// Each message's store encoding (`crate::message::decode_stored`).
    pub messages: Vec<Bytes>,
}

pub fn encode_batch<'a>(vhost: &str, queue: &str, queue_id: u64, messages: impl Iterator<Item = &'a Bytes> + Clone) -> Bytes {
    let size: usize = messages.clone().map(|m| m.len() + 5).sum();
    let mut out = BytesMut::with_capacity(32 + vhost.len() + queue.len() + size);
    out.put_u8(VERSION);
    put_var(&mut out, vhost.len() as u64);
    out.put_slice(vhost.as_bytes());
    put_var(&mut out, queue.len() as u64);
    out.put_slice(queue.as_bytes());
    put_var(&mut out, queue_id);
    put_var(&mut out, messages.clone().count() as u64);
    for m in messages {
        put_var(&mut out, m.len() as u64);
        out.put_slice(m);
    }
    out.freeze()
}

pub fn decode_batch(buf: &Bytes) -> std::result::Result<HomeBatch, DecodeError> {
    let mut r = Reader::new(buf);
    let version = r.u8()?;
    if version != VERSION {
        return err(format!("unknown classic batch version {version}"));
    }
    let string = |r: &mut Reader| -> std::result::Result<String, DecodeError> {
        let n = r.var()?;
        let n = r.check_count(n, 1)?;
        String::from_utf8(r.bytes(n)?.to_vec()).or_else(|_| err("a name is not UTF-8"))
    };
    let vhost = string(&mut r)?;
    let queue = string(&mut r)?;
    let queue_id = r.var()?;
    let count = r.count(1)?;
    let mut messages = Vec::with_capacity(count);
    for _ in 0..count {
        let n = r.var()?;
        let n = r.check_count(n, 1)?;
        let start = r.pos();
        r.bytes(n)?;
        messages.push(buf.slice(start..start + n));
    }
    r.end()?;
    Ok(HomeBatch { vhost, queue, queue_id, messages })
}

/// The home's answer: per message, whether it was refused.
pub fn encode_answer(refused: &[bool]) -> Bytes {
    let mut out = BytesMut::with_capacity(8 + refused.len());
    out.put_u8(VERSION);
    put_var(&mut out, refused.len() as u64);
    for r in refused {
        out.put_u8(*r as u8);
    }
    out.freeze()
}

pub fn decode_answer(buf: &[u8], expected: usize) -> std::result::Result<Vec<bool>, DecodeError> {
    let mut r = Reader::new(buf);
    let version = r.u8()?;
    if version != VERSION {
        return err(format!("unknown classic answer version {version}"));
    }
    let count = r.count(1)?;
    if count != expected {
        return err(format!("an answer for {count} messages to a batch of {expected}"));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(r.bool()?);
    }
    r.end()?;
    Ok(out)
}

/// The error a publish to a queue with a home elsewhere gets when the broker would otherwise answer
/// from the empty local copy.
pub(super) fn not_here(remote: &RemoteHome, queue: &str, what: &str) -> Result<()> {
    if remote.is_elsewhere() {
        return Err(remote.refusal(queue, what));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_and_its_answer_round_trip_and_garbage_is_an_error() {
        let messages = vec![Bytes::from_static(b"one"), Bytes::from(vec![7u8; 300]), Bytes::new()];
        let batch = encode_batch("/", "orders", 42, messages.iter());
        let decoded = decode_batch(&batch).unwrap();
        assert_eq!(decoded, HomeBatch { vhost: "/".into(), queue: "orders".into(), queue_id: 42, messages: messages.clone() });
        for cut in 0..batch.len() {
            assert!(decode_batch(&batch.slice(..cut)).is_err(), "a batch cut at {cut} bytes");
        }
        let mut longer = batch.to_vec();
        longer.push(0);
        assert!(decode_batch(&Bytes::from(longer)).is_err());
        // A count far beyond the input must not allocate for it.
        let mut huge = vec![VERSION, 1, b'/', 1, b'q', 1];
        huge.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(decode_batch(&Bytes::from(huge)).is_err());
        for seed in 0..2000u32 {
            let junk: Vec<u8> = (0..(seed % 64)).map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i * 97) >> 7) as u8).collect();
            let _ = decode_batch(&Bytes::from(junk.clone()));
            let _ = decode_answer(&junk, 3);
        }

        let answer = encode_answer(&[false, true, false]);
        assert_eq!(decode_answer(&answer, 3).unwrap(), vec![false, true, false]);
        assert!(decode_answer(&answer, 2).is_err(), "an answer must cover the batch it answers");
        assert!(decode_answer(&answer[..answer.len() - 1], 3).is_err());
    }
}
