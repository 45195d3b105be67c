//! The cluster transport over real sockets: requests both ways on both links, the handshake's
//! refusals, and peers that send garbage, oversized frames or the wrong secret (each connection is
//! dropped, the node keeps serving, and links come back by themselves).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use warren_cluster::transport::handshake::{self, LinkKind};
use warren_cluster::transport::{frame, BoxFuture, Handler, Rpc, RpcError, Transport, TransportConfig};
use warren_cluster::{GroupId, NodeId};

/// Answers every request with "node <id>: <group>: <payload>".
struct Echo(NodeId);

impl Handler for Echo {
    fn handle(&self, from: NodeId, _rpc: Rpc, group: GroupId, payload: Bytes) -> BoxFuture<Result<Bytes, String>> {
        let me = self.0;
        Box::pin(async move {
            if payload.as_ref() == b"fail" {
                return Err(format!("node {me} refuses"));
            }
            Ok(Bytes::from(format!("node {me} from {from} group {group}: {}", String::from_utf8_lossy(&payload))))
        })
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

async fn start(id: NodeId, ports: &[(NodeId, u16)], secret: &str) -> Transport {
    let listen = format!("127.0.0.1:{}", ports.iter().find(|(i, _)| *i == id).expect("own port").1);
    let t = Transport::start(TransportConfig {
        node_id: id,
        listen: listen.parse().expect("addr"),
        peers: ports.iter().map(|(i, p)| (*i, format!("127.0.0.1:{p}"))).collect(),
        secret: secret.as_bytes().to_vec(),
        amqp_addr: format!("amqp-{id}"),
    })
    .await
    .expect("transport starts");
    t.set_handler(Arc::new(Echo(id)));
    t
}

async fn wait_connected(a: &Transport, peer: NodeId, within: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if a.connected(peer, LinkKind::Control) && a.connected(peer, LinkKind::Bulk) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

const T: Duration = Duration::from_secs(5);

#[tokio::test]
async fn requests_go_both_ways_on_both_links() {
    let ports = [(1, free_port()), (2, free_port())];
    let a = start(1, &ports, "cluster-secret").await;
    let b = start(2, &ports, "cluster-secret").await;
    assert!(wait_connected(&a, 2, T).await && wait_connected(&b, 1, T).await, "links come up");
    for kind in [LinkKind::Control, LinkKind::Bulk] {
        let r = a.request(2, kind, Rpc::Propose, 7, b"hi", T).await.expect("1 -> 2");
        assert_eq!(&r[..], b"node 2 from 1 group 7: hi");
        let r = b.request(1, kind, Rpc::Vote, 9, b"yo", T).await.expect("2 -> 1 on the connection 1 dialed");
        assert_eq!(&r[..], b"node 1 from 2 group 9: yo");
    }
    let e = a.request(2, LinkKind::Bulk, Rpc::Propose, 1, b"fail", T).await.expect_err("remote error");
    assert_eq!(e, RpcError::Remote(2, "node 2 refuses".into()));
    assert_eq!(b.peer_addrs(1).expect("peer").1, "amqp-1", "the handshake carries the AMQP address");
    // Many concurrent requests are multiplexed on one connection.
    let mut calls = Vec::new();
    for i in 0..500u64 {
        let a = a.clone();
        calls.push(tokio::spawn(async move { a.request(2, LinkKind::Bulk, Rpc::Propose, i, b"x", T).await }));
    }
    for (i, c) in calls.into_iter().enumerate() {
        let r = c.await.expect("task").expect("answer");
        assert_eq!(r, Bytes::from(format!("node 2 from 1 group {i}: x")));
    }
    // Small and large frames mixed on one connection, both ways (a large one is written from its own
    // buffer, a piece at a time as the socket takes it; small ones are copied together): each
    // arrives whole and in its place.
    let mut calls = Vec::new();
    for i in 0..100u64 {
        let a = a.clone();
        let len = match i % 4 {
            0 => 3,
            1 => 20 << 10,
            2 => 700,
            _ => (1 << 20) + i as usize,
        };
        let body: Vec<u8> = (0..len).map(|j| b'a' + ((j as u64 + i) % 26) as u8).collect();
        calls.push(tokio::spawn(async move { (a.request(2, LinkKind::Bulk, Rpc::Propose, i, &body, T).await, body) }));
    }
    for (i, c) in calls.into_iter().enumerate() {
        let (r, body) = c.await.expect("task");
        let want = format!("node 2 from 1 group {i}: {}", String::from_utf8_lossy(&body));
        assert!(r.expect("answer") == want.as_bytes(), "request {i} of {} bytes came back changed", body.len());
    }
    a.shutdown();
    b.shutdown();
}

#[tokio::test]
async fn a_node_with_the_wrong_secret_never_connects() {
    let ports = [(1, free_port()), (2, free_port())];
    let a = start(1, &ports, "cluster-secret").await;
    let b = start(2, &ports, "another-secret").await;
    assert!(!wait_connected(&a, 2, Duration::from_millis(800)).await);
    let e = a.request(2, LinkKind::Control, Rpc::Ping, 0, b"", T).await.expect_err("not connected");
    assert_eq!(e, RpcError::NotConnected(2));
    a.shutdown();
    b.shutdown();
}

/// Reads until the server closes the connection; errors if it stays open for `within`.
async fn closed_by_server(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test]
async fn garbage_oversized_and_malformed_frames_close_only_that_connection() {
    let ports = [(1, free_port()), (2, free_port())];
    let a = start(1, &ports, "cluster-secret").await;
    let b = start(2, &ports, "cluster-secret").await;
    assert!(wait_connected(&a, 2, T).await);
    let addr = format!("127.0.0.1:{}", ports[1].1);

    // Garbage instead of a handshake.
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    s.write_all(&[0xff; 64]).await.expect("write");
    assert!(closed_by_server(&mut s, T).await, "garbage handshake closes the connection");

    // A handshake frame claiming 4 GiB.
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    s.write_all(&u32::MAX.to_le_bytes()).await.expect("write");
    assert!(closed_by_server(&mut s, T).await, "oversized handshake frame closes the connection");

    // The right magic but a node id outside the dialing rule (node 3 > node 2 would be dialed, not dial).
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    s.write_all(&handshake::hello_bytes(LinkKind::Bulk, 3, 2)).await.expect("write");
    assert!(closed_by_server(&mut s, T).await, "a peer breaking the dialing rule is refused");

    // A peer that claims node 1 and knows the secret, then sends an oversized frame.
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    handshake::dial(&mut s, b"cluster-secret", LinkKind::Bulk, 1, 2, "").await.expect("handshake");
    let mut big = BytesMut::new();
    big.put_u32_le((frame::MAX_FRAME + 1) as u32);
    s.write_all(&big).await.expect("write");
    assert!(closed_by_server(&mut s, T).await, "an oversized frame closes the connection");

    // And one that sends a malformed frame, sealed (it passes its tag, then fails to parse).
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    let (_, mut keys) = handshake::dial(&mut s, b"cluster-secret", LinkKind::Bulk, 1, 2, "").await.expect("handshake");
    let mut out = BytesMut::new();
    keys.sealer.seal(&[3, 0, 0, 0, 9, 9, 9], &mut out).expect("seal");
    s.write_all(&out).await.expect("write");
    assert!(closed_by_server(&mut s, T).await, "a malformed frame closes the connection");

    // A well-formed frame that is not sealed (the first version's frames in the clear).
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    handshake::dial(&mut s, b"cluster-secret", LinkKind::Bulk, 1, 2, "").await.expect("handshake");
    s.write_all(&frame::request(1, Rpc::Propose, 1, b"in the clear")).await.expect("write");
    assert!(closed_by_server(&mut s, T).await, "a frame that is not sealed closes the connection");

    // A ctl connection asking for an unknown rpc number.
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    let (_, mut keys) = handshake::dial(&mut s, b"cluster-secret", LinkKind::Ctl, 0, 0, "").await.expect("ctl handshake");
    let mut bad = frame::request(1, Rpc::Status, 0, b"").to_vec();
    bad[4 + 9] = 200;
    let mut out = BytesMut::new();
    keys.sealer.seal(&bad, &mut out).expect("seal");
    s.write_all(&out).await.expect("write");
    assert!(closed_by_server(&mut s, T).await, "an unknown rpc closes the connection");

    // The real node 1 was displaced by the impostors; it reconnects and is served again.
    assert!(wait_connected(&a, 2, T).await, "node 1 reconnects");
    let deadline = Instant::now() + T;
    loop {
        match a.request(2, LinkKind::Bulk, Rpc::Propose, 1, b"still there", T).await {
            Ok(r) => {
                assert_eq!(&r[..], b"node 2 from 1 group 1: still there");
                break;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("node 2 stopped serving: {e}"),
        }
    }
    a.shutdown();
    b.shutdown();
}

#[tokio::test]
async fn a_peer_that_stops_is_noticed_and_comes_back() {
    let ports = [(1, free_port()), (2, free_port())];
    let a = start(1, &ports, "cluster-secret").await;
    let b = start(2, &ports, "cluster-secret").await;
    assert!(wait_connected(&a, 2, T).await);
    b.shutdown();
    drop(b);
    let start_wait = Instant::now();
    while a.connected(2, LinkKind::Control) && start_wait.elapsed() < T {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!a.connected(2, LinkKind::Control), "the closed link is noticed");
    // Node 2 restarts on the same port.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let b = start(2, &ports, "cluster-secret").await;
    assert!(wait_connected(&a, 2, T).await, "node 1 redials with backoff");
    a.request(2, LinkKind::Control, Rpc::Ping, 0, b"", T).await.expect("ping after restart");
    a.shutdown();
    b.shutdown();
}

#[tokio::test]
async fn ctl_requests_need_the_secret() {
    let ports = [(1, free_port())];
    let a = start(1, &ports, "cluster-secret").await;
    let addr = format!("127.0.0.1:{}", ports[0].1);
    let r = warren_cluster::transport::ctl_request(&addr, b"cluster-secret", Rpc::Status, 0, b"q", T).await.expect("ctl");
    assert_eq!(&r[..], b"node 1 from 0 group 0: q");
    let e = warren_cluster::transport::ctl_request(&addr, b"wrong-secret", Rpc::Status, 0, b"q", T).await.expect_err("refused");
    assert!(e.contains("secret"), "{e}");
    a.shutdown();
}

/// Remembers every request payload it is asked to handle.
struct Record(parking_lot::Mutex<Vec<Bytes>>);

struct Recording(Arc<Record>);

impl Handler for Recording {
    fn handle(&self, _from: NodeId, _rpc: Rpc, _group: GroupId, payload: Bytes) -> BoxFuture<Result<Bytes, String>> {
        self.0 .0.lock().push(payload.clone());
        Box::pin(async move { Ok(payload) })
    }
}

/// A man in the middle: node 1 reaches node 2 through a relay that forwards both ways (the
/// handshake included, which it cannot fake without the secret), then injects a frame of its own
/// toward node 2. Node 2 must not handle it: the frame fails its tag and node 2 drops that
/// connection. Before frames were sealed, node 2 handled whatever a relay injected after the
/// handshake (a Propose to any group, an Admin request).
#[tokio::test]
async fn a_relay_that_injects_a_frame_after_the_handshake_is_cut_off() {
    let (p1, p2) = (free_port(), free_port());
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
    let relay_port = relay.local_addr().expect("addr").port();
    let node2 = start(2, &[(1, p1), (2, p2)], "cluster-secret").await;
    let record = Arc::new(Record(parking_lot::Mutex::new(Vec::new())));
    node2.set_handler(Arc::new(Recording(record.clone())));
    // Node 1 believes node 2 is at the relay.
    let node1 = start(1, &[(1, p1), (2, relay_port)], "cluster-secret").await;

    let upstreams: Arc<parking_lot::Mutex<Vec<Arc<tokio::sync::Mutex<tokio::net::tcp::OwnedWriteHalf>>>>> = Default::default();
    let cut_off = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let (upstreams, cut_off) = (upstreams.clone(), cut_off.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = relay.accept().await else { return };
                let Ok(up) = TcpStream::connect(("127.0.0.1", p2)).await else { return };
                let (mut cr, mut cw) = client.into_split();
                let (mut ur, uw) = up.into_split();
                let uw = Arc::new(tokio::sync::Mutex::new(uw));
                upstreams.lock().push(uw.clone());
                let cut_off = cut_off.clone();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut ur, &mut cw).await;
                    // Node 2 closed its side.
                    cut_off.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                });
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if uw.lock().await.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
    }
    assert!(wait_connected(&node1, 2, T).await, "node 1 reaches node 2 through the relay");
    let answer = node1.request(2, LinkKind::Bulk, Rpc::Propose, 1, b"through the relay", T).await.expect("a request through the relay");
    assert_eq!(answer.as_ref(), b"through the relay");

    // The relay injects a request of its own on every link it carries.
    let links = upstreams.lock().clone();
    assert!(links.len() >= 2, "both links go through the relay");
    for uw in &links {
        let _ = uw.lock().await.write_all(&frame::request(7_777, Rpc::Propose, 1, b"injected")).await;
    }
    let deadline = Instant::now() + T;
    while cut_off.load(std::sync::atomic::Ordering::SeqCst) < links.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(cut_off.load(std::sync::atomic::Ordering::SeqCst) >= links.len(), "node 2 drops every connection a frame was injected on");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!record.0.lock().iter().any(|p| p.as_ref() == b"injected"), "node 2 never handled the injected frame");
    assert!(record.0.lock().iter().any(|p| p.as_ref() == b"through the relay"));
}

/// One address holding many silent handshakes takes only its share of the slots: a peer from
/// another address still connects at once (before, 64 silent connections from anywhere filled every
/// slot, and the peer's dials were closed until the handshake timeout freed them).
#[tokio::test]
async fn silent_handshakes_from_one_address_do_not_lock_a_peer_out() {
    let ports = [(1, free_port()), (2, free_port())];
    let b = start(2, &ports, "cluster-secret").await;
    let mut silent = Vec::new();
    for _ in 0..100 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.bind("127.0.0.2:0".parse().expect("addr")).expect("bind 127.0.0.2");
        silent.push(socket.connect(format!("127.0.0.1:{}", ports[1].1).parse().expect("addr")).await.expect("connect"));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let a = start(1, &ports, "cluster-secret").await;
    assert!(wait_connected(&a, 2, Duration::from_secs(2)).await, "the peer connects while the silent ones wait");
    // Past its share and the waiting bound, the silent address's later connections are closed.
    let mut closed = 0;
    for s in &mut silent {
        if closed_by_server(s, Duration::from_millis(10)).await {
            closed += 1;
        }
    }
    assert!(closed > 0, "100 silent connections from one address: 16 take slots, 64 wait, the rest are closed at once");
    a.shutdown();
    b.shutdown();
}
