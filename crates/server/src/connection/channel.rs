//! One channel of a connection: turns AMQP methods into broker calls, assembles published
//! messages from method + header + body frames, and tracks confirm and transaction modes.

use super::access::{Access, Perm, Resource};
use super::error::ConnError;
use super::outbox::{DurableAction, Outgoing};
use super::ConnectionShared;
use bytes::{Bytes, BytesMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use warren_broker::direct_reply;
use warren_broker::vhost::{ExchangeDeclare, QueueDeclare};
use warren_broker::{BrokerError, Channel, GetWait, Got, Message, Queue, Scope, Settle};
use warren_protocol::constants as c;
use warren_protocol::frame::ContentHeader;
use warren_protocol::method::*;
use warren_protocol::properties::PropertiesView;

/// A publish waiting for its content header and body frames.
struct PendingPublish {
    publish: BasicPublish,
    header: Option<ContentHeader>,
    body_size: u64,
    body: BytesMut,
    /// The body when it came in exactly one frame (no copy).
    single: Option<Bytes>,
    /// What `body` holds, counted against the connection's bound on unfinished messages (only once
    /// a body takes more than one frame).
    unfinished: Option<Unfinished>,
}

/// A publish's share of its connection's unfinished content (`ConnectionShared::unfinished_content`),
/// given back when the publish completes or is dropped. The bound is twice `max-message-size` for all
/// the connection's channels together: each may hold a message half received, but 2,047 channels of
/// 128 MiB each would be 256 GiB.
struct Unfinished {
    total: Arc<AtomicU64>,
    bytes: u64,
}

impl Unfinished {
    fn new(total: &Arc<AtomicU64>) -> Self {
        Unfinished { total: total.clone(), bytes: 0 }
    }

    /// Counts `more` bytes, or says how many the connection already holds if that would pass `max`.
    fn add(&mut self, more: u64, max: u64) -> Result<(), u64> {
        let before = self.total.fetch_add(more, Ordering::AcqRel);
        if before + more > max {
            self.total.fetch_sub(more, Ordering::AcqRel);
            return Err(before);
        }
        self.bytes += more;
        Ok(())
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Most operations (publishes and settlements) a transaction may buffer until tx.commit.
const TX_MAX_OPS: usize = 100_000;
/// Most bytes of published messages a transaction may buffer (or `max-message-size`, if larger).
const TX_MAX_BYTES: usize = 128 << 20;

/// A basic.get whose queue asked to wait (see `ChannelHandler::get`).
pub struct WaitingGet {
    pub channel: u16,
    pub queue: Arc<Queue>,
    pub no_ack: bool,
    pub wait: GetWait,
}

/// An operation buffered by a transaction until tx.commit.
enum TxOp {
    Publish { exchange: String, mandatory: bool, message: Message },
    Settle { delivery_tag: u64, multiple: bool, how: Settle },
}

pub struct ChannelHandler {
    number: u16,
    channel: Arc<Channel>,
    /// We sent channel.close and wait for close-ok; everything else is discarded meanwhile.
    closing: bool,
    pending: Option<PendingPublish>,
    confirm: bool,
    next_publish_tag: u64,
    tx: Option<Vec<TxOp>>,
    /// Bytes of the messages `tx` holds.
    tx_bytes: usize,
    /// The delivery tags `tx` settles: all up to the first (a `multiple` one), and these. A tag
    /// settled twice in one transaction is unknown the second time, as in RabbitMQ.
    tx_settled: (u64, std::collections::BTreeSet<u64>),
    /// The last queue declared on this channel: AMQP lets "" mean it.
    last_queue: Option<String>,
    /// The user's permissions in the vhost, as last looked up.
    access: Access,
}

/// A failure while handling a method: a channel or a connection exception.
enum Failure {
    Channel(BrokerError),
    Connection(ConnError),
}

impl From<BrokerError> for Failure {
    fn from(e: BrokerError) -> Self {
        match e.scope() {
            Scope::Channel => Failure::Channel(e),
            Scope::Connection => Failure::Connection(ConnError::new(e.code, e.reply_text(), 0, 0)),
        }
    }
}

type Handled = Result<(), Failure>;

impl ChannelHandler {
    pub fn new(number: u16, conn: &ConnectionShared) -> Self {
        ChannelHandler {
            number,
            channel: Channel::new(number, conn.id, conn.outbox.clone()),
            closing: false,
            pending: None,
            confirm: false,
            next_publish_tag: 1,
            tx: None,
            tx_bytes: 0,
            tx_settled: (0, std::collections::BTreeSet::new()),
            last_queue: None,
            access: Access::default(),
        }
    }

    /// Requeues unacknowledged messages and cancels consumers (channel or connection closed).
    pub fn release(self) {
        self.channel.close();
    }

    /// Handles a method. Returns Ok(true) once the channel is fully closed.
    pub fn handle_method(&mut self, method: Method, conn: &ConnectionShared) -> Result<bool, ConnError> {
        if self.closing {
            return Ok(match method {
                Method::ChannelCloseOk(_) => true,
                Method::ChannelClose(_) => {
                    conn.outbox.method(self.number, Method::ChannelCloseOk(ChannelCloseOk {}));
                    true
                }
                _ => false,
            });
        }
        if self.pending.is_some() {
            return Err(ConnError::new(
                c::UNEXPECTED_FRAME,
                format!(
                    "UNEXPECTED_FRAME - expected content header for class 60, got non content header frame instead ({})",
                    method.name()
                ),
                method.class_id(),
                method.method_id(),
            ));
        }
        let (class_id, method_id) = (method.class_id(), method.method_id());
        if let Method::ChannelClose(_) = method {
            self.channel.close();
            conn.outbox.push(Outgoing::ChannelEnd { channel: self.number, method: Method::ChannelCloseOk(ChannelCloseOk {}) });
            return Ok(true);
        }
        match self.dispatch(method, conn) {
            Ok(()) => Ok(false),
            Err(Failure::Connection(ConnError::Close { code, text, class_id: 0, method_id: 0 })) => {
                Err(ConnError::new(code, text, class_id, method_id))
            }
            Err(Failure::Connection(e)) => Err(e),
            Err(Failure::Channel(e)) => {
                self.fail(e, class_id, method_id, conn);
                Ok(false)
            }
        }
    }

    /// The delivery acknowledgement timeout: a delivery of this channel stayed unacked too long, so the
    /// channel is closed with 406 and its unacked messages requeued, as RabbitMQ does.
    pub fn check_ack_timeout(&mut self, now_ms: u64, conn: &ConnectionShared) {
        if self.closing {
            return;
        }
        let Some(timeout) = self.channel.ack_timed_out(now_ms, conn.consumer_timeout_ms) else { return };
        tracing::warn!(connection = conn.id, channel = self.number, timeout_ms = timeout,
            "a consumer timed out waiting for a delivery acknowledgement; closing its channel");
        let text = format!(
            "delivery acknowledgement on channel {} timed out. Timeout value used: {timeout} ms. This timeout value can be configured, see consumers doc guide to learn more",
            self.number
        );
        self.fail(BrokerError::precondition_failed(text), 0, 0, conn);
    }

    /// A channel exception: close the channel and settle what it held, as RabbitMQ does at once.
    fn fail(&mut self, e: BrokerError, class_id: u16, method_id: u16, conn: &ConnectionShared) {
        tracing::debug!(channel = self.number, code = e.code, text = %e.text, "channel error");
        self.closing = true;
        self.pending = None;
        if self.tx.is_some() {
            self.tx = Some(Vec::new());
            self.tx_bytes = 0;
            self.tx_settled = (0, Default::default());
        }
        self.channel.close();
        // After our channel.close the client discards everything on the channel but close/close-ok.
        conn.outbox.push(Outgoing::ChannelEnd {
            channel: self.number,
            method: Method::ChannelClose(ChannelClose { reply_code: e.code, reply_text: e.reply_text(), class_id, method_id }),
        });
    }

    fn queue_name(&self, given: &str) -> Result<String, Failure> {
        if !given.is_empty() {
            return Ok(given.to_string());
        }
        self.last_queue
            .clone()
            .ok_or_else(|| Failure::Channel(BrokerError::not_found("no previously declared queue")))
    }

    fn reply(&self, conn: &ConnectionShared, method: Method) {
        conn.outbox.method(self.number, method);
    }

    fn dispatch(&mut self, method: Method, conn: &ConnectionShared) -> Handled {
        let vhost = &conn.vhost;
        match method {
            Method::ChannelFlow(m) => {
                self.channel.flow(m.active);
                self.reply(conn, Method::ChannelFlowOk(ChannelFlowOk { active: m.active }));
            }
            Method::ChannelFlowOk(_) | Method::ChannelCloseOk(_) => {}
            Method::AccessRequest(_) => self.reply(conn, Method::AccessRequestOk(AccessRequestOk { reserved_1: 1 })),

            Method::ExchangeDeclare(m) => {
                // The default exchange is refused for what it is first (by the vhost), as RabbitMQ.
                if !m.passive && !m.exchange.is_empty() {
                    self.access.check(conn, Perm::Configure, Resource::Exchange, &m.exchange)?;
                    // A new exchange with an alternate exchange: reading it, writing the other.
                    if let Some(ae) = m.arguments.get("alternate-exchange").and_then(|v| v.as_str()) {
                        if vhost.exchange(&m.exchange).is_err() {
                            self.access.check(conn, Perm::Read, Resource::Exchange, &m.exchange)?;
                            self.access.check(conn, Perm::Write, Resource::Exchange, ae)?;
                        }
                    }
                }
                vhost.exchange_declare(&ExchangeDeclare {
                    name: &m.exchange,
                    kind: &m.kind,
                    passive: m.passive,
                    durable: m.durable,
                    auto_delete: m.auto_delete,
                    internal: m.internal,
                    arguments: &m.arguments,
                })?;
                if !m.nowait {
                    self.reply(conn, Method::ExchangeDeclareOk(ExchangeDeclareOk {}));
                }
            }
            Method::ExchangeDelete(m) => {
                // The default and amq.* exchanges are refused first, for what they are (as RabbitMQ).
                if !m.exchange.is_empty() && !m.exchange.starts_with("amq.") {
                    self.access.check(conn, Perm::Configure, Resource::Exchange, &m.exchange)?;
                }
                vhost.exchange_delete(&m.exchange, m.if_unused)?;
                if !m.nowait {
                    self.reply(conn, Method::ExchangeDeleteOk(ExchangeDeleteOk {}));
                }
            }
            Method::ExchangeBind(m) => {
                self.check_binding(conn, Resource::Exchange, &m.destination, &m.source, &m.routing_key)?;
                vhost.exchange_bind(&m.destination, &m.source, &m.routing_key, &m.arguments)?;
                if !m.nowait {
                    self.reply(conn, Method::ExchangeBindOk(ExchangeBindOk {}));
                }
            }
            Method::ExchangeUnbind(m) => {
                self.check_binding(conn, Resource::Exchange, &m.destination, &m.source, &m.routing_key)?;
                vhost.exchange_unbind(&m.destination, &m.source, &m.routing_key, &m.arguments)?;
                if !m.nowait {
                    self.reply(conn, Method::ExchangeUnbindOk(ExchangeUnbindOk {}));
                }
            }

            Method::QueueDeclare(m) => {
                if !m.passive {
                    // A server-named queue is checked as one of its names (amq.gen-...).
                    let checked = if m.queue.is_empty() { warren_broker::names::generated_name("amq.gen-") } else { m.queue.clone() };
                    self.access.check(conn, Perm::Configure, Resource::Queue, &checked)?;
                    // A new queue with a dead-letter exchange: reading it, writing the exchange.
                    if let Some(dlx) = m.arguments.get("x-dead-letter-exchange").and_then(|v| v.as_str()) {
                        if m.queue.is_empty() || vhost.queue_any(&m.queue).is_none() {
                            self.access.check(conn, Perm::Read, Resource::Queue, &checked)?;
                            self.access.check(conn, Perm::Write, Resource::Exchange, dlx)?;
                        }
                    }
                }
                let (queue, message_count, consumer_count) = vhost.queue_declare(&QueueDeclare {
                    name: &m.queue,
                    passive: m.passive,
                    durable: m.durable,
                    exclusive: m.exclusive,
                    auto_delete: m.auto_delete,
                    arguments: &m.arguments,
                    connection_id: conn.id,
                })?;
                self.last_queue = Some(queue.clone());
                if !m.nowait {
                    self.reply(conn, Method::QueueDeclareOk(QueueDeclareOk { queue, message_count, consumer_count }));
                }
            }
            Method::QueueBind(m) => {
                let queue = self.queue_name(&m.queue)?;
                let routing_key = if m.queue.is_empty() && m.routing_key.is_empty() { queue.clone() } else { m.routing_key };
                self.check_binding(conn, Resource::Queue, &queue, &m.exchange, &routing_key)?;
                vhost.queue_bind(&queue, &m.exchange, &routing_key, &m.arguments, conn.id)?;
                if !m.nowait {
                    self.reply(conn, Method::QueueBindOk(QueueBindOk {}));
                }
            }
            Method::QueueUnbind(m) => {
                let queue = self.queue_name(&m.queue)?;
                self.check_binding(conn, Resource::Queue, &queue, &m.exchange, &m.routing_key)?;
                vhost.queue_unbind(&queue, &m.exchange, &m.routing_key, &m.arguments, conn.id)?;
                self.reply(conn, Method::QueueUnbindOk(QueueUnbindOk {}));
            }
            Method::QueuePurge(m) => {
                let queue = self.queue_name(&m.queue)?;
                self.access.check(conn, Perm::Read, Resource::Queue, &queue)?;
                let message_count = vhost.queue_purge(&queue, conn.id)?;
                if !m.nowait {
                    self.reply(conn, Method::QueuePurgeOk(QueuePurgeOk { message_count }));
                }
            }
            Method::QueueDelete(m) => {
                let queue = self.queue_name(&m.queue)?;
                self.access.check(conn, Perm::Configure, Resource::Queue, &queue)?;
                let message_count = vhost.queue_delete(&queue, m.if_unused, m.if_empty, conn.id)?;
                if !m.nowait {
                    self.reply(conn, Method::QueueDeleteOk(QueueDeleteOk { message_count }));
                }
            }

            Method::BasicQos(m) => {
                if m.prefetch_size != 0 {
                    return Err(BrokerError::not_implemented(format!(
                        "prefetch_size!=0 ({}) is not supported; use prefetch_count",
                        m.prefetch_size
                    ))
                    .into());
                }
                self.channel.qos(m.prefetch_count, m.global);
                self.reply(conn, Method::BasicQosOk(BasicQosOk {}));
            }
            Method::BasicConsume(m) => self.basic_consume(m, conn)?,
            Method::BasicCancel(m) => {
                self.channel.cancel(&m.consumer_tag);
                if !m.nowait {
                    self.reply(conn, Method::BasicCancelOk(BasicCancelOk { consumer_tag: m.consumer_tag }));
                }
            }
            Method::BasicGet(m) => {
                let name = self.queue_name(&m.queue)?;
                self.access.check(conn, Perm::Read, Resource::Queue, &name)?;
                let queue = vhost.queue(&name, conn.id)?;
                queue.check_consumable()?;
                self.get(queue, m.no_ack, conn);
            }
            Method::BasicPublish(m) => {
                if m.immediate {
                    return Err(BrokerError::not_implemented("immediate=true").into());
                }
                self.pending = Some(PendingPublish {
                    publish: m,
                    header: None,
                    body_size: 0,
                    body: BytesMut::new(),
                    single: None,
                    unfinished: None,
                });
            }
            Method::BasicAck(m) => self.settle(m.delivery_tag, m.multiple, Settle::Ack, conn)?,
            Method::BasicNack(m) => self.settle(m.delivery_tag, m.multiple, Settle::Reject { requeue: m.requeue }, conn)?,
            Method::BasicReject(m) => self.settle(m.delivery_tag, false, Settle::Reject { requeue: m.requeue }, conn)?,
            Method::BasicRecover(_) => {
                self.channel.recover();
                self.reply(conn, Method::BasicRecoverOk(BasicRecoverOk {}));
            }
            Method::BasicRecoverAsync(_) => self.channel.recover(),

            Method::ConfirmSelect(m) => {
                if self.tx.is_some() {
                    return Err(BrokerError::precondition_failed("cannot switch from tx to confirm mode").into());
                }
                self.confirm = true;
                if !m.nowait {
                    self.reply(conn, Method::ConfirmSelectOk(ConfirmSelectOk {}));
                }
            }
            Method::TxSelect(_) => {
                if self.confirm {
                    return Err(BrokerError::precondition_failed("cannot switch from confirm to tx mode").into());
                }
                if self.tx.is_none() {
                    self.tx = Some(Vec::new());
                }
                self.reply(conn, Method::TxSelectOk(TxSelectOk {}));
            }
            Method::TxCommit(_) => self.tx_commit(conn)?,
            Method::TxRollback(_) => {
                let Some(tx) = self.tx.as_mut() else {
                    return Err(BrokerError::precondition_failed("channel is not transactional").into());
                };
                tx.clear();
                self.tx_bytes = 0;
                self.tx_settled = (0, Default::default());
                self.reply(conn, Method::TxRollbackOk(TxRollbackOk {}));
            }

            other => {
                return Err(Failure::Connection(ConnError::new(
                    c::COMMAND_INVALID,
                    format!("COMMAND_INVALID - {} is not a method a client may send", other.name()),
                    other.class_id(),
                    other.method_id(),
                )))
            }
        }
        Ok(())
    }

    /// basic.get: answers now, or leaves a [`WaitingGet`] for the connection, which awaits what the
    /// queue needs (off the runtime's threads' time) and calls this again before reading on.
    pub fn get(&mut self, queue: Arc<Queue>, no_ack: bool, conn: &ConnectionShared) {
        match queue.get(&*self.channel, no_ack) {
            Got::Message => {}
            Got::Empty => self.reply(conn, Method::BasicGetEmpty(BasicGetEmpty { reserved_1: String::new() })),
            Got::Later(wait) => *conn.waiting_get.lock() = Some(WaitingGet { channel: self.number, queue, no_ack, wait }),
            Got::Failed(text) => {
                let get = Method::BasicGet(BasicGet::default());
                self.fail(BrokerError::not_found(text), get.class_id(), get.method_id(), conn);
            }
        }
    }

    fn basic_consume(&mut self, m: BasicConsume, conn: &ConnectionShared) -> Handled {
        if m.queue == direct_reply::PSEUDO_QUEUE {
            return self.reply_consume(m, conn);
        }
        let name = self.queue_name(&m.queue)?;
        self.access.check(conn, Perm::Read, Resource::Queue, &name)?;
        let queue = conn.vhost.queue(&name, conn.id)?;
        let tag = self.new_consumer_tag(&m.consumer_tag)?;
        let args = warren_broker::ConsumerArgs::parse(&queue.name, &m.arguments)?;
        let consumer = self.channel.new_consumer(tag.clone().into(), queue.clone(), m.no_ack, m.exclusive, args);
        let outbox = conn.outbox.clone();
        let number = self.number;
        let nowait = m.nowait;
        // consume-ok must leave before the first delivery: the queue calls this under its lock,
        // before it delivers anything to the new consumer.
        queue.add_consumer(consumer.clone(), move || {
            if !nowait {
                outbox.method(number, Method::BasicConsumeOk(BasicConsumeOk { consumer_tag: tag }));
            }
        })?;
        self.channel.add_consumer(consumer);
        Ok(())
    }

    /// The tag a basic.consume asked for (generated if empty); reusing one of the channel's is a
    /// connection error, as in RabbitMQ.
    fn new_consumer_tag(&self, given: &str) -> Result<String, Failure> {
        let tag = if given.is_empty() { warren_broker::vhost::generated_name("amq.ctag-") } else { given.to_owned() };
        if self.channel.has_consumer(&tag) {
            return Err(Failure::Connection(ConnError::new(
                c::NOT_ALLOWED,
                format!("NOT_ALLOWED - attempt to reuse consumer tag '{tag}'"),
                c::CLASS_BASIC,
                20,
            )));
        }
        Ok(tag)
    }

    /// basic.consume from `amq.rabbitmq.reply-to` (direct reply-to).
    fn reply_consume(&mut self, m: BasicConsume, conn: &ConnectionShared) -> Handled {
        let tag = self.new_consumer_tag(&m.consumer_tag)?;
        warren_broker::ConsumerArgs::parse(direct_reply::PSEUDO_QUEUE, &m.arguments)?;
        self.channel.start_reply_consumer(&conn.vhost.replies, tag.as_str().into(), m.no_ack)?;
        if !m.nowait {
            self.reply(conn, Method::BasicConsumeOk(BasicConsumeOk { consumer_tag: tag }));
        }
        Ok(())
    }

    /// Checks that a transaction can buffer one more operation of `bytes`.
    fn tx_room(&self, bytes: usize, conn: &ConnectionShared) -> Result<(), BrokerError> {
        let ops = self.tx.as_ref().map_or(0, Vec::len);
        let max_bytes = TX_MAX_BYTES.max(conn.max_message_size as usize);
        if ops >= TX_MAX_OPS || self.tx_bytes + bytes > max_bytes {
            return Err(BrokerError::precondition_failed(format!(
                "transaction too large: {ops} operations and {} bytes buffered (at most {TX_MAX_OPS} operations \
                 and {max_bytes} bytes until tx.commit); commit more often",
                self.tx_bytes
            )));
        }
        Ok(())
    }

    fn settle(&mut self, delivery_tag: u64, multiple: bool, how: Settle, conn: &ConnectionShared) -> Handled {
        if self.tx.is_some() {
            self.tx_room(0, conn)?;
            // An unknown tag fails the transaction now, before any of it is done (as RabbitMQ).
            let (upto, singles) = &mut self.tx_settled;
            let all = multiple && delivery_tag == 0;
            if !all && (delivery_tag <= *upto || singles.contains(&delivery_tag) || !self.channel.is_unacked(delivery_tag)) {
                return Err(BrokerError::precondition_failed(format!("unknown delivery tag {delivery_tag}")).into());
            }
            if all {
                *upto = u64::MAX;
            } else if multiple {
                *upto = delivery_tag;
                singles.retain(|t| *t > delivery_tag);
            } else {
                singles.insert(delivery_tag);
            }
            if let Some(tx) = self.tx.as_mut() {
                tx.push(TxOp::Settle { delivery_tag, multiple, how });
            }
            return Ok(());
        }
        self.channel.settle(delivery_tag, multiple, how)?;
        Ok(())
    }

    fn tx_commit(&mut self, conn: &ConnectionShared) -> Handled {
        let Some(ops) = self.tx.as_mut().map(std::mem::take) else {
            return Err(BrokerError::precondition_failed("channel is not transactional").into());
        };
        self.tx_bytes = 0;
        self.tx_settled = (0, Default::default());
        let (mut last_ticket, mut first_seq, mut last_seq, mut refused_now) = (None, u64::MAX, 0, 0);
        for op in ops {
            let ticket = match op {
                TxOp::Publish { exchange, mandatory, message } => {
                    let routed = self.route(conn, &exchange, mandatory, message)?;
                    first_seq = first_seq.min(routed.seq);
                    last_seq = last_seq.max(routed.seq);
                    refused_now += usize::from(routed.rejected);
                    routed.ticket
                }
                TxOp::Settle { delivery_tag, multiple, how } => {
                    // Quorum queues resolve this seq once their group applied the settlement.
                    let seq = conn.session.next_seq();
                    first_seq = first_seq.min(seq);
                    last_seq = last_seq.max(seq);
                    let publisher = warren_broker::Publisher { session: &conn.session, seq };
                    self.channel.settle_for(delivery_tag, multiple, how, Some(publisher))?
                }
            };
            last_ticket = last_ticket.max(ticket);
        }
        // commit-ok once everything the transaction published, and the acks of what it settled, are on
        // disk (classic queues) or applied by their groups (quorum queues); if any of it was refused
        // (a full queue, no majority in time, a home node down), the commit fails instead.
        conn.outbox.push(Outgoing::WhenDurable {
            channel: self.number,
            ticket: last_ticket,
            seq: last_seq,
            action: DurableAction::TxCommit { first_seq: first_seq.min(last_seq), refused_now },
        });
        Ok(())
    }

    /// The writer found that work of this channel's last tx.commit was not done: the commit fails
    /// with a channel error (never commit-ok), as RabbitMQ fails a commit it cannot carry out.
    pub fn commit_failed(&mut self, text: String, conn: &ConnectionShared) {
        if self.closing || self.tx.is_none() {
            return;
        }
        self.fail(BrokerError::precondition_failed(text), c::CLASS_TX, 20, conn);
    }

    pub fn handle_header(&mut self, header: ContentHeader, conn: &ConnectionShared) -> Result<(), ConnError> {
        if self.closing {
            return Ok(());
        }
        let Some(pending) = self.pending.as_mut().filter(|p| p.header.is_none()) else {
            return Err(ConnError::new(
                c::UNEXPECTED_FRAME,
                "UNEXPECTED_FRAME - content header frame without a preceding basic.publish".to_string(),
                0,
                0,
            ));
        };
        if header.class_id != c::CLASS_BASIC {
            return Err(ConnError::new(
                c::FRAME_ERROR,
                format!("FRAME_ERROR - content header for class {} (only class 60, basic, carries content)", header.class_id),
                0,
                0,
            ));
        }
        if header.body_size > conn.max_message_size {
            let size = header.body_size;
            self.pending = None;
            // The body frames still on their way are discarded while the channel closes.
            self.fail(
                BrokerError::precondition_failed(format!(
                    "message size {size} is larger than configured max size {}",
                    conn.max_message_size
                )),
                c::CLASS_BASIC,
                40,
                conn,
            );
            return Ok(());
        }
        pending.body_size = header.body_size;
        pending.header = Some(header);
        if pending.body_size == 0 {
            return self.complete_publish(conn);
        }
        Ok(())
    }

    pub fn handle_body(&mut self, payload: Bytes, conn: &ConnectionShared) -> Result<(), ConnError> {
        if self.closing {
            return Ok(());
        }
        let Some(pending) = self.pending.as_mut().filter(|p| p.header.is_some()) else {
            return Err(ConnError::new(
                c::UNEXPECTED_FRAME,
                "UNEXPECTED_FRAME - content body frame without a preceding content header".to_string(),
                0,
                0,
            ));
        };
        let received = pending.body.len() as u64 + pending.single.as_ref().map_or(0, |b| b.len() as u64);
        if received + payload.len() as u64 > pending.body_size {
            return Err(ConnError::new(
                c::FRAME_ERROR,
                format!(
                    "FRAME_ERROR - content body is longer than the {} bytes its header declared",
                    pending.body_size
                ),
                0,
                0,
            ));
        }
        if received == 0 && payload.len() as u64 == pending.body_size {
            pending.single = Some(payload);
        } else {
            let max = 2 * conn.max_message_size;
            let unfinished = pending.unfinished.get_or_insert_with(|| Unfinished::new(&conn.unfinished_content));
            if let Err(held) = unfinished.add(payload.len() as u64, max) {
                self.fail(
                    BrokerError::precondition_failed(format!(
                        "{held} bytes of unfinished messages on this connection's channels, at most {max} \
                         (twice max-message-size); send each message's frames together"
                    )),
                    c::CLASS_BASIC,
                    40,
                    conn,
                );
                return Ok(());
            }
            if let Some(first) = pending.single.take() {
                pending.body.extend_from_slice(&first);
            }
            // Grow with what arrived (doubling, never past the declared size), never by what the header
            // declares: a header claiming 100 MB with no body behind it costs nothing.
            let needed = pending.body.len() + payload.len();
            if needed > pending.body.capacity() {
                let target = (pending.body.len() * 2).max(needed).min(pending.body_size as usize);
                pending.body.reserve(target - pending.body.len());
            }
            pending.body.extend_from_slice(&payload);
        }
        let total = pending.body.len() as u64 + pending.single.as_ref().map_or(0, |b| b.len() as u64);
        if total == pending.body_size {
            return self.complete_publish(conn);
        }
        Ok(())
    }

    /// Header and body are in: build the message and route it (or buffer it in a transaction).
    fn complete_publish(&mut self, conn: &ConnectionShared) -> Result<(), ConnError> {
        let Some(pending) = self.pending.take() else { return Ok(()) };
        let Some(header) = pending.header else { return Ok(()) };
        let body = match pending.single {
            Some(b) => b,
            None => pending.body.freeze(),
        };
        let publish = pending.publish;
        if let Err(e) = self.access.check_publish(conn, &publish.exchange, &publish.routing_key) {
            self.fail(e, c::CLASS_BASIC, 40, conn);
            return Ok(());
        }
        match self.build_message(&publish, header.properties, body, conn) {
            Err(e) => {
                self.fail(e, c::CLASS_BASIC, 40, conn);
                Ok(())
            }
            Ok(message) => {
                if self.tx.is_some() {
                    let bytes = message.memory_bytes();
                    // A publish to a missing or internal exchange fails the transaction now, before
                    // any of it is routed (as RabbitMQ).
                    if let Err(e) = self.tx_room(bytes, conn).and_then(|()| conn.vhost.publishable_exchange(&publish.exchange).map(|_| ())) {
                        self.fail(e, c::CLASS_BASIC, 40, conn);
                        return Ok(());
                    }
                    self.tx_bytes += bytes;
                    if let Some(tx) = self.tx.as_mut() {
                        tx.push(TxOp::Publish { exchange: publish.exchange, mandatory: publish.mandatory, message });
                    }
                    return Ok(());
                }
                match self.route(conn, &publish.exchange, publish.mandatory, message) {
                    Ok(_) => Ok(()),
                    Err(Failure::Channel(e)) => {
                        self.fail(e, c::CLASS_BASIC, 40, conn);
                        Ok(())
                    }
                    Err(Failure::Connection(ConnError::Close { code, text, .. })) => {
                        Err(ConnError::new(code, text, c::CLASS_BASIC, 40))
                    }
                    Err(Failure::Connection(e)) => Err(e),
                }
            }
        }
    }

    /// A binding's checks, in RabbitMQ's order: write on the destination, read on the source,
    /// then (a topic exchange, with topic permissions) read of the routing key.
    fn check_binding(&mut self, conn: &ConnectionShared, kind: Resource, destination: &str, source: &str, key: &str) -> Result<(), BrokerError> {
        self.access.check(conn, Perm::Write, kind, destination)?;
        if source.is_empty() {
            // Refused for what it is (by the vhost), before the read check, as RabbitMQ.
            return Ok(());
        }
        self.access.check(conn, Perm::Read, Resource::Exchange, source)?;
        if self.access.has_topic_permissions(conn) {
            if let Ok(exchange) = conn.vhost.exchange(source) {
                self.access.check_topic(conn, Perm::Read, &exchange.name, exchange.kind, key)?;
            }
        }
        Ok(())
    }

    fn build_message(
        &self,
        publish: &BasicPublish,
        properties: Bytes,
        body: Bytes,
        conn: &ConnectionShared,
    ) -> Result<Message, BrokerError> {
        let view = PropertiesView::new(&properties)
            .map_err(|e| BrokerError::new(c::SYNTAX_ERROR, format!("malformed message properties: {e}")))?;
        if let Some(user_id) = view.user_id() {
            if user_id != conn.user.name.as_bytes() {
                return Err(BrokerError::precondition_failed(format!(
                    "user_id property set to '{}' but authenticated user was '{}'",
                    String::from_utf8_lossy(user_id),
                    conn.user.name
                )));
            }
        }
        let expiration_ms = match view.expiration() {
            None => None,
            Some(s) => Some(warren_broker::message::parse_expiration(s).ok_or_else(|| {
                BrokerError::precondition_failed(format!("invalid expiration '{s}': expected a non-negative integer of milliseconds"))
            })?),
        };
        // Direct reply-to: the request names this channel's reply consumer.
        let reply_to = if view.reply_to() == Some(direct_reply::PSEUDO_QUEUE.as_bytes()) {
            let address = self
                .channel
                .reply_address()
                .ok_or_else(|| BrokerError::precondition_failed("fast reply consumer does not exist"))?;
            let rewritten = view
                .with_reply_to(&properties, &address)
                .ok_or_else(|| BrokerError::internal("could not rewrite the reply_to property"))?;
            Some(Bytes::from(rewritten))
        } else {
            None
        };
        let persistent = view.delivery_mode() == Some(2);
        Ok(Message {
            exchange: publish.exchange.clone(),
            routing_key: publish.routing_key.clone(),
            persistent,
            expiration_ms,
            properties: reply_to.unwrap_or(properties),
            body,
        })
    }

    /// Publishes into the vhost; queues basic.return and the confirm as needed. Returns the
    /// store ticket the message must reach to be durable, and its pub seq in the connection's publisher
    /// session (0 when nothing waits for it), which quorum queues resolve once applied.
    fn route(&mut self, conn: &ConnectionShared, exchange: &str, mandatory: bool, message: Message) -> Result<Routed, Failure> {
        let returned = mandatory.then(|| (message.exchange.clone(), message.routing_key.clone(), message.properties.clone(), message.body.clone()));
        let waits = self.confirm || self.tx.is_some();
        let seq = if waits { conn.session.next_seq() } else { 0 };
        let publisher = waits.then_some(warren_broker::Publisher { session: &conn.session, seq });
        let outcome = conn.vhost.publish_by(exchange, message, waits, publisher)?;
        if let Some(queue) = &outcome.slow_queue {
            *conn.slowed_by.lock() = Some(queue.clone());
        }
        if outcome.store_behind {
            conn.store_behind.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if !outcome.routed {
            if let Some((exchange, routing_key, properties, body)) = returned {
                let message = Arc::new(Message { exchange, routing_key, properties, body, persistent: false, expiration_ms: None });
                conn.outbox.push(Outgoing::Return { channel: self.number, reply_code: c::NO_ROUTE, reply_text: "NO_ROUTE", message });
            }
        }
        if self.confirm {
            let delivery_tag = self.next_publish_tag;
            self.next_publish_tag += 1;
            let action = if outcome.rejected { DurableAction::Nack { delivery_tag } } else { DurableAction::Ack { delivery_tag } };
            let ticket = if outcome.rejected { None } else { outcome.ticket };
            conn.outbox.push(Outgoing::WhenDurable { channel: self.number, ticket, seq, action });
        }
        Ok(Routed { ticket: outcome.ticket, seq, rejected: outcome.rejected })
    }
}

/// A routed publish: the store ticket it waits for, its publisher-session seq (0: none), and
/// whether a queue refused it at once.
struct Routed {
    ticket: Option<u64>,
    seq: u64,
    rejected: bool,
}
