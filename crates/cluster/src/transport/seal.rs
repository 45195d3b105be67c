//! Every frame after the handshake is sealed: encrypted and authenticated with AES-256-GCM under
//! a key per direction that both sides derive from the handshake's X25519 exchange, the cluster
//! secret and its two fresh nonces (HKDF-SHA256, bound to the link kind and both node ids).
//! Whoever relays a handshake without the secret cannot derive the keys, so a frame it injects,
//! alters, replays, reorders or drops fails the next tag and the connection is closed; and as the
//! exchange's keys live only as long as the handshake, a recorded session does not open later
//! even with the secret (forward secrecy).
//!
//! ```text
//! sealed frame: len u32 (body + 16, authenticated as associated data) | encrypted body | tag[16]
//! nonce:        4 zero bytes | frame counter u64 (per direction, from 0, never sent)
//! ```

use bytes::{BufMut, BytesMut};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use hkdf::Hkdf;
use sha2::Sha256;

use super::frame::FrameError;
use super::handshake::LinkKind;
use crate::types::NodeId;

pub const TAG_LEN: usize = 16;

/// Seals the frames one side sends, in order.
pub struct Sealer {
    cipher: LessSafeKey,
    counter: u64,
}

/// Opens the frames one side receives, in order.
pub struct Opener {
    cipher: LessSafeKey,
    counter: u64,
}

/// Both directions' keys of a connection: the dialer seals with the first.
pub struct Keys {
    pub sealer: Sealer,
    pub opener: Opener,
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

/// The keys of a connection, as the dialer (`dialer` true) or the acceptor uses them. `shared` is
/// the handshake's X25519 result.
#[allow(clippy::too_many_arguments)]
pub fn derive(
    secret: &[u8],
    shared: &[u8; 32],
    kind: LinkKind,
    from: NodeId,
    to: NodeId,
    dialer_nonce: &[u8; 16],
    acceptor_nonce: &[u8; 16],
    dialer: bool,
) -> Keys {
    let mut salt = [0u8; 32];
    salt[..16].copy_from_slice(dialer_nonce);
    salt[16..].copy_from_slice(acceptor_nonce);
    let mut ikm = Vec::with_capacity(32 + secret.len());
    ikm.extend_from_slice(shared);
    ikm.extend_from_slice(secret);
    let hk = Hkdf::<Sha256>::new(Some(&salt), &ikm);
    let key = |direction: &[u8]| {
        let mut info = Vec::with_capacity(40);
        info.extend_from_slice(b"warren-cluster-v2 ");
        info.extend_from_slice(direction);
        info.push(kind as u8);
        info.extend_from_slice(&from.to_le_bytes());
        info.extend_from_slice(&to.to_le_bytes());
        let mut k = [0u8; 32];
        // 32 bytes are far below HKDF-SHA256's 8,160-byte limit: expand cannot fail.
        let _ = hk.expand(&info, &mut k);
        // A 32-byte key is what AES-256-GCM takes: `new` cannot refuse it.
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &k).expect("a 32-byte key"))
    };
    let (to_acceptor, to_dialer) = (key(b"dialer->acceptor "), key(b"acceptor->dialer "));
    if dialer {
        Keys { sealer: Sealer { cipher: to_acceptor, counter: 0 }, opener: Opener { cipher: to_dialer, counter: 0 } }
    } else {
        Keys { sealer: Sealer { cipher: to_dialer, counter: 0 }, opener: Opener { cipher: to_acceptor, counter: 0 } }
    }
}

impl Sealer {
    /// Appends `frame` (`len u32 | body`, as `frame` encodes it) to `out`, sealed.
    pub fn seal(&mut self, frame: &[u8], out: &mut BytesMut) -> Result<(), FrameError> {
        let body = frame.get(4..).ok_or(FrameError::Malformed("a frame without its length"))?;
        let len = u32::try_from(body.len() + TAG_LEN).map_err(|_| FrameError::TooLarge(body.len()))?.to_le_bytes();
        out.reserve(4 + body.len() + TAG_LEN);
        out.put_slice(&len);
        let start = out.len();
        out.put_slice(body);
        let tag = self
            .cipher
            .seal_in_place_separate_tag(nonce(self.counter), Aad::from(len), &mut out[start..])
            .map_err(|_| FrameError::Malformed("a frame too large to seal"))?;
        out.put_slice(tag.as_ref());
        self.counter += 1;
        Ok(())
    }
}

impl Opener {
    /// Opens a sealed frame's body (what followed its length) in place: the frame body it carried.
    pub fn open(&mut self, mut sealed: BytesMut) -> Result<BytesMut, FrameError> {
        let len = u32::try_from(sealed.len()).map_err(|_| FrameError::TooLarge(sealed.len()))?.to_le_bytes();
        let body_len = sealed.len().checked_sub(TAG_LEN).ok_or(FrameError::Malformed("a sealed frame shorter than its tag"))?;
        self.cipher
            .open_in_place(nonce(self.counter), Aad::from(len), &mut sealed)
            .map_err(|_| FrameError::Malformed("authentication failed (the frame was not sealed by the peer that shook hands: forged, altered, replayed or out of order)"))?;
        sealed.truncate(body_len);
        self.counter += 1;
        Ok(sealed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(secret: &[u8]) -> (Keys, Keys) {
        let (nd, na) = ([1u8; 16], [2u8; 16]);
        (derive(secret, &[9u8; 32], LinkKind::Bulk, 1, 2, &nd, &na, true), derive(b"s3cret-secret", &[9u8; 32], LinkKind::Bulk, 1, 2, &nd, &na, false))
    }

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    /// Splits `out` into the sealed frames' bodies (what `read_body` would return).
    fn bodies(mut out: BytesMut) -> Vec<BytesMut> {
        let mut v = Vec::new();
        while !out.is_empty() {
            let n = u32::from_le_bytes(out[..4].try_into().unwrap()) as usize;
            let mut f = out.split_to(4 + n);
            v.push(f.split_off(4));
        }
        v
    }

    #[test]
    fn frames_open_in_order_both_ways_and_hide_their_bytes() {
        let (mut d, mut a) = pair(b"s3cret-secret");
        let mut out = BytesMut::new();
        for body in [&b"first frame"[..], b"", &[7u8; 100_000]] {
            d.sealer.seal(&framed(body), &mut out).unwrap();
        }
        assert!(!out.windows(11).any(|w| w == b"first frame"), "the body is encrypted");
        let opened: Vec<BytesMut> = bodies(out).into_iter().map(|b| a.opener.open(b).unwrap()).collect();
        assert_eq!(opened[0], &b"first frame"[..]);
        assert_eq!(opened[1], &b""[..]);
        assert_eq!(opened[2], &[7u8; 100_000][..]);
        let mut back = BytesMut::new();
        a.sealer.seal(&framed(b"answer"), &mut back).unwrap();
        assert_eq!(d.opener.open(bodies(back).remove(0)).unwrap(), &b"answer"[..]);
    }

    #[test]
    fn forged_altered_replayed_reordered_or_reflected_frames_fail() {
        let seal_two = |d: &mut Keys| {
            let mut out = BytesMut::new();
            d.sealer.seal(&framed(b"one"), &mut out).unwrap();
            d.sealer.seal(&framed(b"two"), &mut out).unwrap();
            bodies(out)
        };
        // Without the secret (a relay): its frame fails.
        let (mut wrong, mut a) = pair(b"not-the-secret");
        assert!(a.opener.open(seal_two(&mut wrong).remove(0)).is_err());
        // One bit altered.
        let (mut d, mut a) = pair(b"s3cret-secret");
        let mut frames = seal_two(&mut d);
        frames[0][0] ^= 1;
        assert!(a.opener.open(frames.remove(0)).is_err());
        // Reordered, and replayed.
        let (mut d, mut a) = pair(b"s3cret-secret");
        let frames = seal_two(&mut d);
        assert!(a.opener.open(frames[1].clone()).is_err(), "out of order");
        let (mut d, mut a) = pair(b"s3cret-secret");
        let frames = seal_two(&mut d);
        assert!(a.opener.open(frames[0].clone()).is_ok());
        assert!(a.opener.open(frames[0].clone()).is_err(), "replayed");
        // A dialer's frame reflected back to the dialer.
        let (mut d, _) = pair(b"s3cret-secret");
        let frames = seal_two(&mut d);
        assert!(d.opener.open(frames[0].clone()).is_err());
        // Truncated below the tag.
        let (_, mut a) = pair(b"s3cret-secret");
        assert!(a.opener.open(BytesMut::from(&b"short"[..])).is_err());
    }
}
