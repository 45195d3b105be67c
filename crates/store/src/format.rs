//! The on-disk format of the shared message log, and what is trusted after a crash.
//!
//! # Files
//! The log is a directory of segment files named `NNNNNNNNNNNNNNNNNNNN.wlog`: the 20-digit number is the
//! segment's *base*, its first byte's position in the endless logical log (the previous segment's base plus
//! its length). Sorting names sorts segments; a [`SyncTicket`](crate::SyncTicket) is a position in the same
//! logical log. A `LOCK` file (held with `flock`) keeps a second process out.
//!
//! # Segment header ([`HEADER_SIZE`] bytes, little endian)
//! ```text
//! 0  magic "WRNL"   4  version u16   6  header_size u16   8  first_id u64   16  reserved (zero) 12 bytes
//! 28 crc32c u32 over bytes 0..28
//! ```
//! `first_id` is the next `MsgId` at the moment the segment was created: every enqueue in the segment has
//! an id `>= first_id`. It is what keeps ids unique forever when every older segment has been deleted.
//!
//! # Records (after the header, back to back)
//! ```text
//! len: u32 | crc32c: u32 (over the body) | body (len bytes)
//! body = KIND_ENQUEUE u8 | id u64 | queue u64 | payload (len - 17 bytes)
//!      | KIND_ACKS    u8 | count u32 | count x id u64          (all acks of one appended batch)
//! ```
//! Ids of enqueues are strictly increasing through the whole log. An ack always comes after the enqueue it
//! refers to (the id only exists once the enqueue was appended), so it is in the same or a later segment.
//!
//! # Crash behaviour: what recovery trusts
//! Files are only appended to (`write` then `fdatasync`), never preallocated or rewritten in place, so after
//! a crash a segment holds a prefix of what was written plus, at most, a torn or garbled tail. Nothing but
//! the segment files is trusted: there is no index or summary file that could be stale.
//! - A record is accepted only if its header is complete, `len` fits in the file and is at most
//!   [`MAX_BODY_LEN`], the CRC32C of the body matches, the kind is known, the body is well formed and an
//!   enqueue's id is above every id before it.
//! - **Newest segment**: the first record that fails these checks, and everything after it, is a torn tail
//!   from the crash (a write that was never fsynced, so never confirmed). The file is truncated to the last
//!   valid record and the loss logged with `tracing::warn!`. A corrupt record in the middle of the newest
//!   segment cannot be told apart from a torn write, so the valid records after it are dropped too. If even
//!   the header is incomplete or garbled (a crash right after the roll created the file), the file is removed.
//! - **Older segments** were fsynced before the next one was created, so a bad record there is real
//!   corruption: the records before it are kept, the rest of that segment is skipped (`tracing::error!`),
//!   the node still starts, and the file is left as it is until it is deleted like any other segment.
//! - A header with a good checksum but an unknown version was written by a newer Warren: opening fails
//!   rather than treating the data as damage.

use thiserror::Error;

/// First bytes of every segment file.
pub const MAGIC: [u8; 4] = *b"WRNL";
/// Format version written by this code; the only one it reads.
pub const VERSION: u16 = 1;
/// Bytes of the segment header, records start right after it.
pub const HEADER_SIZE: usize = 32;
/// `len: u32 | crc32c: u32` in front of every record body.
pub const RECORD_HEADER_SIZE: usize = 8;
/// Largest record body accepted; larger lengths on disk are garbage.
pub const MAX_BODY_LEN: usize = 1 << 30;
/// Body kind: one message put into a queue.
pub const KIND_ENQUEUE: u8 = 1;
/// Body kind: the messages of one batch that are gone.
pub const KIND_ACKS: u8 = 2;
/// Enqueue body bytes before the payload: kind, id, queue.
pub const ENQUEUE_FIXED_LEN: usize = 1 + 8 + 8;
/// Acks body bytes before the ids: kind, count.
pub const ACKS_FIXED_LEN: usize = 1 + 4;
/// Most ids one acks record holds (keeps the body under [`MAX_BODY_LEN`]).
pub const MAX_ACKS_PER_RECORD: usize = (MAX_BODY_LEN - ACKS_FIXED_LEN) / 8;
/// File name extension of segments.
pub const SEGMENT_EXT: &str = "wlog";

/// Why bytes read back from a segment were not accepted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Damage {
    #[error("segment header incomplete: {have} of {HEADER_SIZE} bytes")]
    HeaderTruncated { have: usize },
    #[error("bad magic {found:02x?}")]
    BadMagic { found: [u8; 4] },
    #[error("segment header checksum mismatch")]
    HeaderChecksum,
    #[error("header size {size} does not match version {version}")]
    BadHeaderSize { version: u16, size: u16 },
    #[error("unsupported format version {version} (this build reads {VERSION})")]
    UnsupportedVersion { version: u16 },
    #[error("record header incomplete: {have} of {RECORD_HEADER_SIZE} bytes")]
    RecordHeaderTruncated { have: usize },
    #[error("record length {len} is larger than the {MAX_BODY_LEN} limit")]
    LengthTooLarge { len: usize },
    #[error("record length {len} runs past the end of the file ({available} bytes left)")]
    LengthPastEof { len: usize, available: usize },
    #[error("record checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("unknown record kind {kind}")]
    UnknownKind { kind: u8 },
    #[error("record body of kind {kind} is malformed ({len} bytes)")]
    Malformed { kind: u8, len: usize },
    #[error("enqueue id {id} is not above the previous id {previous}")]
    IdOutOfOrder { id: u64, previous: u64 },
}

/// A decoded segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    pub first_id: u64,
}

/// Encodes the header of a new segment whose first enqueue will get `first_id` or a higher id.
pub fn encode_header(first_id: u64) -> [u8; HEADER_SIZE] {
    let mut h = [0u8; HEADER_SIZE];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&(HEADER_SIZE as u16).to_le_bytes());
    h[8..16].copy_from_slice(&first_id.to_le_bytes());
    let crc = crc32c::crc32c(&h[..HEADER_SIZE - 4]);
    h[HEADER_SIZE - 4..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Decodes a segment header from the start of `file`.
pub fn decode_header(file: &[u8]) -> Result<SegmentHeader, Damage> {
    let h = file
        .get(..HEADER_SIZE)
        .ok_or(Damage::HeaderTruncated { have: file.len() })?;
    let magic = array::<4>(h, 0);
    if magic != MAGIC {
        return Err(Damage::BadMagic { found: magic });
    }
    let stored = u32::from_le_bytes(array(h, HEADER_SIZE - 4));
    if crc32c::crc32c(&h[..HEADER_SIZE - 4]) != stored {
        return Err(Damage::HeaderChecksum);
    }
    let version = u16::from_le_bytes(array(h, 4));
    if version != VERSION {
        return Err(Damage::UnsupportedVersion { version });
    }
    let size = u16::from_le_bytes(array(h, 6));
    if usize::from(size) != HEADER_SIZE {
        return Err(Damage::BadHeaderSize { version, size });
    }
    Ok(SegmentHeader {
        first_id: u64::from_le_bytes(array(h, 8)),
    })
}

/// One record read back from a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record<'a> {
    Enqueue {
        id: u64,
        queue: u64,
        payload: &'a [u8],
    },
    Acks {
        ids: AckIds<'a>,
    },
}

/// The ids of an acks record, decoded lazily.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckIds<'a>(&'a [u8]);

impl<'a> AckIds<'a> {
    pub fn len(&self) -> usize {
        self.0.len() / 8
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn iter(&self) -> impl Iterator<Item = u64> + 'a {
        self.0
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(array(c, 0)))
    }
}

/// Decodes the record at the start of `buf` (which runs to the end of the file). Returns the record and
/// the number of bytes it takes. Never panics, whatever the bytes.
pub fn decode_record(buf: &[u8]) -> Result<(Record<'_>, usize), Damage> {
    if buf.len() < RECORD_HEADER_SIZE {
        return Err(Damage::RecordHeaderTruncated { have: buf.len() });
    }
    let len = u32::from_le_bytes(array(buf, 0)) as usize;
    let stored = u32::from_le_bytes(array(buf, 4));
    if len > MAX_BODY_LEN {
        return Err(Damage::LengthTooLarge { len });
    }
    let available = buf.len() - RECORD_HEADER_SIZE;
    let body = buf
        .get(RECORD_HEADER_SIZE..RECORD_HEADER_SIZE + len)
        .ok_or(Damage::LengthPastEof { len, available })?;
    let computed = crc32c::crc32c(body);
    if computed != stored {
        return Err(Damage::Checksum { stored, computed });
    }
    let kind = body
        .first()
        .copied()
        .ok_or(Damage::Malformed { kind: 0, len })?;
    let record = match kind {
        KIND_ENQUEUE => {
            if len < ENQUEUE_FIXED_LEN {
                return Err(Damage::Malformed { kind, len });
            }
            Record::Enqueue {
                id: u64::from_le_bytes(array(body, 1)),
                queue: u64::from_le_bytes(array(body, 9)),
                payload: &body[ENQUEUE_FIXED_LEN..],
            }
        }
        KIND_ACKS => {
            let count = body
                .get(1..5)
                .map(|c| u32::from_le_bytes(array(c, 0)) as usize);
            match count {
                Some(n) if len == ACKS_FIXED_LEN + n * 8 => Record::Acks {
                    ids: AckIds(&body[ACKS_FIXED_LEN..]),
                },
                _ => return Err(Damage::Malformed { kind, len }),
            }
        }
        kind => return Err(Damage::UnknownKind { kind }),
    };
    Ok((record, RECORD_HEADER_SIZE + len))
}

/// Appends an enqueue record with a zero id and a zero CRC to `out`; [`seal_enqueue`] fills both in once
/// the id is known. Returns the CRC32C of the body after the id (queue and payload), which lets the final
/// CRC be computed without reading the payload again.
pub fn encode_enqueue_unsealed(out: &mut Vec<u8>, queue: u64, payload_parts: &[&[u8]]) -> u32 {
    let payload_len: usize = payload_parts.iter().map(|p| p.len()).sum();
    let len = ENQUEUE_FIXED_LEN + payload_len;
    // Lengths above the limit are rejected by `Batch` before sealing; saturate rather than wrap here.
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.push(KIND_ENQUEUE);
    out.extend_from_slice(&[0u8; 8]);
    let tail_start = out.len();
    out.extend_from_slice(&queue.to_le_bytes());
    for p in payload_parts {
        out.extend_from_slice(p);
    }
    crc32c::crc32c(&out[tail_start..])
}

/// Writes `id` and the final CRC into an enqueue record made by [`encode_enqueue_unsealed`].
/// `record` starts at the record's length field; `tail_crc`/`tail_len` describe queue + payload.
pub fn seal_enqueue(record: &mut [u8], id: u64, tail_crc: u32, tail_len: usize) {
    let id_bytes = id.to_le_bytes();
    record[RECORD_HEADER_SIZE + 1..RECORD_HEADER_SIZE + 9].copy_from_slice(&id_bytes);
    let mut head = [0u8; 9];
    head[0] = KIND_ENQUEUE;
    head[1..].copy_from_slice(&id_bytes);
    let crc = crc32c::crc32c_combine(crc32c::crc32c(&head), tail_crc, tail_len);
    record[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// Appends complete acks records for `ids` to `out` (one record, or more above [`MAX_ACKS_PER_RECORD`]).
pub fn encode_acks(out: &mut Vec<u8>, ids: &[u64]) {
    for chunk in ids.chunks(MAX_ACKS_PER_RECORD) {
        let len = ACKS_FIXED_LEN + chunk.len() * 8;
        let start = out.len();
        out.extend_from_slice(&(len as u32).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        out.push(KIND_ACKS);
        out.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
        for id in chunk {
            out.extend_from_slice(&id.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out[start + RECORD_HEADER_SIZE..]);
        out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Copies `N` bytes at `at`; callers have checked the length, and short input yields zeros, not a panic.
fn array<const N: usize>(buf: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    if let Some(s) = buf.get(at..at + N) {
        a.copy_from_slice(s);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enqueue(id: u64, queue: u64, parts: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        let crc = encode_enqueue_unsealed(&mut out, queue, parts);
        let tail_len = out.len() - RECORD_HEADER_SIZE - 9;
        seal_enqueue(&mut out, id, crc, tail_len);
        out
    }

    #[test]
    fn header_round_trip_and_damage() {
        let h = encode_header(42);
        assert_eq!(decode_header(&h), Ok(SegmentHeader { first_id: 42 }));
        assert_eq!(
            decode_header(&h[..10]),
            Err(Damage::HeaderTruncated { have: 10 })
        );
        let mut bad = h;
        bad[9] ^= 1;
        assert_eq!(decode_header(&bad), Err(Damage::HeaderChecksum));
        bad = h;
        bad[0] = b'X';
        assert!(matches!(decode_header(&bad), Err(Damage::BadMagic { .. })));
    }

    #[test]
    fn enqueue_round_trip_with_sealed_crc() {
        let rec = enqueue(7, 3, &[b"head", b"", b"body"]);
        let (r, n) = decode_record(&rec).unwrap();
        assert_eq!(n, rec.len());
        assert_eq!(
            r,
            Record::Enqueue {
                id: 7,
                queue: 3,
                payload: b"headbody"
            }
        );
    }

    #[test]
    fn acks_round_trip() {
        let mut out = Vec::new();
        encode_acks(&mut out, &[1, 5, 9]);
        let (r, n) = decode_record(&out).unwrap();
        assert_eq!(n, out.len());
        match r {
            Record::Acks { ids } => assert_eq!(ids.iter().collect::<Vec<_>>(), vec![1, 5, 9]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_single_byte_flip_or_cut_is_detected() {
        let rec = enqueue(1, 2, &[b"some payload bytes"]);
        for i in 0..rec.len() {
            assert!(decode_record(&rec[..i]).is_err(), "cut at {i}");
            let mut bad = rec.clone();
            bad[i] ^= 0x40;
            assert!(decode_record(&bad).is_err(), "flip at {i}");
        }
    }

    #[test]
    fn unknown_kind_and_huge_length() {
        let mut out = Vec::new();
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(&[9]).to_le_bytes());
        out.push(9);
        assert_eq!(decode_record(&out), Err(Damage::UnknownKind { kind: 9 }));
        let huge = [0xff; 8];
        assert!(matches!(
            decode_record(&huge),
            Err(Damage::LengthTooLarge { .. })
        ));
    }
}
