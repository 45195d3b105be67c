//! The connection's writer task: drains the outbox into one buffer per wake-up, emits
//! publisher confirms once the store reports them durable, and sends heartbeats when idle.
//!
//! This is the only place confirms are written, so per channel they leave in delivery-tag
//! order, and a run of acks becomes one `basic.ack` with `multiple`.
//!
//! A socket that takes nothing for `write_timeout` (a peer that stopped reading) ends the
//! connection; the reader is told through [`Outbox::writer_ended`].

use super::frames::{OutFrames, WriteFailed, SPLICE_MIN_BODY};
use super::outbox::{DurableAction, Outbox, Outgoing, CONFIRM_COST};
use bytes::BytesMut;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use super::stream::WriteHalf;
use tokio::sync::watch;
use warren_broker::{Delivery, PublisherSession};
use warren_protocol::frame;
use warren_protocol::method::{BasicCancel, BasicNack, Method, TxCommitOk};
use warren_store::{Batch, SyncTicket};

pub struct WriterConfig {
    pub frame_max: u32,
    /// Send a heartbeat after this long without writing anything (None: heartbeats off).
    pub heartbeat_every: Option<Duration>,
    pub consumer_cancel_notify: bool,
    /// A write that makes no progress for this long closes the connection.
    pub write_timeout: Duration,
    /// The connection's id, for the log.
    pub connection: u64,
}

struct PendingDurable {
    ticket: SyncTicket,
    /// The publisher session's operation this waits for (see `warren_broker::publisher`).
    seq: u64,
    action: DurableAction,
}

pub async fn run(
    socket: WriteHalf,
    outbox: Arc<Outbox>,
    durable: watch::Receiver<u64>,
    session: Arc<PublisherSession>,
    config: Arc<parking_lot::Mutex<WriterConfig>>,
) {
    write_loop(socket, &outbox, durable, &session, config).await;
    outbox.writer_ended();
}

async fn write_loop(
    mut socket: WriteHalf,
    outbox: &Outbox,
    mut durable: watch::Receiver<u64>,
    session: &PublisherSession,
    config: Arc<parking_lot::Mutex<WriterConfig>>,
) {
    let mut items = Vec::new();
    let mut out = OutFrames::default();
    let mut pending: HashMap<u16, VecDeque<PendingDurable>> = HashMap::new();
    // Store acks of the no-ack deliveries in `out`, appended once it is written (see `AckWhenWritten`).
    let mut acks = Batch::new();
    let mut closing = false;
    // When the writer last wrote to the socket: a heartbeat is due `heartbeat_every` after it. (A
    // sleep started afresh at each wake-up never ran out for a publisher with confirms on a slow
    // disk: each publish woke the writer with nothing to write yet, and the client, hearing
    // nothing for seconds, took the server for dead.)
    let mut last_write = tokio::time::Instant::now();
    loop {
        let (heartbeat_every, frame_max, cancel_notify, write_timeout, connection) = {
            let c = config.lock();
            (c.heartbeat_every, c.frame_max, c.consumer_cancel_notify, c.write_timeout, c.connection)
        };
        let waiting_for_disk = pending.values().any(|q| !q.is_empty());
        let idle = async {
            match heartbeat_every {
                Some(d) => tokio::time::sleep_until(last_write + d).await,
                None => std::future::pending().await,
            }
        };
        // An idle connection gives back its write buffers: ten thousand idle connections must not
        // keep 64 KiB each.
        let holds_memory = out.buf.capacity() > 0 || items.capacity() > 0;
        let release = async {
            match holds_memory {
                true => tokio::time::sleep(super::RELEASE_BUFFERS_AFTER).await,
                false => std::future::pending().await,
            }
        };
        let mut heartbeat_due = false;
        tokio::select! {
            _ = outbox.wait() => {}
            _ = release => {
                out.release();
                items = Vec::new();
                outbox.release_memory();
                continue;
            }
            changed = durable.changed(), if waiting_for_disk => {
                if changed.is_err() {
                    // The store has shut down; nothing more will become durable.
                    return;
                }
            }
            _ = idle => heartbeat_due = true,
        }
        outbox.take(&mut items);
        // Bytes of what goes into `out` (released once written) and of confirms dropped unsent.
        let mut cost = 0;
        for item in items.drain(..) {
            if !matches!(item, Outgoing::WhenDurable { .. }) {
                cost += item.cost();
            }
            match item {
                Outgoing::Method { channel, method } => frame::write_method(&mut out.buf, channel, &method),
                Outgoing::Delivery(d) => {
                    if let Some(ack) = d.ack_when_written() {
                        ack.add_to(&mut acks);
                    }
                    write_delivery(&mut out, d, frame_max, cancel_notify)
                }
                Outgoing::Return { channel, reply_code, reply_text, message } => frame::write_basic_return(
                    &mut out.buf,
                    channel,
                    reply_code,
                    reply_text,
                    &message.exchange,
                    &message.routing_key,
                    &message.properties,
                    &message.body,
                    frame_max,
                ),
                Outgoing::WhenDurable { channel, ticket, seq, action } => {
                    pending.entry(channel).or_default().push_back(PendingDurable { ticket: ticket.unwrap_or(0), seq, action });
                }
                Outgoing::ChannelEnd { channel, method } => {
                    // Confirms are per channel incarnation: what is not durable now is never sent.
                    if let Some(mut queue) = pending.remove(&channel) {
                        cost += queue.len() * CONFIRM_COST;
                        // The channel ends: a failed commit is not failed again (nobody waits for it).
                        write_ready_confirms(&mut out.buf, channel, &mut queue, *durable.borrow(), session, None);
                    }
                    frame::write_method(&mut out.buf, channel, &method);
                }
                Outgoing::Close => closing = true,
            }
        }
        let on_disk = *durable.borrow_and_update();
        for (channel, queue) in pending.iter_mut() {
            let before = queue.len();
            write_ready_confirms(&mut out.buf, *channel, queue, on_disk, session, Some(outbox));
            cost += (before - queue.len()) * CONFIRM_COST;
        }
        pending.retain(|_, q| !q.is_empty());
        if out.is_empty() && (heartbeat_due || heartbeat_every.is_some_and(|d| tokio::time::Instant::now() >= last_write + d)) {
            frame::write_heartbeat(&mut out.buf);
        }
        if !out.is_empty() {
            let written = out.write_to(&mut socket, write_timeout).await;
            last_write = tokio::time::Instant::now();
            // Written, or never will be (the connection is gone, and a no-ack consumer's messages with it).
            outbox.ack_written(&mut acks);
            match written {
                Ok(()) => {}
                Err(WriteFailed::Gone) => return,
                Err(WriteFailed::TimedOut) => {
                    tracing::warn!(connection, timeout_s = write_timeout.as_secs(),
                        "closing connection: the client read nothing for write-timeout");
                    return;
                }
            }
            out.clear();
        }
        outbox.written(cost);
        if out.buf.capacity() > 4 * 1024 * 1024 {
            out.buf = BytesMut::new();
        }
        if closing {
            let _ = tokio::time::timeout(write_timeout, socket.shutdown()).await;
            return;
        }
    }
}

fn write_delivery(out: &mut OutFrames, d: Delivery, frame_max: u32, cancel_notify: bool) {
    let buf = &mut out.buf;
    match d {
        Delivery::Deliver { channel, consumer_tag, delivery_tag, redelivered, message, .. }
            if message.body.len() >= SPLICE_MIN_BODY && frame::fits_one_body_frame(message.body.len(), frame_max) =>
        {
            let body_len = message.body.len();
            frame::write_basic_deliver_head(buf, channel, &consumer_tag, delivery_tag, redelivered, &message.exchange, &message.routing_key, &message.properties, body_len);
            out.splice_body(message);
        }
        Delivery::Deliver { channel, consumer_tag, delivery_tag, redelivered, message, .. } => frame::write_basic_deliver(
            buf,
            channel,
            &consumer_tag,
            delivery_tag,
            redelivered,
            &message.exchange,
            &message.routing_key,
            &message.properties,
            &message.body,
            frame_max,
        ),
        Delivery::GetOk { channel, delivery_tag, redelivered, message_count, message, .. } => frame::write_basic_get_ok(
            buf,
            channel,
            delivery_tag,
            redelivered,
            &message.exchange,
            &message.routing_key,
            message_count,
            &message.properties,
            &message.body,
            frame_max,
        ),
        Delivery::Cancel { channel, consumer_tag } => {
            if cancel_notify {
                let method = Method::BasicCancel(BasicCancel { consumer_tag: consumer_tag.to_string(), nowait: true });
                frame::write_method(buf, channel, &method);
            }
        }
    }
}

/// Emits, in order, every pending confirm whose ticket is on disk and whose quorum-queue operations
/// are resolved; consecutive acks are coalesced into one `basic.ack multiple=true`; an ack a quorum
/// queue refused (reject-publish, no majority in time) is a `basic.nack`. A tx.commit any of whose
/// operations was refused is handed to the reader to fail (`fails_commits`; None: the channel ends).
fn write_ready_confirms(
    buf: &mut BytesMut,
    channel: u16,
    queue: &mut VecDeque<PendingDurable>,
    on_disk: u64,
    session: &PublisherSession,
    fails_commits: Option<&Outbox>,
) {
    let mut run: Option<(u64, u32)> = None; // (last tag, count) of consecutive acks
    let flush = |buf: &mut BytesMut, run: &mut Option<(u64, u32)>| {
        if let Some((tag, count)) = run.take() {
            frame::write_basic_ack(buf, channel, tag, count > 1);
        }
    };
    while let Some(front) = queue.front() {
        if front.ticket > on_disk || !session.is_resolved(front.seq) {
            break;
        }
        let Some(p) = queue.pop_front() else { break };
        match p.action {
            DurableAction::Ack { delivery_tag } if p.seq != 0 && session.take_refused(p.seq) => {
                flush(buf, &mut run);
                let m = Method::BasicNack(BasicNack { delivery_tag, multiple: false, requeue: false });
                frame::write_method(buf, channel, &m);
            }
            DurableAction::Ack { delivery_tag } => {
                run = Some(match run {
                    Some((_, n)) => (delivery_tag, n + 1),
                    None => (delivery_tag, 1),
                });
            }
            DurableAction::Nack { delivery_tag } => {
                flush(buf, &mut run);
                let m = Method::BasicNack(BasicNack { delivery_tag, multiple: false, requeue: false });
                frame::write_method(buf, channel, &m);
            }
            DurableAction::TxCommit { first_seq, refused_now } => {
                flush(buf, &mut run);
                let refused = refused_now + if p.seq != 0 { session.take_refused_in(first_seq, p.seq) } else { 0 };
                if refused == 0 {
                    frame::write_method(buf, channel, &Method::TxCommitOk(TxCommitOk {}));
                } else if let Some(outbox) = fails_commits {
                    outbox.fail_commit(
                        channel,
                        format!(
                            "partial tx completion: {refused} operation(s) of the transaction were refused (a full \
                             queue with reject-publish, no majority of a quorum queue, a home node down, or an ack \
                             not committed); publish again on a new channel"
                        ),
                    );
                }
            }
        }
    }
    flush(buf, &mut run);
}
