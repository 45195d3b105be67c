//! The durable topology across a reopen of the data directory: each change, and the changes it
//! implies (auto-deleted exchanges), are in the metadata log exactly as they are in memory.

use std::path::Path;
use std::sync::Arc;
use warren_broker::vhost::{ExchangeDeclare, QueueDeclare};
use warren_broker::{Broker, BrokerOptions, VHost};
use warren_protocol::field::{FieldTable, FieldValue};

fn open(dir: &Path) -> Arc<Broker> {
    let opts = BrokerOptions {
        default_vhost: "/".into(),
        default_user: "guest".into(),
        default_pass: "guest".into(),
        loopback_users: vec![],
        store: Default::default(),
        quorum_body_bytes: warren_broker::DEFAULT_NODE_BODY_BYTES,
    };
    Broker::open(dir, opts).expect("open").0
}

fn reopen(broker: Arc<Broker>, dir: &Path) -> Arc<VHost> {
    broker.close();
    drop(broker);
    open(dir).vhost("/").expect("default vhost")
}

fn exchange(v: &VHost, name: &str, auto_delete: bool) {
    let args = FieldTable::new();
    v.exchange_declare(&ExchangeDeclare { name, kind: "topic", passive: false, durable: true, auto_delete, internal: false, arguments: &args })
        .unwrap();
}

fn queue(v: &VHost, name: &str, arguments: &FieldTable) {
    v.queue_declare(&QueueDeclare { name, passive: false, durable: true, exclusive: false, auto_delete: false, arguments, connection_id: 1 })
        .unwrap();
}

#[test]
fn declarations_and_bindings_come_back_with_their_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path());
    let v = broker.vhost("/").unwrap();
    let mut args = FieldTable::new();
    args.0.push(("x-max-length".into(), FieldValue::I32(10)));
    queue(&v, "q", &args);
    exchange(&v, "ex", false);
    v.queue_bind("q", "ex", "a.#", &FieldTable::new(), 1).unwrap();
    v.queue_bind("q", "amq.topic", "b.*", &FieldTable::new(), 1).unwrap();
    let v = reopen(broker, dir.path());
    let q = v.queue("q", 1).unwrap();
    assert_eq!(q.arguments, args);
    assert!(v.exchange("ex").unwrap().has_bindings());
    assert!(v.exchange("amq.topic").unwrap().has_bindings());
}

#[test]
fn deleting_a_queue_durably_deletes_the_auto_delete_exchange_it_empties() {
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path());
    let v = broker.vhost("/").unwrap();
    queue(&v, "q", &FieldTable::new());
    exchange(&v, "auto", true);
    v.queue_bind("q", "auto", "k", &FieldTable::new(), 1).unwrap();
    v.queue_delete("q", false, false, 1).unwrap();
    assert!(v.exchange("auto").is_err());
    let v = reopen(broker, dir.path());
    assert!(v.queue("q", 1).is_err());
    assert!(v.exchange("auto").is_err());
}

#[test]
fn removing_the_last_binding_durably_deletes_an_auto_delete_exchange() {
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path());
    let v = broker.vhost("/").unwrap();
    queue(&v, "q", &FieldTable::new());
    exchange(&v, "auto", true);
    v.queue_bind("q", "auto", "k1", &FieldTable::new(), 1).unwrap();
    v.queue_bind("q", "auto", "k2", &FieldTable::new(), 1).unwrap();
    v.queue_unbind("q", "auto", "k1", &FieldTable::new(), 1).unwrap();
    assert!(v.exchange("auto").is_ok());
    v.queue_unbind("q", "auto", "k2", &FieldTable::new(), 1).unwrap();
    assert!(v.exchange("auto").is_err());
    let v = reopen(broker, dir.path());
    assert!(v.exchange("auto").is_err());
    assert!(v.queue("q", 1).is_ok());
}

#[test]
fn a_new_queue_never_takes_an_id_used_before_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path());
    let v = broker.vhost("/").unwrap();
    queue(&v, "a", &FieldTable::new());
    let first = v.queue("a", 1).unwrap().id;
    v.queue_delete("a", false, false, 1).unwrap();
    let v = reopen(broker, dir.path());
    queue(&v, "b", &FieldTable::new());
    assert!(v.queue("b", 1).unwrap().id > first);
}

/// The cluster's Raft logs share the store (queues `RAFT_LOG_QUEUES | g`, `RAFT_STATE_QUEUES | g`):
/// the broker's recovery neither drops them, nor keeps them aside, nor takes queue ids after them.
#[test]
fn raft_log_queues_in_the_store_are_left_to_the_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let broker = open(dir.path());
    let raft_log = warren_store::RAFT_LOG_QUEUES | 5;
    let raft_state = warren_store::RAFT_STATE_QUEUES | 5;
    let mut batch = warren_store::Batch::new();
    batch.enqueue(raft_log, 0, 0, &[b"entry"]);
    batch.enqueue(raft_state, 0, 0, &[b"vote"]);
    let ticket = broker.store().append(&mut batch).unwrap();
    broker.store().wait_durable(ticket).unwrap();
    let v = reopen(broker, dir.path());
    queue(&v, "q", &FieldTable::new());
    assert!(v.queue("q", 1).unwrap().id < 1000, "queue ids do not jump past the Raft log ids");
    for id in [raft_log, raft_state] {
        let got = v.store().read(id, 0, 10, 1 << 20).unwrap();
        assert_eq!(got.messages.len(), 1, "store queue {id:#x} is still there");
    }
}
