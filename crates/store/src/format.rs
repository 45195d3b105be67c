//! On-disk formats: the write-ahead log (WAL), the per-queue segment files, and what is trusted after a
//! crash. All integers are little endian.
//!
//! # Layout of the data directory
//! ```text
//! LOCK                                   flock'ed while a store has the directory open
//! checkpoint                             see `checkpoint.rs`: the WAL position up to which every record
//!                                        is reflected in the queue files, and each queue's state there
//! wal/NNNNNNNNNNNNNNNNNNNN.wlog          WAL segments; the number is the segment's base position in the
//!                                        endless logical log (a `SyncTicket` is a position in it)
//! queues/<queue id>/NNNNNNNNNNNNNNNNNNNN.qseg
//!                                        a queue's messages in order; the number is the first seq
//! damaged/<file name>.<offset>           what recovery cut or skipped, kept (never read back)
//! ```
//! A queue's segments are its own `.qseg` files and extents: byte ranges of WAL segments that hold
//! (nearly only) its enqueues, listed in the checkpoint. A WAL segment an extent is in is kept.
//!
//! # WAL segment header ([`HEADER_SIZE`] bytes)
//! `magic "WRNL" | version u16 | header_size u16 | reserved 20 bytes | crc32c u32 over bytes 0..28`
//! Version 3 ([`WAL_VERSION`]) ends every group with a synced mark; version 2 segments (no marks) are
//! still read, with the older rule for telling a torn tail (see below).
//!
//! # Queue segment header ([`HEADER_SIZE`] bytes)
//! `magic "WRNQ" | version u16 | header_size u16 | queue u64 | first_seq u64 | reserved 4 | crc32c u32`
//!
//! # Records (both file kinds, after the header, back to back)
//! `len u32 | crc32c u32 (over the body) | body (len bytes)`
//! ```text
//! WAL:    KIND_ENQUEUE u8 | queue u64 | seq u64 | timestamp_ms u64 | payload
//!         KIND_ACKS    u8 | queue u64 | bytes u64 | count u32 | count x (start u64, end u64)
//!         KIND_DROP    u8 | queue u64
//!         KIND_DELIVERED u8 | queue u64 | up_to u64   every seq below up_to may have been delivered
//!         KIND_SYNCED  u8 | synced_to u64 | at u64    the last record of each group (see below)
//!         KIND_REWIND  u8 | queue u64 | from u64 | until u64   gone seqs in [from, until) still on
//!                                                  disk are live again (a rewind; `QueueLog::rewind`)
//! queue:  KIND_ENQUEUE u8 | queue u64 | seq u64 | timestamp_ms u64 | payload   (the WAL record, copied)
//! ```
//! A queue's enqueues carry strictly increasing seqs below `u64::MAX` (the queue assigns them under its
//! lock). An acks
//! record says that the seqs in `[start, end)` of one queue are gone and that together they held `bytes`
//! bytes of payload.
//!
//! # Crash behaviour: what recovery trusts
//! Files are only appended to and never preallocated, so after a crash a file holds a prefix of what was
//! written plus, at most, a torn or garbled tail. A record is accepted only if its header is complete, its
//! length fits in the file and is at most [`MAX_BODY_LEN`], the CRC32C of the body matches, and the kind is
//! known and well formed.
//! - **WAL**: a WAL segment is fsynced before the next one is created, so only the newest one can have a
//!   torn tail, and only after the last checkpoint. A disk may persist the blocks of one write out of
//!   order, so a torn tail can hold a hole followed by valid records (of writes no fsync covered yet).
//!   Each group the writer writes therefore ends with a **synced mark**: `synced_to` is the position up
//!   to which the WAL was durable (an fsync had returned) when the group was taken, `at` the mark's own
//!   position. A mark proves that everything before its `synced_to` was durable. Damage at position `p`
//!   is a torn tail (bytes written after the last fsync, never confirmed) unless a valid mark after it
//!   has `synced_to > p`: it is cut there, with every record after it, and the cut bytes are kept in
//!   `damaged/`. Any other damage is corruption in the middle: recovery refuses to start with an error
//!   naming the file and offset, unless the recovery mode says to skip it (`recovery.rs`). A mark
//!   counts only where `at` is the position it was found at, so one a client forged inside a payload
//!   must also guess where in the log it lands. In version 2 segments (no marks) damage is a torn tail
//!   only if no valid record follows it. What this cannot tell: damage to the last fsynced group when
//!   no later group's mark survived (no evidence either way) is cut as a torn tail.
//! - **Queue segments** are not fsynced on the commit path: what the checkpoint lists was made durable
//!   (with `syncfs`) before the checkpoint was written, and everything after it is rebuilt from the WAL.
//!   A file shorter than the checkpoint recorded refuses to start (as corruption in the middle). A bad
//!   record found later when reading a queue segment is logged, the rest of that segment copied into
//!   `damaged/` and skipped.

use thiserror::Error;

pub const WAL_MAGIC: [u8; 4] = *b"WRNL";
pub const QSEG_MAGIC: [u8; 4] = *b"WRNQ";
/// WAL segment format written by this code: groups end with synced marks. Version 2 (no marks) is
/// read too.
pub const WAL_VERSION: u16 = 3;
/// The WAL segment version before synced marks.
pub const WAL_VERSION_UNMARKED: u16 = 2;
/// Queue segment format written by this code; the only one it reads.
pub const QSEG_VERSION: u16 = 2;
/// Bytes of a segment header (both kinds); records start right after it.
pub const HEADER_SIZE: usize = 32;
/// `len: u32 | crc32c: u32` in front of every record body.
pub const RECORD_HEADER_SIZE: usize = 8;
/// Largest record body accepted; larger lengths on disk are garbage.
pub const MAX_BODY_LEN: usize = 1 << 30;
pub const KIND_ENQUEUE: u8 = 1;
pub const KIND_ACKS: u8 = 2;
pub const KIND_DROP: u8 = 3;
pub const KIND_DELIVERED: u8 = 4;
pub const KIND_SYNCED: u8 = 5;
/// Written only by a rewind: a store that never rewound stays readable by binaries without it (one
/// that did is not: they report this kind as damage).
pub const KIND_REWIND: u8 = 6;
/// Enqueue body bytes before the payload: kind, queue, seq, timestamp.
pub const ENQUEUE_FIXED_LEN: usize = 1 + 8 + 8 + 8;
/// Acks body bytes before the ranges: kind, queue, bytes, count.
pub const ACKS_FIXED_LEN: usize = 1 + 8 + 8 + 4;
pub const DROP_LEN: usize = 1 + 8;
pub const DELIVERED_LEN: usize = 1 + 8 + 8;
pub const SYNCED_LEN: usize = 1 + 8 + 8;
pub const REWIND_LEN: usize = 1 + 8 + 8 + 8;
/// Bytes a synced mark takes in the log.
pub const SYNCED_RECORD_LEN: usize = RECORD_HEADER_SIZE + SYNCED_LEN;
pub const WAL_EXT: &str = "wlog";
pub const QSEG_EXT: &str = "qseg";

/// Why bytes read back from a file were not accepted.
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
    #[error("unsupported format version {version}")]
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
}

/// Encodes a WAL segment header.
pub fn encode_wal_header() -> [u8; HEADER_SIZE] {
    seal_header(WAL_MAGIC, WAL_VERSION, [0u8; 20])
}

/// Encodes the header of queue `queue`'s segment whose first record has seq `first_seq`.
pub fn encode_qseg_header(queue: u64, first_seq: u64) -> [u8; HEADER_SIZE] {
    let mut rest = [0u8; 20];
    rest[0..8].copy_from_slice(&queue.to_le_bytes());
    rest[8..16].copy_from_slice(&first_seq.to_le_bytes());
    seal_header(QSEG_MAGIC, QSEG_VERSION, rest)
}

fn seal_header(magic: [u8; 4], version: u16, rest: [u8; 20]) -> [u8; HEADER_SIZE] {
    let mut h = [0u8; HEADER_SIZE];
    h[0..4].copy_from_slice(&magic);
    h[4..6].copy_from_slice(&version.to_le_bytes());
    h[6..8].copy_from_slice(&(HEADER_SIZE as u16).to_le_bytes());
    h[8..28].copy_from_slice(&rest);
    let crc = crc32c::crc32c(&h[..HEADER_SIZE - 4]);
    h[HEADER_SIZE - 4..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a header of either kind at the start of `file`; returns its version and its 20
/// kind-specific bytes.
pub fn decode_header(file: &[u8], magic: [u8; 4]) -> Result<(u16, [u8; 20]), Damage> {
    let h = file.get(..HEADER_SIZE).ok_or(Damage::HeaderTruncated { have: file.len() })?;
    let found = array::<4>(h, 0);
    if found != magic {
        return Err(Damage::BadMagic { found });
    }
    let stored = u32::from_le_bytes(array(h, HEADER_SIZE - 4));
    if crc32c::crc32c(&h[..HEADER_SIZE - 4]) != stored {
        return Err(Damage::HeaderChecksum);
    }
    let version = u16::from_le_bytes(array(h, 4));
    let readable = match magic {
        WAL_MAGIC => version == WAL_VERSION || version == WAL_VERSION_UNMARKED,
        _ => version == QSEG_VERSION,
    };
    if !readable {
        return Err(Damage::UnsupportedVersion { version });
    }
    let size = u16::from_le_bytes(array(h, 6));
    if usize::from(size) != HEADER_SIZE {
        return Err(Damage::BadHeaderSize { version, size });
    }
    Ok((version, array(h, 8)))
}

/// `(queue, first_seq)` of a queue segment header.
pub fn decode_qseg_header(file: &[u8]) -> Result<(u64, u64), Damage> {
    let (_, rest) = decode_header(file, QSEG_MAGIC)?;
    Ok((u64::from_le_bytes(array(&rest, 0)), u64::from_le_bytes(array(&rest, 8))))
}

/// One record read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record<'a> {
    Enqueue { queue: u64, seq: u64, timestamp_ms: u64, payload: &'a [u8] },
    Acks { queue: u64, bytes: u64, ranges: AckRanges<'a> },
    Drop { queue: u64 },
    /// Seqs of `queue` below `up_to` may have been delivered (so come back redelivered after a restart).
    Delivered { queue: u64, up_to: u64 },
    /// The end of a group: when it was taken, the WAL was durable up to `synced_to`; the mark itself
    /// is at position `at` (see the module docs).
    Synced { synced_to: u64, at: u64 },
    /// The gone seqs of `queue` in `[from, until)` that are still on disk are live again.
    Rewind { queue: u64, from: u64, until: u64 },
}

/// The `[start, end)` ranges of an acks record, decoded lazily.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckRanges<'a>(&'a [u8]);

impl<'a> AckRanges<'a> {
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.0.chunks_exact(16).map(|c| (u64::from_le_bytes(array(c, 0)), u64::from_le_bytes(array(c, 8))))
    }
}

/// Decodes the record at the start of `buf` (which runs to the end of the valid data). Returns the record
/// and the number of bytes it takes. Never panics, whatever the bytes.
pub fn decode_record(buf: &[u8]) -> Result<(Record<'_>, usize), Damage> {
    decode(buf, true)
}

/// [`decode_record`] without the CRC check, for bytes this process encoded a moment ago (the writer's
/// own group buffer): checking them again would only cost CPU on the message path.
pub(crate) fn decode_own_record(buf: &[u8]) -> Result<(Record<'_>, usize), Damage> {
    decode(buf, false)
}

fn decode(buf: &[u8], verify: bool) -> Result<(Record<'_>, usize), Damage> {
    if buf.len() < RECORD_HEADER_SIZE {
        return Err(Damage::RecordHeaderTruncated { have: buf.len() });
    }
    let len = u32::from_le_bytes(array(buf, 0)) as usize;
    let stored = u32::from_le_bytes(array(buf, 4));
    if len > MAX_BODY_LEN {
        return Err(Damage::LengthTooLarge { len });
    }
    let available = buf.len() - RECORD_HEADER_SIZE;
    let body = buf.get(RECORD_HEADER_SIZE..RECORD_HEADER_SIZE + len).ok_or(Damage::LengthPastEof { len, available })?;
    if verify {
        let computed = crc32c::crc32c(body);
        if computed != stored {
            return Err(Damage::Checksum { stored, computed });
        }
    }
    let kind = body.first().copied().ok_or(Damage::Malformed { kind: 0, len })?;
    let u64_at = |at: usize| u64::from_le_bytes(array(body, at));
    let record = match kind {
        // Seq u64::MAX is never assigned (the queue's next seq would overflow): a forged or damaged record.
        KIND_ENQUEUE if len >= ENQUEUE_FIXED_LEN && u64_at(9) != u64::MAX => Record::Enqueue {
            queue: u64_at(1),
            seq: u64_at(9),
            timestamp_ms: u64_at(17),
            payload: &body[ENQUEUE_FIXED_LEN..],
        },
        KIND_ACKS if len >= ACKS_FIXED_LEN => {
            let count = u32::from_le_bytes(array(body, 17)) as usize;
            if len != ACKS_FIXED_LEN + count * 16 {
                return Err(Damage::Malformed { kind, len });
            }
            Record::Acks { queue: u64_at(1), bytes: u64_at(9), ranges: AckRanges(&body[ACKS_FIXED_LEN..]) }
        }
        KIND_DROP if len == DROP_LEN => Record::Drop { queue: u64_at(1) },
        KIND_DELIVERED if len == DELIVERED_LEN => Record::Delivered { queue: u64_at(1), up_to: u64_at(9) },
        KIND_SYNCED if len == SYNCED_LEN => Record::Synced { synced_to: u64_at(1), at: u64_at(9) },
        KIND_REWIND if len == REWIND_LEN => Record::Rewind { queue: u64_at(1), from: u64_at(9), until: u64_at(17) },
        KIND_ENQUEUE | KIND_ACKS | KIND_DROP | KIND_DELIVERED | KIND_SYNCED | KIND_REWIND => return Err(Damage::Malformed { kind, len }),
        kind => return Err(Damage::UnknownKind { kind }),
    };
    Ok((record, RECORD_HEADER_SIZE + len))
}

/// The offset of the first valid record that starts at or after `from` in `buf`, if any: how recovery
/// tells corruption in the middle of a WAL segment (valid records follow the damage) from a torn tail
/// (nothing valid does). Each candidate offset is checked for a plausible length and kind before its
/// CRC is computed, so scanning garbage costs little.
pub fn find_record(buf: &[u8], from: usize) -> Option<usize> {
    let last = buf.len().checked_sub(RECORD_HEADER_SIZE + 1)?;
    (from..=last).find(|&at| {
        let len = u32::from_le_bytes(array(buf, at)) as usize;
        let fits = len <= buf.len() - at - RECORD_HEADER_SIZE;
        let plausible = fits
            && match buf[at + RECORD_HEADER_SIZE] {
                KIND_ENQUEUE => len >= ENQUEUE_FIXED_LEN,
                KIND_ACKS => len >= ACKS_FIXED_LEN && (len - ACKS_FIXED_LEN).is_multiple_of(16),
                KIND_DROP => len == DROP_LEN,
                KIND_DELIVERED => len == DELIVERED_LEN,
                KIND_SYNCED => len == SYNCED_LEN,
                KIND_REWIND => len == REWIND_LEN,
                _ => false,
            };
        plausible && decode_record(&buf[at..]).is_ok()
    })
}

/// Appends a complete enqueue record; the payload is given in parts to avoid a concatenation copy.
/// Returns the payload length.
pub fn encode_enqueue(out: &mut Vec<u8>, queue: u64, seq: u64, timestamp_ms: u64, parts: &[&[u8]]) -> usize {
    let payload_len: usize = parts.iter().map(|p| p.len()).sum();
    out.extend_from_slice(&encode_enqueue_head(queue, seq, timestamp_ms, payload_len, parts));
    for p in parts {
        out.extend_from_slice(p);
    }
    payload_len
}

/// The record header and fixed fields of an enqueue whose payload is `parts` (`payload_len` bytes in
/// all), checksum included: the payload can then be copied straight after it into the write buffer
/// (no encode-then-copy).
pub fn encode_enqueue_head(queue: u64, seq: u64, timestamp_ms: u64, payload_len: usize, parts: &[&[u8]]) -> [u8; RECORD_HEADER_SIZE + ENQUEUE_FIXED_LEN] {
    let len = ENQUEUE_FIXED_LEN + payload_len;
    let mut h = [0u8; RECORD_HEADER_SIZE + ENQUEUE_FIXED_LEN];
    // Lengths above the limit are refused by `append` before anything is written; saturate, never wrap.
    h[0..4].copy_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    h[8] = KIND_ENQUEUE;
    h[9..17].copy_from_slice(&queue.to_le_bytes());
    h[17..25].copy_from_slice(&seq.to_le_bytes());
    h[25..33].copy_from_slice(&timestamp_ms.to_le_bytes());
    let mut crc = crc32c::crc32c(&h[RECORD_HEADER_SIZE..]);
    for p in parts {
        crc = crc32c::crc32c_append(crc, p);
    }
    h[4..8].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Appends acks records for `ranges` of `queue` (split if there are very many).
pub fn encode_acks(out: &mut Vec<u8>, queue: u64, bytes: u64, ranges: &[(u64, u64)]) {
    const MAX_RANGES: usize = (MAX_BODY_LEN - ACKS_FIXED_LEN) / 16;
    let mut bytes_left = bytes;
    for chunk in ranges.chunks(MAX_RANGES) {
        let start = out.len();
        let len = ACKS_FIXED_LEN + chunk.len() * 16;
        out.extend_from_slice(&(len as u32).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        out.push(KIND_ACKS);
        out.extend_from_slice(&queue.to_le_bytes());
        // All bytes go with the first record; the split is only a size limit.
        out.extend_from_slice(&std::mem::take(&mut bytes_left).to_le_bytes());
        out.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
        for (s, e) in chunk {
            out.extend_from_slice(&s.to_le_bytes());
            out.extend_from_slice(&e.to_le_bytes());
        }
        seal(out, start);
    }
}

pub fn encode_drop(out: &mut Vec<u8>, queue: u64) {
    let start = out.len();
    out.extend_from_slice(&(DROP_LEN as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.push(KIND_DROP);
    out.extend_from_slice(&queue.to_le_bytes());
    seal(out, start);
}

pub fn encode_delivered(out: &mut Vec<u8>, queue: u64, up_to: u64) {
    encode_kind_and_two(out, KIND_DELIVERED, queue, up_to);
}

/// Appends the synced mark that ends a group (see the module docs): the mark will be at WAL position
/// `at`, and everything before `synced_to` was durable when the group was taken.
pub fn encode_synced(out: &mut Vec<u8>, synced_to: u64, at: u64) {
    encode_kind_and_two(out, KIND_SYNCED, synced_to, at);
}

pub fn encode_rewind(out: &mut Vec<u8>, queue: u64, from: u64, until: u64) {
    let start = out.len();
    out.extend_from_slice(&(REWIND_LEN as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.push(KIND_REWIND);
    for v in [queue, from, until] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    seal(out, start);
}

/// A record whose body is its kind and two u64s (`DELIVERED_LEN`, `SYNCED_LEN`).
fn encode_kind_and_two(out: &mut Vec<u8>, kind: u8, a: u64, b: u64) {
    let start = out.len();
    out.extend_from_slice(&(1u32 + 8 + 8).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.push(kind);
    out.extend_from_slice(&a.to_le_bytes());
    out.extend_from_slice(&b.to_le_bytes());
    seal(out, start);
}

fn seal(out: &mut [u8], start: usize) {
    let crc = crc32c::crc32c(&out[start + RECORD_HEADER_SIZE..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Copies `N` bytes at `at`; callers have checked the length, and short input yields zeros, not a panic.
pub(crate) fn array<const N: usize>(buf: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    if let Some(s) = buf.get(at..at + N) {
        a.copy_from_slice(s);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_damage() {
        let h = encode_qseg_header(7, 42);
        assert_eq!(decode_qseg_header(&h), Ok((7, 42)));
        assert_eq!(decode_qseg_header(&h[..10]), Err(Damage::HeaderTruncated { have: 10 }));
        let mut bad = h;
        bad[9] ^= 1;
        assert_eq!(decode_qseg_header(&bad), Err(Damage::HeaderChecksum));
        assert!(matches!(decode_header(&encode_wal_header(), QSEG_MAGIC), Err(Damage::BadMagic { .. })));
        assert!(decode_header(&encode_wal_header(), WAL_MAGIC).is_ok());
    }

    /// Found by the store_recovery fuzz target: a well-formed enqueue record (checksum valid) with seq
    /// u64::MAX was accepted, and replaying it overflowed the queue's next seq (a panic with overflow
    /// checks, a queue whose next seq wrapped to 0 without them).
    #[test]
    fn an_enqueue_with_the_largest_seq_is_malformed() {
        let mut out = Vec::new();
        encode_enqueue(&mut out, 3, u64::MAX, 1234, &[b"x"]);
        assert_eq!(decode_record(&out), Err(Damage::Malformed { kind: KIND_ENQUEUE, len: ENQUEUE_FIXED_LEN + 1 }));
        out.clear();
        encode_enqueue(&mut out, 3, u64::MAX - 1, 1234, &[b"x"]);
        assert!(decode_record(&out).is_ok());
    }

    #[test]
    fn records_round_trip() {
        let mut out = Vec::new();
        encode_enqueue(&mut out, 3, 9, 1234, &[b"head", b"", b"body"]);
        encode_acks(&mut out, 3, 77, &[(1, 4), (9, 10)]);
        encode_drop(&mut out, 5);
        let (r, n) = decode_record(&out).unwrap();
        assert_eq!(r, Record::Enqueue { queue: 3, seq: 9, timestamp_ms: 1234, payload: b"headbody" });
        let (r2, n2) = decode_record(&out[n..]).unwrap();
        match r2 {
            Record::Acks { queue, bytes, ranges } => {
                assert_eq!((queue, bytes), (3, 77));
                assert_eq!(ranges.iter().collect::<Vec<_>>(), vec![(1, 4), (9, 10)]);
            }
            other => panic!("{other:?}"),
        }
        let (r3, n3) = decode_record(&out[n + n2..]).unwrap();
        assert_eq!(r3, Record::Drop { queue: 5 });
        encode_synced(&mut out, 4096, 8192);
        assert_eq!(decode_record(&out[n + n2 + n3..]), Ok((Record::Synced { synced_to: 4096, at: 8192 }, SYNCED_RECORD_LEN)));
        assert_eq!(find_record(&out, n + n2 + n3), Some(n + n2 + n3));
    }

    #[test]
    fn every_single_byte_flip_or_cut_is_detected() {
        let mut rec = Vec::new();
        encode_enqueue(&mut rec, 1, 2, 3, &[b"some payload bytes"]);
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
        assert!(matches!(decode_record(&[0xff; 8]), Err(Damage::LengthTooLarge { .. })));
    }
}
