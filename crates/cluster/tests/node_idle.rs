//! Idle cost of many groups: three nodes in this process (one store each), N groups of three voters
//! each, production timers; measures the process's CPU over a quiet period once every group has a
//! leader. A measurement, not a pass/fail test (ignored by default):
//!
//! `WARREN_IDLE_GROUPS=1000 cargo test --release -p warren-cluster --test node_idle -- --ignored --nocapture`

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use warren_cluster::machine::testing::ListMachine;
use warren_cluster::node::{group_config, NodeConfig};
use warren_cluster::{ClusterNode, NodeId, RaftLogs, StateMachine};
use warren_store::{Store, StoreOptions};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// User + system CPU time of this process, from /proc/self/stat (clock ticks of 10 ms).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    ticks as f64 / 100.0
}

/// `group_config()`, or with `WARREN_IDLE_HEARTBEAT_MS` (election timeout 4-8 heartbeats) to compare.
fn raft_config() -> openraft::Config {
    if std::env::var("WARREN_IDLE_NO_TICK").is_ok() {
        return openraft::Config { enable_tick: false, ..group_config() };
    }
    match std::env::var("WARREN_IDLE_HEARTBEAT_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
        Some(hb) => openraft::Config {
            heartbeat_interval: hb,
            heartbeat_min_interval: Some(hb),
            election_timeout_min: hb * 4,
            election_timeout_max: hb * 8,
            ..group_config()
        },
        None => group_config(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn idle_cpu_of_many_groups() {
    let groups: u64 = std::env::var("WARREN_IDLE_GROUPS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let quiet = Duration::from_secs(std::env::var("WARREN_IDLE_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(20));
    let root = tempfile::tempdir().expect("tempdir");
    let ports: Vec<(NodeId, u16)> = (1..=3).map(|i| (i, free_port())).collect();
    let members: BTreeSet<NodeId> = (1..=3).collect();
    let mut nodes = Vec::new();
    for (id, port) in &ports {
        let (store, recovery) = Store::open(&root.path().join(format!("n{id}")), StoreOptions::default()).expect("store");
        let logs: Arc<RaftLogs> = RaftLogs::open(store.clone(), &recovery.queues).expect("logs");
        let node = ClusterNode::start(NodeConfig {
            node_id: *id,
            listen: format!("127.0.0.1:{port}").parse().expect("addr"),
            peers: ports.iter().map(|(i, p)| (*i, format!("127.0.0.1:{p}"))).collect(),
            secret: b"idle-test-secret".to_vec(),
            amqp_addr: String::new(),
            raft: raft_config(),
        })
        .await
        .expect("node");
        nodes.push((node, store, logs));
    }
    let started = Instant::now();
    for g in 1..=groups {
        for (node, _, logs) in &nodes {
            let sm = StateMachine::open(logs, g, ListMachine::default()).await.expect("sm");
            node.start_group(g, &members, None, logs.log_store(g).expect("ls"), sm).await.expect("group");
        }
    }
    eprintln!("{groups} groups x 3 nodes started in {:?}", started.elapsed());
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let leaderless = (1..=groups).filter(|g| nodes.iter().any(|(n, _, _)| n.leader(*g).is_none())).count();
        if leaderless == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{leaderless} groups still without a leader");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut per_node = [0usize; 3];
    for g in 1..=groups {
        if let Some(l) = nodes[0].0.leader(g) {
            per_node[l as usize - 1] += 1;
        }
    }
    eprintln!("every group has a leader after {:?}; leaders per node {per_node:?}", started.elapsed());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (c0, t0) = (cpu_seconds(), Instant::now());
    tokio::time::sleep(quiet).await;
    let cpu = (cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    eprintln!("idle: {groups} groups x 3 nodes use {:.1}% of one core ({:.1}% of the 2-core machine)", cpu * 100.0, cpu * 50.0);

    // Stop node 3 (its sockets close, as when its process is killed): how long until every group
    // it led has a leader again on nodes 1 and 2.
    let (n3, s3, _) = nodes.pop().expect("node 3");
    let stopped = Instant::now();
    n3.shutdown().await;
    let _ = s3.close();
    loop {
        let leaderless = (1..=groups)
            .filter(|g| nodes.iter().any(|(n, _, _)| !matches!(n.leader(*g), Some(l) if l != 3)))
            .count();
        if leaderless == 0 {
            break;
        }
        assert!(stopped.elapsed() < Duration::from_secs(60), "{leaderless} groups without a leader");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("failover: every group led by node 3 has a new leader {:?} after node 3 stopped", stopped.elapsed());
    for (node, store, _) in nodes {
        node.shutdown().await;
        let _ = store.close();
    }
}
