//! The home side of classic queues in a cluster (`warren_broker::queue::remote`): takes the batches
//! other nodes forward for the classic queues living on this node, and answers once what it took is
//! durable here. Whatever a peer sends is checked: an unknown vhost or queue, a queue whose home is
//! not this node, or a malformed batch is an error answer (the sender nacks those messages).

use bytes::Bytes;
use std::sync::{Arc, Weak};
use std::time::Duration;

use warren_broker::message::{decode_stored, encode_header};
use warren_broker::queue::remote::{decode_batch, encode_answer, FORWARD_TIMEOUT};
use warren_broker::queue::Enqueued;
use warren_broker::Broker;
use warren_cluster::node::HomeService;
use warren_cluster::{ClusterNode, NodeId};

/// What serves `Rpc::Publish` on this node.
pub fn service(broker: Weak<Broker>, me: NodeId) -> HomeService {
    Arc::new(move |batch| {
        let broker = broker.clone();
        Box::pin(async move {
            let broker = broker.upgrade().ok_or_else(|| "the node is stopping".to_string())?;
            take(&broker, me, batch).await
        })
    })
}

async fn take(broker: &Broker, me: NodeId, batch: Bytes) -> Result<Bytes, String> {
    let batch = decode_batch(&batch).map_err(|e| format!("bad batch for a classic queue: {e}"))?;
    let vhost = broker.vhost(&batch.vhost).ok_or_else(|| format!("no vhost '{}' on node {me}", batch.vhost))?;
    let queue = vhost
        .queue(&batch.queue, 0)
        .ok()
        .filter(|q| q.id == batch.queue_id)
        .ok_or_else(|| format!("no queue '{}' (id {}) in vhost '{}' on node {me}", batch.queue, batch.queue_id, batch.vhost))?;
    if queue.home_node() != Some(me) {
        return Err(format!("classic queue '{}' does not live on node {me} (its home is {:?})", batch.queue, queue.home_node()));
    }
    let mut refused = Vec::with_capacity(batch.messages.len());
    let mut ticket = None;
    let now = warren_broker::now_ms();
    let mut header = bytes::BytesMut::new();
    for payload in &batch.messages {
        let Some(stored) = decode_stored(payload) else {
            refused.push(true);
            continue;
        };
        let message = Arc::new(stored.message);
        header.clear();
        encode_header(&message, Some(now), &mut header);
        match queue.publish(&message, &header, now, false, None) {
            Ok(Enqueued::Accepted { ticket: t, .. }) => {
                ticket = ticket.max(t);
                refused.push(false);
            }
            Ok(Enqueued::Rejected) => refused.push(true),
            Err(e) => {
                tracing::warn!(queue = %queue.name, error = %e, "a message forwarded by another node was refused");
                refused.push(true);
            }
        }
    }
    if let Some(ticket) = ticket {
        // Answered once durable: the sender confirms on this answer.
        let mut durable = broker.store().durable();
        let waited = tokio::time::timeout(FORWARD_TIMEOUT - Duration::from_secs(1), async {
            durable.wait_for(|d| *d >= ticket).await.map(|_| ())
        })
        .await;
        match waited {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err("the store stopped before the messages were durable".to_string()),
            Err(_) => return Err("the messages were not durable in time".to_string()),
        }
    }
    Ok(encode_answer(&refused))
}

/// Sends a batch to a classic queue's home (the broker's side of `QuorumHost::forward_to_home`).
pub fn forward(runtime: &tokio::runtime::Handle, node: &ClusterNode, home: NodeId, batch: Bytes, done: warren_broker::queue::remote::ForwardDone) {
    let node = node.clone();
    runtime.spawn(async move {
        let answer = node.send_to_home(home, &batch, FORWARD_TIMEOUT).await.map_err(|e| e.to_string());
        done(answer);
    });
}
