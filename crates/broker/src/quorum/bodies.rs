//! The bodies a replica fetches from a peer after installing a snapshot (snapshots carry no
//! bodies): the request and the answer of the cluster's body-fetch RPC, in Warren's versioned
//! binary encoding. The broker owns the format; the cluster only carries the bytes. Decoding never
//! panics: anything malformed (from a peer) is an error.
//!
//! A request asks for the stored records of msg ids in `[from, until)`, at most `max_bytes` of
//! payload. The answer holds records in increasing id order, `next` (where the next request
//! starts), and `complete`: the peer has applied the log up to `until` and has no record left in
//! the range (anything live there that it did not send left the queue on the peer, so it leaves
//! here too when the later entries apply).

use bytes::{BufMut, Bytes, BytesMut};

use super::codec::{err, put_var, DecodeError, Reader};
use super::MsgId;

const VERSION: u8 = 1;

/// At most this much payload in one answer, whatever the request asks.
pub const MAX_ANSWER_BYTES: usize = 8 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodiesRequest {
    pub from: MsgId,
    pub until: MsgId,
    pub max_bytes: u32,
}

impl BodiesRequest {
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(24);
        out.put_u8(VERSION);
        put_var(&mut out, self.from);
        put_var(&mut out, self.until);
        put_var(&mut out, self.max_bytes as u64);
        out.freeze()
    }

    pub fn decode(buf: &[u8]) -> Result<BodiesRequest, DecodeError> {
        let mut r = Reader::new(buf);
        let version = r.u8()?;
        if version != VERSION {
            return err(format!("unknown bodies request version {version}"));
        }
        let from = r.var()?;
        let until = r.var()?;
        let max_bytes = r.var_u32()?;
        r.end()?;
        Ok(BodiesRequest { from, until, max_bytes })
    }
}

/// One stored record: the message's store encoding (as an Enqueue command carries it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyRecord {
    pub msg_id: MsgId,
    pub timestamp_ms: u64,
    pub payload: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BodiesAnswer {
    pub records: Vec<BodyRecord>,
    pub next: MsgId,
    pub complete: bool,
}

impl BodiesAnswer {
    pub fn encode(&self) -> Bytes {
        let len: usize = self.records.iter().map(|r| r.payload.len() + 24).sum();
        let mut out = BytesMut::with_capacity(len + 24);
        out.put_u8(VERSION);
        out.put_u8(self.complete as u8);
        put_var(&mut out, self.next);
        put_var(&mut out, self.records.len() as u64);
        for r in &self.records {
            put_var(&mut out, r.msg_id);
            put_var(&mut out, r.timestamp_ms);
            put_var(&mut out, r.payload.len() as u64);
            out.put_slice(&r.payload);
        }
        out.freeze()
    }

    /// Decodes an answer; its records must rise strictly and lie in `[request.from, request.until)`,
    /// and `next` must not go backwards.
    pub fn decode(buf: &Bytes, request: &BodiesRequest) -> Result<BodiesAnswer, DecodeError> {
        let mut r = Reader::new(buf);
        let version = r.u8()?;
        if version != VERSION {
            return err(format!("unknown bodies answer version {version}"));
        }
        let complete = match r.u8()? {
            0 => false,
            1 => true,
            v => return err(format!("bad complete flag {v}")),
        };
        let next = r.var()?;
        let n = r.count(3)?;
        let mut records = Vec::with_capacity(n);
        let mut last: Option<MsgId> = None;
        for _ in 0..n {
            let msg_id = r.var()?;
            let timestamp_ms = r.var()?;
            let len = r.var()?;
            let len = usize::try_from(len).map_err(|_| DecodeError(format!("record length {len}")))?;
            let start = r.pos();
            r.bytes(len)?;
            if msg_id < request.from || msg_id >= request.until || last.is_some_and(|l| msg_id <= l) {
                return err(format!("record {msg_id} out of order or outside [{}, {})", request.from, request.until));
            }
            last = Some(msg_id);
            records.push(BodyRecord { msg_id, timestamp_ms, payload: buf.slice(start..start + len) });
        }
        r.end()?;
        if next < request.from || last.is_some_and(|l| next <= l) {
            return err(format!("next {next} goes backwards"));
        }
        Ok(BodiesAnswer { records, next, complete })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_round_trip_and_garbage_is_an_error() {
        let req = BodiesRequest { from: 5 << 16, until: 900 << 16, max_bytes: 4 << 20 };
        assert_eq!(BodiesRequest::decode(&req.encode()).unwrap(), req);
        let answer = BodiesAnswer {
            records: vec![
                BodyRecord { msg_id: 5 << 16, timestamp_ms: 7, payload: Bytes::from_static(b"one") },
                BodyRecord { msg_id: (6 << 16) | 1, timestamp_ms: 8, payload: Bytes::from_static(b"") },
            ],
            next: (6 << 16) | 2,
            complete: true,
        };
        let bytes = answer.encode();
        assert_eq!(BodiesAnswer::decode(&bytes, &req).unwrap(), answer);
        // Every truncation and every single-byte change decodes to an error or to some answer, never a panic.
        for cut in 0..bytes.len() {
            assert!(BodiesAnswer::decode(&bytes.slice(..cut), &req).is_err());
        }
        for i in 0..bytes.len() {
            let mut b = bytes.to_vec();
            b[i] ^= 0xff;
            let _ = BodiesAnswer::decode(&Bytes::from(b), &req);
        }
        // Records outside the range asked for, or out of order, are refused.
        let narrow = BodiesRequest { from: 6 << 16, ..req };
        assert!(BodiesAnswer::decode(&bytes, &narrow).is_err());
        let swapped = BodiesAnswer { records: answer.records.iter().rev().cloned().collect(), ..answer.clone() };
        assert!(BodiesAnswer::decode(&swapped.encode(), &req).is_err());
        assert!(BodiesRequest::decode(b"\x02\x00\x00\x00").is_err());
    }
}
