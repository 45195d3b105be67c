//! The durable topology replicated through a metadata group (`metadata::group`), broker side:
//! brokers with their own data directories apply one ordered stream of entries and must end with
//! the same topology and queue ids, whichever broker proposed each change; snapshots restore it.
//!
//! The group here is an in-process sequencer (one ordered log, each broker applying it on its own
//! thread, as a Raft state machine task would): what is under test is the broker's half, the one
//! apply path, the waits and the snapshot. The Raft half is tested in crates/cluster and, end to
//! end, in tests/python/test_cluster_metadata.py.

use bytes::Bytes;
use parking_lot::Mutex;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use warren_broker::metadata::group::{self, BoxFuture, Committed, MetadataGroup, ProposeFailed};
use warren_broker::vhost::{ExchangeDeclare, QueueDeclare};
use warren_broker::{Broker, BrokerOptions, Message, VHost};
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

/// One ordered log of entries, delivered to every member's applier thread.
#[derive(Default)]
struct Sequencer {
    log: Mutex<Vec<Bytes>>,
    members: Mutex<Vec<mpsc::Sender<(u64, Bytes)>>>,
    /// While set, proposals are refused (no quorum).
    down: Mutex<bool>,
    appliers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Sequencer {
    /// Adds a member that applies the log from entry `from` on (1 = all of it).
    fn join(self: &Arc<Self>, broker: &Arc<Broker>, from: u64) {
        self.join_lagging(broker, from, Duration::ZERO)
    }

    /// A member whose state machine takes `lag` to apply each entry (a busy or distant node).
    fn join_lagging(self: &Arc<Self>, broker: &Arc<Broker>, from: u64, lag: Duration) {
        let (tx, rx) = mpsc::channel::<(u64, Bytes)>();
        let b = broker.clone();
        let applier = std::thread::spawn(move || {
            while let Ok((index, entry)) = rx.recv() {
                std::thread::sleep(lag);
                b.apply_metadata_entry(index, &entry);
            }
        });
        self.appliers.lock().push(applier);
        let log = self.log.lock();
        for (i, e) in log.iter().enumerate().skip(from.saturating_sub(1) as usize) {
            tx.send((i as u64 + 1, e.clone())).unwrap();
        }
        self.members.lock().push(tx);
        broker.set_metadata_group(Arc::new(Member(self.clone()))).unwrap();
    }
}

impl Sequencer {
    /// Stops the appliers (they hold their brokers) and closes the brokers, before the test's
    /// directories go.
    fn stop(&self, brokers: &[&Arc<Broker>]) {
        self.members.lock().clear();
        for a in self.appliers.lock().drain(..) {
            a.join().unwrap();
        }
        for b in brokers {
            b.close();
        }
    }
}

struct Member(Arc<Sequencer>);

impl MetadataGroup for Member {
    fn propose(&self, entry: Bytes, _timeout: Duration) -> BoxFuture<Result<Committed, ProposeFailed>> {
        let seq = self.0.clone();
        Box::pin(async move {
            if *seq.down.lock() {
                return Err(ProposeFailed::NotCommitted("no quorum (test)".into()));
            }
            let mut log = seq.log.lock();
            log.push(entry.clone());
            let index = log.len() as u64;
            seq.members.lock().retain(|m| m.send((index, entry.clone())).is_ok());
            // The members apply it later: no conflict is known here (test_cluster_metadata.py has them).
            Ok(Committed { index, conflict: false, refused: None })
        })
    }
}

fn exchange(v: &VHost, name: &str) {
    let args = FieldTable::new();
    v.exchange_declare(&ExchangeDeclare { name, kind: "direct", passive: false, durable: true, auto_delete: false, internal: false, arguments: &args })
        .unwrap();
}

fn queue(v: &VHost, name: &str) {
    let args = FieldTable::new();
    v.queue_declare(&QueueDeclare { name, passive: false, durable: true, exclusive: false, auto_delete: false, arguments: &args, connection_id: 1 })
        .unwrap();
}

fn message(routing_key: &str) -> Message {
    Message { exchange: "ex".into(), routing_key: routing_key.into(), persistent: true, expiration_ms: None, properties: Bytes::new(), body: Bytes::from_static(b"hi") }
}

/// (name, id) of every queue, (exchange, bindings) of every exchange.
fn topology(b: &Broker) -> (Vec<(String, u64)>, Vec<(String, usize)>) {
    let v = b.vhost("/").unwrap();
    let mut queues: Vec<(String, u64)> = v.queues().iter().map(|q| (q.name.clone(), q.id)).collect();
    queues.sort();
    let mut exchanges: Vec<(String, usize)> = v.exchanges().iter().map(|e| (e.name.clone(), e.binding_count())).collect();
    exchanges.sort();
    (queues, exchanges)
}

fn wait_applied(b: &Broker, index: u64) {
    for _ in 0..500 {
        if b.metadata_applied() >= index {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("broker stuck at {} < {index}", b.metadata_applied());
}

#[test]
fn changes_made_on_either_node_give_both_the_same_topology_and_queue_ids() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (b1, b2) = (open(d1.path()), open(d2.path()));
    let seq = Arc::new(Sequencer::default());
    seq.join(&b1, 1);
    seq.join(&b2, 1);
    let (v1, v2) = (b1.vhost("/").unwrap(), b2.vhost("/").unwrap());

    exchange(&v1, "ex");
    queue(&v1, "q1");
    v1.queue_bind("q1", "ex", "k1", &FieldTable::new(), 1).unwrap();
    // Right after the -ok on node 1, node 2 routes with it (a miss waits for the barrier).
    let routed = v2.publish("ex", message("k1"), true).unwrap();
    assert!(routed.routed, "a publish on node 2 right after bind-ok on node 1 must be routed");
    queue(&v2, "q2");
    v2.queue_bind("q2", "ex", "k2", &FieldTable::new(), 1).unwrap();
    queue(&v1, "q3");
    let mut prio = FieldTable::new();
    prio.0.push(("x-max-priority".into(), FieldValue::U8(3)));
    v2.queue_declare(&QueueDeclare { name: "p", passive: false, durable: true, exclusive: false, auto_delete: false, arguments: &prio, connection_id: 1 })
        .unwrap();
    queue(&v1, "q4");
    wait_applied(&b1, seq.log.lock().len() as u64);
    wait_applied(&b2, seq.log.lock().len() as u64);
    assert_eq!(topology(&b1), topology(&b2));
    let ids: Vec<u64> = ["q1", "q2", "q3", "p", "q4"].iter().map(|n| v1.queue(n, 1).unwrap().id).collect();
    assert_eq!(ids, vec![1, 2, 3, 4, 8], "ids follow the log order; a priority queue takes one per level");

    // Deleted on node 2: gone on node 1 (with its bindings).
    // (A positive lookup does not wait: node 1 may route to q1 until it applies the deletion.)
    v2.queue_delete("q1", false, false, 1).unwrap();
    wait_applied(&b1, seq.log.lock().len() as u64);
    assert!(v1.queue("q1", 1).is_err());
    assert!(!v1.publish("ex", message("k1"), true).unwrap().routed);
    assert_eq!(topology(&b1), topology(&b2));
    seq.stop(&[&b1, &b2]);
}

#[test]
fn a_passive_declare_on_another_node_right_after_declare_ok_finds_the_queue() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (b1, b2) = (open(d1.path()), open(d2.path()));
    let seq = Arc::new(Sequencer::default());
    seq.join(&b1, 1);
    seq.join(&b2, 1);
    let (v1, v2) = (b1.vhost("/").unwrap(), b2.vhost("/").unwrap());
    let none = FieldTable::new();
    for i in 0..50 {
        let name = format!("q{i}");
        queue(&v1, &name);
        let passive = QueueDeclare { name: &name, passive: true, durable: true, exclusive: false, auto_delete: false, arguments: &none, connection_id: 2 };
        v2.queue_declare(&passive).unwrap_or_else(|e| panic!("passive declare of {name} on node 2: {e:?}"));
    }
    seq.stop(&[&b1, &b2]);
}

#[test]
fn a_lagging_node_answers_a_miss_only_after_catching_up() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (b1, b2) = (open(d1.path()), open(d2.path()));
    let seq = Arc::new(Sequencer::default());
    seq.join(&b1, 1);
    seq.join_lagging(&b2, 1, Duration::from_millis(30));
    let (v1, v2) = (b1.vhost("/").unwrap(), b2.vhost("/").unwrap());
    let none = FieldTable::new();
    for i in 0..5 {
        let name = format!("lag{i}");
        exchange(&v1, &name);
        queue(&v1, &name);
        v1.queue_bind(&name, &name, "k", &none, 1).unwrap();
        // Node 2 is behind (30 ms an entry) but must not say 404 or unroutable.
        assert!(v2.exchange(&name).is_ok(), "exchange {name} on the lagging node");
        let mut m = message("k");
        m.exchange = name.clone();
        assert!(v2.publish(&name, m, true).unwrap().routed, "publish to {name} on the lagging node");
    }
    seq.stop(&[&b1, &b2]);
}

#[test]
fn a_restarted_node_replays_without_changing_ids_and_a_snapshot_restores_the_topology() {
    let (d1, d2, d3) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (b1, b2) = (open(d1.path()), open(d2.path()));
    let seq = Arc::new(Sequencer::default());
    seq.join(&b1, 1);
    seq.join(&b2, 1);
    let v1 = b1.vhost("/").unwrap();
    exchange(&v1, "ex");
    queue(&v1, "gone");
    queue(&v1, "q");
    v1.queue_bind("q", "ex", "k", &FieldTable::new(), 1).unwrap();
    v1.publish("ex", message("k"), true).unwrap();
    let n = seq.log.lock().len() as u64;
    wait_applied(&b2, n);
    let before = topology(&b1);

    // Node 2 stops; while away, "gone" is deleted and "new" declared.
    seq.members.lock().truncate(1);
    std::thread::sleep(Duration::from_millis(50));
    b2.close();
    drop(b2);
    v1.queue_delete("gone", false, false, 1).unwrap();
    queue(&v1, "new");
    let snapshot = b1.metadata_snapshot();

    // Node 2 restarts on its data: its metadata.log has everything up to entry n, so a replay of
    // the whole log changes nothing it had and brings what it missed.
    let b2 = open(d2.path());
    assert_eq!(b2.metadata_applied(), n);
    assert_eq!(topology(&b2), before);
    let gone_id = b2.vhost("/").unwrap().queue("gone", 1).unwrap().id;
    seq.join(&b2, 1);
    wait_applied(&b2, seq.log.lock().len() as u64);
    assert_eq!(topology(&b2), topology(&b1));
    assert!(b2.vhost("/").unwrap().queue("gone", 1).is_err());
    let _ = gone_id;

    // A fresh node installs the snapshot: same topology; an older snapshot changes nothing.
    let b3 = open(d3.path());
    b3.restore_metadata_snapshot(&snapshot).unwrap();
    assert_eq!(topology(&b3), topology(&b1));
    assert_eq!(b3.vhost("/").unwrap().queue("q", 1).unwrap().id, v1.queue("q", 1).unwrap().id);
    b3.close();
    drop(b3);
    let b3 = open(d3.path());
    assert_eq!(topology(&b3), topology(&b1), "the installed snapshot is durable");
    seq.stop(&[&b1, &b2]);
    b3.close();
}

#[test]
fn a_snapshot_deletes_queues_deleted_while_the_node_was_away_with_their_messages() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (b1, b2) = (open(d1.path()), open(d2.path()));
    let seq = Arc::new(Sequencer::default());
    seq.join(&b1, 1);
    seq.join(&b2, 1);
    let (v1, v2) = (b1.vhost("/").unwrap(), b2.vhost("/").unwrap());
    exchange(&v1, "ex");
    queue(&v1, "gone");
    queue(&v1, "kept");
    v1.queue_bind("gone", "ex", "k", &FieldTable::new(), 1).unwrap();
    wait_applied(&b2, seq.log.lock().len() as u64);
    // Node 2 holds a message in "gone" (its own copy).
    assert!(v2.publish("ex", message("k"), true).unwrap().routed);
    let gone = v2.queue("gone", 1).unwrap();
    assert_eq!(gone.message_count(), 1);
    // A snapshot taken after "gone" was deleted (node 2 did not see the entry).
    seq.members.lock().truncate(1);
    v1.queue_delete("gone", false, false, 1).unwrap();
    b2.restore_metadata_snapshot(&b1.metadata_snapshot()).unwrap();
    assert!(!topology(&b2).0.iter().any(|(name, _)| name == "gone"));
    assert_eq!(gone.message_count(), 0, "its messages went with it");
    assert_eq!(topology(&b2), topology(&b1));
    seq.stop(&[&b1, &b2]);
}

#[test]
fn a_node_with_a_standalone_topology_cannot_join_a_cluster() {
    let d1 = tempfile::tempdir().unwrap();
    let b1 = open(d1.path());
    queue(&b1.vhost("/").unwrap(), "standalone");
    let err = b1.set_metadata_group(Arc::new(Member(Arc::new(Sequencer::default())))).unwrap_err();
    assert!(err.contains("standalone topology"), "{err}");
    b1.close();
}

#[test]
fn without_quorum_a_declare_fails_with_541_and_changes_nothing() {
    let d1 = tempfile::tempdir().unwrap();
    let b1 = open(d1.path());
    let seq = Arc::new(Sequencer::default());
    seq.join(&b1, 1);
    *seq.down.lock() = true;
    let v1 = b1.vhost("/").unwrap();
    let none = FieldTable::new();
    let err = v1
        .queue_declare(&QueueDeclare { name: "q", passive: false, durable: true, exclusive: false, auto_delete: false, arguments: &none, connection_id: 1 })
        .unwrap_err();
    assert_eq!(err.code, 541, "{err:?}");
    assert!(err.text.contains("metadata group") && err.text.contains("nothing was changed"), "{}", err.text);
    *seq.down.lock() = false;
    assert!(v1.queue("q", 1).is_err());
    // A transient queue is recorded in the group too (every node routes to it), as RabbitMQ 4's
    // Khepri records every queue: without a quorum it cannot be declared either.
    *seq.down.lock() = true;
    let err = v1
        .queue_declare(&QueueDeclare { name: "t", passive: false, durable: false, exclusive: false, auto_delete: false, arguments: &none, connection_id: 1 })
        .unwrap_err();
    assert_eq!(err.code, 541, "{err:?}");
    assert!(v1.queue("t", 1).is_err());
    let _ = group::COMMIT_TIMEOUT;
    seq.stop(&[&b1]);
}

#[test]
fn users_and_vhosts_made_through_either_node_hold_on_both_and_removals_are_announced_on_both() {
    use warren_broker::auth::defs::{PermissionDef, UserDef, VHostDef};
    use warren_broker::auth::{Algorithm, PasswordHash};
    use warren_broker::metadata::Op;
    use warren_broker::AuthChange;
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (b1, b2) = (open(d1.path()), open(d2.path()));
    let seq = Arc::new(Sequencer::default());
    seq.join(&b1, 1);
    seq.join(&b2, 1);
    // Both nodes bootstrap (a cluster starting together): the second is dropped whole.
    b1.bootstrap_auth().unwrap();
    b2.bootstrap_auth().unwrap();
    wait_applied(&b1, seq.log.lock().len() as u64);
    wait_applied(&b2, seq.log.lock().len() as u64);
    assert!(b1.auth_initialized() && b2.auth_initialized());
    let hash = |b: &Broker| b.users().user("guest").unwrap().password_hash().to_rabbitmq().0;
    assert_eq!(hash(&b1), hash(&b2), "one bootstrap's guest on both nodes");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    b2.on_auth_change(Box::new(move |c| s.lock().push(c.clone())));

    let (password_hash, algorithm) = PasswordHash::new(Algorithm::Sha256, "alice's pw").to_rabbitmq();
    let alice = UserDef { name: "alice".into(), password_hash, hashing_algorithm: algorithm.into(), tags: vec![], limits: serde_json::Value::Null };
    b1.change_auth(vec![Op::VhostDeclared { vhost: VHostDef::named("v") }, Op::UserPut { user: alice }, Op::PermissionSet { permission: PermissionDef::all("alice", "v") }])
        .unwrap();
    wait_applied(&b2, seq.log.lock().len() as u64);
    let on_2 = b2.authenticate("alice", "alice's pw").expect("alice logs in on node 2");
    assert!(b2.can_access(&on_2, "v") && !b2.can_access(&on_2, "/"));
    queue(&b2.vhost("v").unwrap(), "in-v");
    wait_applied(&b1, seq.log.lock().len() as u64);
    assert!(b1.vhost("v").unwrap().queue("in-v", 1).is_ok());

    b1.change_auth(vec![Op::PermissionCleared { user: "alice".into(), vhost: "v".into() }]).unwrap();
    b2.change_auth(vec![Op::VhostDeleted { name: "v".into() }]).unwrap();
    b1.change_auth(vec![Op::UserDeleted { name: "alice".into() }]).unwrap();
    wait_applied(&b1, seq.log.lock().len() as u64);
    wait_applied(&b2, seq.log.lock().len() as u64);
    assert!(b1.vhost("v").is_none() && b2.vhost("v").is_none(), "deleted on both, with its queue");
    assert!(b2.authenticate("alice", "alice's pw").is_none());
    assert_eq!(
        *seen.lock(),
        [AuthChange::PermissionCleared { user: "alice".into(), vhost: "v".into() }, AuthChange::VhostDeleted("v".into()), AuthChange::UserDeleted("alice".into())]
    );
    seq.stop(&[&b1, &b2]);
    drop((b1, b2));
    // What node 1 applied is in its metadata log: after a restart, only guest, and no vhost v.
    let b1 = open(d1.path());
    assert!(b1.auth_initialized() && b1.vhost("v").is_none() && b1.authenticate("guest", "guest").is_some());
    assert_eq!(b1.users().all().len(), 1);
    b1.close();
}
