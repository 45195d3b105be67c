//! The start of every cluster connection: who is calling whom, for which link, and proof on both
//! sides that they know the cluster secret (never sent: each side returns an HMAC-SHA256 of both
//! sides' random nonces, as a challenge-response). A peer that claims an id other than the one the
//! dialer meant to reach, an id outside the cluster, or that cannot prove the secret is refused.
//!
//! ```text
//! dialer   -> Hello     magic "WARRENC2" | kind u8 | from u64 | to u64 | amqp addr | nonce[16] | x25519 public[32]
//! acceptor -> Challenge magic | id u64 | amqp addr | nonce[16] | x25519 public[32] | mac("A")
//! dialer   -> Proof     mac("D")
//! acceptor -> Welcome   1
//! mac(side) = HMAC-SHA256(secret, side | kind | from | to | dialer nonce | acceptor nonce
//!                         | dialer public | acceptor public)
//! ```
//! Each message is a frame (`u32` length, body) of at most 4 KiB; the whole exchange must finish
//! within [`HANDSHAKE_TIMEOUT`]. Both sides then derive the connection's keys from the secret, both
//! nonces and an X25519 exchange of keys made for this connection alone (the macs cover the public
//! halves, so a relay cannot swap them; a recorded session does not open with the secret later):
//! every later frame is sealed (`seal`). Version 1 (`WARRENC1`, frames in the clear)
//! and version 2 do not talk: a v1 node's Hello is refused as not a Warren cluster connection.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::frame::{read_body, FrameError};
use super::seal::{self, Keys};
use super::wire::{Dec, DecodeError, Enc};
use crate::types::NodeId;

const MAGIC: &[u8; 8] = b"WARRENC2";
const LIMIT: usize = 4096;
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a connection carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkKind {
    /// Votes, heartbeats and the failure detector's pings: kept free of bulk data.
    Control = 0,
    /// Log replication, snapshots and forwarded commands.
    Bulk = 1,
    /// `warren ctl`: status and operations; the caller is not a node.
    Ctl = 2,
}

impl LinkKind {
    fn from_u8(v: u8) -> Option<LinkKind> {
        match v {
            0 => Some(LinkKind::Control),
            1 => Some(LinkKind::Bulk),
            2 => Some(LinkKind::Ctl),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{0}")]
    Frame(#[from] FrameError),
    #[error("malformed handshake: {0}")]
    Decode(#[from] DecodeError),
    #[error("not a Warren cluster connection")]
    BadMagic,
    #[error("unknown link kind {0}")]
    BadKind(u8),
    #[error("the peer does not know the cluster secret")]
    BadSecret,
    #[error("refused: {0}")]
    Refused(String),
    #[error("handshake timed out")]
    Timeout,
}

/// What the acceptor learned about the dialer.
#[derive(Debug, Clone)]
pub struct Dialer {
    pub kind: LinkKind,
    /// 0 for `warren ctl`.
    pub node: NodeId,
    pub amqp_addr: String,
}

fn hmac(secret: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut key = [0u8; 64];
    if secret.len() > 64 {
        key[..32].copy_from_slice(&Sha256::digest(secret));
    } else {
        key[..secret.len()].copy_from_slice(secret);
    }
    let mut inner = Sha256::new();
    inner.update(key.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(key.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// What both macs and the keys are bound to: the link, both ids, both nonces, both public keys.
struct Transcript {
    kind: LinkKind,
    from: NodeId,
    to: NodeId,
    nd: [u8; 16],
    na: [u8; 16],
    ed: [u8; 32],
    ea: [u8; 32],
}

impl Transcript {
    fn mac(&self, secret: &[u8], side: u8) -> [u8; 32] {
        let t = self;
        hmac(secret, &[&[side, t.kind as u8], &t.from.to_le_bytes(), &t.to.to_le_bytes(), &t.nd, &t.na, &t.ed, &t.ea])
    }

    /// The connection's keys, once the macs proved the secret both ways. `mine` is this side's
    /// ephemeral secret; `theirs` the other side's public key.
    fn keys(&self, secret: &[u8], mine: &Ephemeral, theirs: &[u8; 32], dialer: bool) -> Result<Keys, HandshakeError> {
        let shared = x25519_dalek::x25519(mine.0, *theirs);
        // A low-order public key gives an all-zero secret: only a peer that knows the cluster
        // secret (the macs passed) could send one, but it would add nothing to the keys.
        if same(&shared, &[0u8; 32]) {
            return Err(HandshakeError::Refused("a degenerate key exchange".into()));
        }
        Ok(seal::derive(secret, &shared, self.kind, self.from, self.to, &self.nd, &self.na, dialer))
    }
}

/// A connection's X25519 secret, made for it alone and dropped with the handshake.
struct Ephemeral([u8; 32]);

impl Ephemeral {
    fn new() -> Ephemeral {
        Ephemeral(rand::random())
    }

    fn public(&self) -> [u8; 32] {
        x25519_dalek::x25519(self.0, x25519_dalek::X25519_BASEPOINT_BYTES)
    }
}

/// Compares without an early exit, so timing says nothing about where a guess went wrong.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A frame: `u32` length, body.
fn framed(body: &[u8]) -> BytesMut {
    let mut b = BytesMut::with_capacity(4 + body.len());
    b.put_u32_le(body.len() as u32);
    b.put_slice(body);
    b
}

async fn send<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> Result<(), HandshakeError> {
    w.write_all(&framed(body)).await.map_err(FrameError::Io)?;
    Ok(())
}

/// The dialer's Hello (see the module docs).
fn hello(kind: LinkKind, from: NodeId, to: NodeId, amqp_addr: &str, nonce: &[u8; 16], public: &[u8; 32]) -> BytesMut {
    let mut hello = BytesMut::new();
    let mut e = Enc(&mut hello);
    e.0.put_slice(MAGIC);
    e.u8(kind as u8);
    e.u64(from);
    e.u64(to);
    e.str(amqp_addr);
    e.0.put_slice(nonce);
    e.0.put_slice(public);
    hello
}

async fn recv<R: AsyncRead + Unpin>(r: &mut R) -> Result<Dec, HandshakeError> {
    Ok(Dec::new(read_body(r, LIMIT, HANDSHAKE_TIMEOUT, HANDSHAKE_TIMEOUT).await?))
}

fn nonce() -> [u8; 16] {
    rand::random()
}

/// The magic (8 bytes), a nonce (16) or a mac (32).
fn read_array<const N: usize>(d: &mut Dec) -> Result<[u8; N], DecodeError> {
    let mut a = [0u8; N];
    for b in &mut a {
        *b = d.u8()?;
    }
    Ok(a)
}

/// The dialer's side. Returns the acceptor's AMQP address and the connection's keys.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &[u8],
    kind: LinkKind,
    from: NodeId,
    to: NodeId,
    amqp_addr: &str,
) -> Result<(String, Keys), HandshakeError> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let nd = nonce();
        let mine = Ephemeral::new();
        let ed = mine.public();
        send(s, &hello(kind, from, to, amqp_addr, &nd, &ed)).await?;

        let mut d = recv(s).await?;
        if read_array::<8>(&mut d).ok() != Some(*MAGIC) {
            return Err(HandshakeError::BadMagic);
        }
        let id = d.u64()?;
        let peer_amqp = d.string()?;
        let na = read_array::<16>(&mut d)?;
        let ea = read_array::<32>(&mut d)?;
        let their = read_array::<32>(&mut d)?;
        d.finish()?;
        let t = Transcript { kind, from, to, nd, na, ed, ea };
        if !same(&their, &t.mac(secret, b'A')) {
            return Err(HandshakeError::BadSecret);
        }
        if to != 0 && id != to {
            return Err(HandshakeError::Refused(format!("reached node {id}, expected node {to}")));
        }
        let keys = t.keys(secret, &mine, &ea, true)?;
        send(s, &t.mac(secret, b'D')).await?;
        let mut d = recv(s).await?;
        if d.u8()? != 1 {
            return Err(HandshakeError::Refused("not welcomed".into()));
        }
        d.finish()?;
        Ok((peer_amqp, keys))
    })
    .await
    .map_err(|_| HandshakeError::Timeout)?
}

/// The acceptor's side. `allow` decides whether a node id may connect for a kind of link.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &[u8],
    me: NodeId,
    amqp_addr: &str,
    allow: impl Fn(LinkKind, NodeId) -> Result<(), String>,
) -> Result<(Dialer, Keys), HandshakeError> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let mut d = recv(s).await?;
        if read_array::<8>(&mut d).ok() != Some(*MAGIC) {
            return Err(HandshakeError::BadMagic);
        }
        let kind_byte = d.u8()?;
        let kind = LinkKind::from_u8(kind_byte).ok_or(HandshakeError::BadKind(kind_byte))?;
        let from = d.u64()?;
        let to = d.u64()?;
        let dialer_amqp = d.string()?;
        let nd = read_array::<16>(&mut d)?;
        let ed = read_array::<32>(&mut d)?;
        d.finish()?;
        if to != 0 && to != me {
            return Err(HandshakeError::Refused(format!("dialer expected node {to}, this is node {me}")));
        }
        allow(kind, from).map_err(HandshakeError::Refused)?;

        let na = nonce();
        let mine = Ephemeral::new();
        let t = Transcript { kind, from, to, nd, na, ed, ea: mine.public() };
        let mut ch = BytesMut::new();
        let mut e = Enc(&mut ch);
        e.0.put_slice(MAGIC);
        e.u64(me);
        e.str(amqp_addr);
        e.0.put_slice(&na);
        e.0.put_slice(&t.ea);
        e.0.put_slice(&t.mac(secret, b'A'));
        send(s, &ch).await?;

        let mut d = recv(s).await?;
        let their = read_array::<32>(&mut d)?;
        d.finish()?;
        if !same(&their, &t.mac(secret, b'D')) {
            return Err(HandshakeError::BadSecret);
        }
        let keys = t.keys(secret, &mine, &ed, false)?;
        send(s, &[1]).await?;
        Ok((Dialer { kind, node: from, amqp_addr: dialer_amqp }, keys))
    })
    .await
    .map_err(|_| HandshakeError::Timeout)?
}

/// Used by tests: the bytes of a valid Hello, to send garbage after it.
#[doc(hidden)]
pub fn hello_bytes(kind: LinkKind, from: NodeId, to: NodeId) -> Bytes {
    framed(&hello(kind, from, to, "", &[0u8; 16], &Ephemeral::new().public())).freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        let m = hmac(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        let hex: String = m.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[tokio::test]
    async fn both_sides_must_know_the_secret_and_the_ids() {
        async fn run(dial_secret: &'static [u8], to: NodeId) -> (Result<String, HandshakeError>, Result<Dialer, HandshakeError>) {
            let (d, a) = run_keys(dial_secret, to).await;
            (d.map(|(amqp, _)| amqp), a.map(|(dialer, _)| dialer))
        }
        async fn run_keys(dial_secret: &'static [u8], to: NodeId) -> (Result<(String, Keys), HandshakeError>, Result<(Dialer, Keys), HandshakeError>) {
            let (mut a, mut b) = tokio::io::duplex(8192);
            let acceptor = tokio::spawn(async move {
                accept(&mut b, b"s3cret", 2, "amqp-2", |kind, from| {
                    if kind == LinkKind::Ctl || from == 1 { Ok(()) } else { Err(format!("node {from} is not a peer")) }
                })
                .await
            });
            let d = dial(&mut a, dial_secret, LinkKind::Bulk, 1, to, "amqp-1").await;
            drop(a);
            (d, acceptor.await.expect("acceptor task"))
        }
        let (d, a) = run_keys(b"s3cret", 2).await;
        let (amqp, mut dialer_keys) = d.expect("dial ok");
        let (a, mut acceptor_keys) = a.expect("accept ok");
        assert_eq!(amqp, "amqp-2");
        // Both sides derived the same keys, one per direction.
        let mut out = BytesMut::new();
        dialer_keys.sealer.seal(&framed(b"sealed"), &mut out).expect("seal");
        assert_eq!(acceptor_keys.opener.open(out.split_off(4)).expect("open"), &b"sealed"[..]);
        assert_eq!((a.kind, a.node, a.amqp_addr.as_str()), (LinkKind::Bulk, 1, "amqp-1"));
        let (d, a) = run(b"wrong", 2).await;
        assert!(matches!(d, Err(HandshakeError::BadSecret)), "{d:?}");
        assert!(a.is_err());
        let (d, a) = run(b"s3cret", 3).await;
        assert!(d.is_err() && matches!(a, Err(HandshakeError::Refused(_))), "{d:?} {a:?}");
    }
}
