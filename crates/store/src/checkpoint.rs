//! The checkpoint: the WAL position up to which every record is reflected, durably, in the queue logs,
//! and each queue's state at that point. Recovery starts from it and replays only the WAL after it, so
//! restart time depends on the checkpoint interval, not on the backlog; the WAL before it is deleted.
//!
//! Written atomically: `checkpoint.tmp`, fsync, rename over `checkpoint`, fsync of the directory. The file
//! ends with a CRC32C of everything before it; a bad one means the disk damaged it (a crash cannot, given
//! the rename).
//!
//! ```text
//! "WRNC" | version u16 | wal_pos u64 | count u32 | count x queue | crc32c u32
//! queue = id u64 | next_seq u64 | floor u64 | live_bytes u64 | retention_ms u64 | delivered_until u64
//!       | n u32 | n x (start u64, end u64)                          gone ranges above the floor
//!       | m u32 | m x segment
//! segment = first_seq, len, end_seq, first_ts, last_ts, start, wal   7 x u64; wal = u64::MAX for the
//!                                                                    queue's own file, else the base of
//!                                                                    the WAL segment the extent is in
//! ```
//! Version 2 (before extents and delivered marks) had no `delivered_until` and only the first five
//! segment fields; it is still read.

use std::fs;
use std::path::Path;

use crate::error::StoreError;
use crate::format::{array, HEADER_SIZE};
use crate::io::{Disk, Open};
use crate::qlog::{QSeg, QueueLog};

const MAGIC: [u8; 4] = *b"WRNC";
/// Checkpoint layout version written; 2 is read too.
const CHECKPOINT_VERSION: u16 = 3;
/// The checkpoint format before delivered marks and extents, still read.
const CHECKPOINT_VERSION_2: u16 = 2;
const NOT_AN_EXTENT: u64 = u64::MAX;
pub(crate) const FILE: &str = "checkpoint";
/// Larger WAL positions in a checkpoint are refused as damaged (2^62 bytes: centuries of writing).
const MAX_WAL_POS: u64 = 1 << 62;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    pub wal_pos: u64,
    pub queues: Vec<QueueState>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct QueueState {
    pub id: u64,
    pub next_seq: u64,
    pub floor: u64,
    pub live_bytes: u64,
    pub retention_ms: u64,
    pub delivered_until: u64,
    pub ranges: Vec<(u64, u64)>,
    pub segments: Vec<QSeg>,
}

impl QueueState {
    pub fn of(log: &QueueLog) -> QueueState {
        QueueState {
            id: log.id,
            next_seq: log.next_seq,
            floor: log.gone.floor(),
            live_bytes: log.live_bytes,
            retention_ms: log.retention_ms,
            delivered_until: log.delivered_until,
            ranges: log.gone.ranges().collect(),
            segments: log.segments.values().copied().collect(),
        }
    }
}

pub(crate) fn encode(cp: &Checkpoint) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
    out.extend_from_slice(&cp.wal_pos.to_le_bytes());
    out.extend_from_slice(&(cp.queues.len() as u32).to_le_bytes());
    for q in &cp.queues {
        for v in [q.id, q.next_seq, q.floor, q.live_bytes, q.retention_ms, q.delivered_until] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(q.ranges.len() as u32).to_le_bytes());
        for (a, b) in &q.ranges {
            out.extend_from_slice(&a.to_le_bytes());
            out.extend_from_slice(&b.to_le_bytes());
        }
        out.extend_from_slice(&(q.segments.len() as u32).to_le_bytes());
        for s in &q.segments {
            for v in [s.first_seq, s.len, s.end_seq, s.first_ts, s.last_ts, s.start, s.wal.unwrap_or(NOT_AN_EXTENT)] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Why a checkpoint file was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadCheckpoint(pub String);

pub(crate) fn decode(data: &[u8]) -> Result<Checkpoint, BadCheckpoint> {
    let bad = |what: &str| BadCheckpoint(what.to_string());
    if data.len() < 4 + 2 + 8 + 4 + 4 {
        return Err(bad("too short"));
    }
    let (body, crc) = data.split_at(data.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(array(crc, 0)) {
        return Err(bad("checksum mismatch"));
    }
    if array::<4>(body, 0) != MAGIC {
        return Err(bad("bad magic"));
    }
    let version = u16::from_le_bytes(array(body, 4));
    if version != CHECKPOINT_VERSION_2 && version != CHECKPOINT_VERSION {
        return Err(BadCheckpoint(format!("unsupported version {version}")));
    }
    let mut r = Cursor { buf: body, at: 6 };
    let wal_pos = r.u64()?;
    // WAL positions grow by the bytes written: one this far out is damage the CRC missed (and
    // recovery's arithmetic on it would overflow).
    if wal_pos > MAX_WAL_POS {
        return Err(bad("WAL position out of range"));
    }
    let count = r.u32()?;
    let mut queues = Vec::new();
    for _ in 0..count {
        let (id, next_seq, floor, live_bytes, retention_ms) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
        // Version 2 kept no marks: everything it held may have been delivered.
        let delivered_until = if version == CHECKPOINT_VERSION { r.u64()? } else { next_seq };
        let n = r.u32()?;
        let mut ranges = Vec::new();
        for _ in 0..n {
            ranges.push((r.u64()?, r.u64()?));
        }
        let m = r.u32()?;
        let mut segments = Vec::new();
        for _ in 0..m {
            let (first_seq, len, end_seq, first_ts, last_ts) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
            let (start, wal) = if version == CHECKPOINT_VERSION {
                (r.u64()?, Some(r.u64()?).filter(|&w| w != NOT_AN_EXTENT))
            } else {
                (HEADER_SIZE as u64, None)
            };
            // A segment's seqs run from its first to its end: one that ends before it starts is
            // damage the CRC missed (counting its seqs would overflow).
            if end_seq < first_seq {
                return Err(bad("a segment that ends before it starts"));
            }
            segments.push(QSeg { first_seq, start, len, end_seq, first_ts, last_ts, wal });
        }
        queues.push(QueueState { id, next_seq, floor, live_bytes, retention_ms, delivered_until, ranges, segments });
    }
    if r.at != body.len() {
        return Err(bad("trailing bytes"));
    }
    Ok(Checkpoint { wal_pos, queues })
}

struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], BadCheckpoint> {
        if self.at + N > self.buf.len() {
            return Err(BadCheckpoint("truncated".into()));
        }
        let a = array(self.buf, self.at);
        self.at += N;
        Ok(a)
    }
    fn u64(&mut self) -> Result<u64, BadCheckpoint> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    fn u32(&mut self) -> Result<u32, BadCheckpoint> {
        self.take::<4>().map(u32::from_le_bytes)
    }
}

/// Reads `dir/checkpoint`; `Ok(None)` if there is none yet.
pub(crate) fn read(dir: &Path) -> Result<Option<Result<Checkpoint, BadCheckpoint>>, StoreError> {
    let path = dir.join(FILE);
    match fs::read(&path) {
        Ok(data) => Ok(Some(decode(&data))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreError::Io { op: "reading", path, source: e }),
    }
}

/// Writes the checkpoint atomically (the caller has made the queue files it describes durable).
pub(crate) fn write(disk: &Disk, dir: &Path, cp: &Checkpoint) -> std::io::Result<()> {
    let tmp = dir.join("checkpoint.tmp");
    let f = disk.open(&tmp, Open::CreateTruncate, false)?;
    f.write_all_at(&encode(cp), 0)?;
    f.sync_all()?;
    disk.rename(&tmp, &dir.join(FILE))?;
    disk.sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage() {
        let cp = Checkpoint {
            wal_pos: 99,
            queues: vec![QueueState {
                id: 4,
                next_seq: 10,
                floor: 3,
                live_bytes: 700,
                retention_ms: 5,
                delivered_until: 8,
                ranges: vec![(5, 7)],
                segments: vec![
                    QSeg { first_seq: 0, start: 32, len: 100, end_seq: 10, first_ts: 1, last_ts: 2, wal: None },
                    QSeg { first_seq: 10, start: 4096, len: 9000, end_seq: 12, first_ts: 3, last_ts: 4, wal: Some(77) },
                ],
            }],
        };
        let bytes = encode(&cp);
        assert_eq!(decode(&bytes), Ok(cp));
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            assert!(decode(&bad).is_err(), "flip at {i}");
            assert!(decode(&bytes[..i]).is_err(), "cut at {i}");
        }
    }

    /// Found by the store_recovery fuzz target: a checkpoint (checksum valid) with a WAL position near
    /// u64::MAX made recovery overflow computing where appends continue (a panic with overflow checks,
    /// wrapped positions without). Such a checkpoint is damaged: recovery refuses it, naming it.
    #[test]
    fn a_wal_position_out_of_range_is_damage() {
        let far = encode(&Checkpoint { wal_pos: u64::MAX - 3, queues: vec![] });
        assert_eq!(decode(&far), Err(BadCheckpoint("WAL position out of range".into())));
        let fine = Checkpoint { wal_pos: MAX_WAL_POS, queues: vec![] };
        assert_eq!(decode(&encode(&fine)), Ok(fine));
    }

    /// Found by the store_recovery fuzz target (2026-12-07): a checkpoint (checksum valid) naming a
    /// queue segment that ends before it starts made the first checkpoint after recovery overflow
    /// counting the segment's seqs (`QueueLog::all_gone`: a panic of the store's writer). Refused.
    #[test]
    fn a_segment_that_ends_before_it_starts_is_damage() {
        let queue = |end_seq| QueueState {
            id: 4,
            next_seq: 10,
            floor: 0,
            live_bytes: 0,
            retention_ms: 0,
            delivered_until: 0,
            ranges: vec![],
            segments: vec![QSeg { first_seq: 8, start: 32, len: 100, end_seq, first_ts: 1, last_ts: 2, wal: None }],
        };
        let bad = encode(&Checkpoint { wal_pos: 0, queues: vec![queue(7)] });
        assert_eq!(decode(&bad), Err(BadCheckpoint("a segment that ends before it starts".into())));
        let empty = Checkpoint { wal_pos: 0, queues: vec![queue(8)] };
        assert_eq!(decode(&encode(&empty)), Ok(empty));
    }
}
