//! A queue and the real store, through the broker's own API: which messages are written when (lazily
//! for no-ack consumers, at once when confirmed), in seq order, delivered marks, store acks of no-ack
//! deliveries once written, and the stored message format. The broker is opened on a temporary data
//! directory; a "crash" is a copy of that directory taken while the broker runs (what kill -9 leaves:
//! everything written, nothing more). `Sink` plays the consumer's connection, which is not under test.

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use warren_broker::vhost::{ExchangeDeclare, QueueDeclare};
use warren_broker::{Broker, BrokerOptions, Channel, ClientSink, ConsumerArgs, Delivery, GetWait, Got, Message, Queue, Settle, VHost};
use warren_protocol::field::FieldTable;
use warren_protocol::properties::BasicProperties;
use warren_store::{Batch, Store, StoreOptions};

const CONN: u64 = 1;

fn open(dir: &Path) -> Arc<Broker> {
    let opts = BrokerOptions {
        default_vhost: "/".into(),
        default_user: "guest".into(),
        default_pass: "guest".into(),
        loopback_users: Vec::new(),
        store: StoreOptions::default(),
        metadata_on_corruption: Default::default(),
    };
    Broker::open(dir, opts).expect("open the broker").0
}

fn vhost(broker: &Broker) -> Arc<VHost> {
    broker.vhost("/").expect("default vhost")
}

fn declare(vhost: &VHost, name: &str) -> Arc<Queue> {
    let args = FieldTable::new();
    let d = QueueDeclare { name, passive: false, durable: true, exclusive: false, auto_delete: false, arguments: &args, connection_id: CONN };
    vhost.queue_declare(&d).expect("declare");
    vhost.queue(name, CONN).expect("queue")
}

fn message(routing_key: &str, body: &str) -> Message {
    let mut props = BytesMut::new();
    BasicProperties { delivery_mode: Some(2), ..Default::default() }.encode(&mut props);
    Message {
        exchange: String::new(),
        routing_key: routing_key.into(),
        properties: props.freeze(),
        body: Bytes::copy_from_slice(body.as_bytes()),
        persistent: true,
        expiration_ms: None,
    }
}

/// Publishes a persistent message to queue `queue` through the default exchange.
fn publish(vhost: &VHost, queue: &str, body: &str, confirmed: bool) -> warren_broker::PublishOutcome {
    vhost.publish("", message(queue, body), confirmed).expect("publish")
}

/// The consumer's connection: keeps what is sent; `write` plays its writer task.
#[derive(Default)]
struct Sink {
    sent: Mutex<Vec<Delivery>>,
    full: AtomicBool,
}

impl ClientSink for Sink {
    fn send(&self, delivery: Delivery) {
        self.sent.lock().push(delivery);
    }

    fn has_room(&self) -> bool {
        !self.full.load(Ordering::SeqCst)
    }
}

impl Sink {
    /// Takes what was sent as if written to the socket: appends the store acks of no-ack deliveries.
    fn write(&self, store: &Store) -> Vec<Delivery> {
        let written: Vec<Delivery> = std::mem::take(&mut *self.sent.lock());
        let mut acks = Batch::new();
        for d in &written {
            if let Some(ack) = d.ack_when_written() {
                ack.add_to(&mut acks);
            }
        }
        if !acks.is_empty() {
            let ticket = store.append(&mut acks).unwrap();
            store.wait_durable(ticket).unwrap();
        }
        written
    }
}

fn channel(number: u16) -> (Arc<Channel>, Arc<Sink>) {
    let sink = Arc::new(Sink::default());
    (Channel::new(number, CONN, sink.clone()), sink)
}

fn consume(ch: &Arc<Channel>, queue: &Arc<Queue>, no_ack: bool) {
    let consumer = ch.new_consumer("c".into(), queue.clone(), no_ack, false, ConsumerArgs::default());
    queue.add_consumer(consumer.clone(), || {}).expect("consume");
    ch.add_consumer(consumer);
}

/// basic.get, waiting for a delivered mark when asked to.
fn get(queue: &Arc<Queue>, ch: &Channel, store: &Store, no_ack: bool) -> Got {
    loop {
        match queue.get(ch, no_ack) {
            Got::Later(GetWait::Durable(ticket)) => store.wait_durable(ticket).unwrap(),
            got => return got,
        }
    }
}

/// Every message left in `queue`, by basic.get no-ack: (body, routing key, redelivered).
fn drain(broker: &Broker, queue: &str) -> Vec<(String, String, bool)> {
    let q = vhost(broker).queue(queue, CONN).expect("queue");
    let (ch, sink) = channel(9);
    let mut out = Vec::new();
    while get(&q, &ch, broker.store(), true) == Got::Message {}
    for d in sink.write(broker.store()) {
        if let Delivery::GetOk { message, redelivered, .. } = d {
            out.push((String::from_utf8_lossy(&message.body).into_owned(), message.routing_key.clone(), redelivered));
        }
    }
    out
}

fn bodies(v: &[(String, String, bool)]) -> Vec<&str> {
    v.iter().map(|(b, _, _)| b.as_str()).collect()
}

/// A copy of the data directory as kill -9 would leave it.
fn crash_copy(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            crash_copy(&entry.path(), &target);
        } else if entry.file_name() != "LOCK" {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[test]
fn a_routing_key_of_any_length_survives_paging_to_the_store() {
    // A dead letter's routing key comes from x-dead-letter-routing-key; queues declared by older
    // versions may have one longer than 255 bytes. The store's format version 1 cut it at 255 bytes
    // (here inside a two-byte character), and the message could no longer be decoded: it was dropped.
    let dir = tempfile::tempdir().unwrap();
    let long_key = "é".repeat(200);
    {
        let broker = open(dir.path());
        let v = vhost(&broker);
        declare(&v, "q");
        let args = FieldTable::new();
        let fanout = ExchangeDeclare { name: "fan", kind: "fanout", passive: false, durable: true, auto_delete: false, internal: false, arguments: &args };
        v.exchange_declare(&fanout).unwrap();
        v.queue_bind("q", "fan", "", &args, CONN).unwrap();
        // More than the queue's window (2,048): the last ones are only in the store.
        for i in 0..2100 {
            let key = if i == 2099 { long_key.clone() } else { format!("k{i}") };
            v.publish("fan", message(&key, &format!("{i}")), true).unwrap();
        }
        broker.close();
    }
    let broker = open(dir.path());
    let got = drain(&broker, "q");
    assert_eq!(got.len(), 2100, "every message read back");
    assert_eq!(got[2099], ("2099".to_string(), long_key, false));
    broker.close();
}
