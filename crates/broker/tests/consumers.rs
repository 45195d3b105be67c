//! Which consumer gets the next message (`broker::consumers`), through the broker's own API: the
//! round-robin cursor stays fair when consumers come and go, priority groups, and the single active
//! consumer's successor. Every consumer is no-ack on its own channel; a `Sink` per channel records
//! what it was sent.

use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::Arc;
use warren_broker::vhost::QueueDeclare;
use warren_broker::{Broker, BrokerOptions, Channel, ClientSink, ConsumerArgs, Delivery, Message, Queue, VHost};
use warren_protocol::field::{FieldTable, FieldValue};
use warren_store::StoreOptions;

const CONN: u64 = 1;

#[derive(Default)]
struct Sink {
    bodies: Mutex<Vec<String>>,
}

impl ClientSink for Sink {
    fn send(&self, delivery: Delivery) {
        if let Delivery::Deliver { message, .. } = delivery {
            self.bodies.lock().push(String::from_utf8_lossy(&message.body).into_owned());
        }
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    _broker: Arc<Broker>,
    vhost: Arc<VHost>,
    queue: Arc<Queue>,
}

fn setup(arguments: FieldTable) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let opts = BrokerOptions {
        default_vhost: "/".into(),
        default_user: "guest".into(),
        default_pass: "guest".into(),
        loopback_users: Vec::new(),
        store: StoreOptions::default(),
        quorum_body_bytes: warren_broker::DEFAULT_NODE_BODY_BYTES,
    };
    let broker = Broker::open(dir.path(), opts).unwrap().0;
    let vhost = broker.vhost("/").unwrap();
    let d = QueueDeclare { name: "q", passive: false, durable: false, exclusive: false, auto_delete: false, arguments: &arguments, connection_id: CONN };
    vhost.queue_declare(&d).unwrap();
    let queue = vhost.queue("q", CONN).unwrap();
    Setup { _dir: dir, _broker: broker, vhost, queue }
}

/// A no-ack consumer of priority `priority` on its own channel.
fn consumer(s: &Setup, number: u16, priority: i32) -> (Arc<Channel>, Arc<Sink>) {
    let sink = Arc::new(Sink::default());
    let ch = Channel::new(number, CONN, sink.clone());
    let c = ch.new_consumer(format!("c{number}").into(), s.queue.clone(), true, false, ConsumerArgs { priority });
    s.queue.add_consumer(c.clone(), || {}).unwrap();
    ch.add_consumer(c);
    (ch, sink)
}

fn publish(s: &Setup, body: &str) {
    let m = Message {
        exchange: String::new(),
        routing_key: "q".into(),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::copy_from_slice(body.as_bytes()),
        persistent: false,
        expiration_ms: None,
    };
    s.vhost.publish("", m, false).unwrap();
}

fn got(sink: &Sink) -> Vec<String> {
    std::mem::take(&mut *sink.bodies.lock())
}

#[test]
fn round_robin_stays_fair_when_a_consumer_before_the_cursor_leaves() {
    let s = setup(FieldTable::new());
    let (a, sa) = consumer(&s, 1, 0);
    let (_b, sb) = consumer(&s, 2, 0);
    let (_c, sc) = consumer(&s, 3, 0);
    publish(&s, "1");
    publish(&s, "2");
    assert_eq!((got(&sa), got(&sb)), (vec!["1".to_string()], vec!["2".to_string()]));
    // The cursor is on c; a goes: c is still next, then b.
    a.cancel("c1");
    publish(&s, "3");
    publish(&s, "4");
    assert_eq!((got(&sc), got(&sb)), (vec!["3".to_string()], vec!["4".to_string()]));
}

#[test]
fn higher_priority_first_and_equal_priorities_alternate() {
    let s = setup(FieldTable::new());
    let (_low, slow) = consumer(&s, 1, -1);
    let (_h1, sh1) = consumer(&s, 2, 5);
    let (h2, sh2) = consumer(&s, 3, 5);
    for i in 0..4 {
        publish(&s, &i.to_string());
    }
    assert_eq!(got(&sh1), vec!["0", "2"]);
    assert_eq!(got(&sh2), vec!["1", "3"]);
    assert!(got(&slow).is_empty());
    // Flow off on one high consumer's channel: the other takes everything, the low one still nothing.
    h2.flow(false);
    publish(&s, "4");
    publish(&s, "5");
    assert_eq!(got(&sh1), vec!["4", "5"]);
    assert!(got(&slow).is_empty() && got(&sh2).is_empty());
}

#[test]
fn single_active_consumer_successor_is_highest_priority_then_earliest() {
    let mut args = FieldTable::new();
    args.insert("x-single-active-consumer".into(), FieldValue::Bool(true));
    let s = setup(args);
    let (first, s1) = consumer(&s, 1, 0);
    let (_b, sb) = consumer(&s, 2, 3);
    let (c, sc) = consumer(&s, 3, 3);
    let (_d, sd) = consumer(&s, 4, 1);
    publish(&s, "1");
    assert_eq!(got(&s1), vec!["1"]);
    first.cancel("c1");
    publish(&s, "2");
    assert_eq!(got(&sb), vec!["2"], "priority 3, registered before c");
    assert!(got(&sc).is_empty() && got(&sd).is_empty());
    // A waiting consumer leaving changes nothing.
    c.cancel("c3");
    publish(&s, "3");
    assert_eq!(got(&sb), vec!["3"]);
}
