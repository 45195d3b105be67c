//! Queue logs: each queue's messages in seq order, behind the WAL.
//!
//! After the group commit the writer thread puts every enqueue into its queue's in-memory tail (it is in
//! the WAL already), applies acks to the queue's [`GoneSet`], and at checkpoints turns the tail's live
//! records into segments: extents of the WAL where they lie densely, else copies in the queue's own
//! segment files (see [`QueueLog::spill`]). Segments are let go once every seq in them is gone and their
//! retention has passed. Queues read their backlog back from here in order, so a backlog costs disk,
//! not memory, and one slow queue keeps only its own messages on disk.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::direct::Appender;
use crate::format::{self, Record, HEADER_SIZE, QSEG_EXT, RECORD_HEADER_SIZE};
use crate::gone::GoneSet;
use crate::io::{Disk, Open};

/// A queue log writes out its buffer once it holds this much (and keeps no more than about twice this
/// in buffers): large enough for efficient direct writes, small enough times a thousand queues.
const FLUSH_AT: usize = 128 << 10;

/// A consumed newest segment smaller than this is kept while the queue is being written to (until it
/// has had no enqueue for `StoreOptions::active_segment_idle_ms`).
const KEEP_ACTIVE_BELOW: u64 = 1 << 20;

/// A queue's live records in one WAL segment become an extent (instead of being copied) only if they
/// span at least this many bytes: smaller runs are cheap to copy, and every extent is an entry in
/// memory and in each checkpoint (at worst one per 512 KiB of backlog: 20,000 for 10 GB).
const MIN_EXTENT: u64 = 512 << 10;

/// A Raft group's log and state (`crate::is_raft_queue`) keep a run of any length as an extent, up to
/// this many segments per queue, and are copied only past it. Their records stay live until a
/// snapshot lets them go, bounded by the node's log budget (crates/cluster), and at 1,000 quorum
/// queues they interleave in the WAL in runs of a record or a few: copied at every checkpoint, they
/// were ~90% of the WAL written a second time (bench/cluster.py Q4: ~150 MB a checkpoint, 0.6-0.9 s
/// of the writer's time during which no group commit was written). As extents the checkpoint
/// spills nothing (8-17 ms), and the WAL between them is punched out once purged. The cap bounds
/// memory and the checkpoint (at most 3 queues per group, ~56 bytes per extent) for groups whose
/// short entries would each be an extent: in Q4 they hold 2-31 each.
const MAX_RAFT_EXTENTS: usize = 64;

/// A segment spanning at least this many bytes is rewritten at a checkpoint (its live records copied
/// out, the segment let go) once at most `COMPACT_LIVE_PERCENT` of it is live: one message held while
/// those written with it are consumed must not keep the extent or file it is in (eight held messages
/// kept 126 MB: eight WAL segments). Seqs below the queue's consumed prefix do not count as holes,
/// so a backlog being consumed from its front is never copied: its segments go whole.
const COMPACT_MIN_SPAN: u64 = 64 << 10;
/// Live share (by count, then by bytes read) at or below which a segment is rewritten: disk held stays
/// within ~1.25x the live bytes (plus the newest segment, never rewritten), and a record is copied
/// at most about 4 bytes per byte freed.
const COMPACT_LIVE_PERCENT: u64 = 80;
/// Bytes of segments one checkpoint reads to rewrite them, at most (on the writer thread; the rest
/// waits for the next checkpoint).
pub(crate) const COMPACT_READ_BUDGET: u64 = 64 << 20;

/// What a checkpoint's rewrite of sparse segments did.
#[derive(Debug, Default)]
pub(crate) struct Compacted {
    pub bytes_written: u64,
    /// The queue's own files that were rewritten: deleted once the checkpoint naming their
    /// replacements is durable (the last one still names them).
    pub obsolete: Vec<PathBuf>,
}

/// A segment's live records, read for a rewrite.
struct LiveRecords {
    /// The records, as they are stored (header, enqueue and payload).
    bytes: Vec<u8>,
    first_seq: u64,
    first_ts: u64,
    last_ts: u64,
}

/// An enqueue whose seq is below its queue's next one: the store cannot keep it (see `QueueLog::admit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqRegression {
    pub queue: u64,
    pub seq: u64,
    pub next_seq: u64,
}

impl std::fmt::Display for SeqRegression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "enqueue out of seq order: queue {} appended seq {} after seq {}; the store keeps a queue's messages in seq order and cannot keep this one (a bug in the caller)",
            self.queue,
            self.seq,
            self.next_seq.saturating_sub(1)
        )
    }
}

/// A message read back from a queue log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub seq: u64,
    pub timestamp_ms: u64,
    pub payload: Bytes,
}

/// What a queue keeps for its retention ([`crate::Store::retention_stats`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RetentionStats {
    /// Consumed messages still on disk (a rewind could deliver them again).
    pub consumed: u64,
    /// When the oldest message on disk, consumed or not, was enqueued (unix ms).
    pub oldest_ms: Option<u64>,
}

/// The result of [`crate::Store::read`].
#[derive(Debug, Default)]
pub struct ReadBatch {
    /// Live messages in seq order.
    pub messages: Vec<StoredMessage>,
    /// Where the next read continues: after the last record looked at (gone ones included).
    pub next_seq: u64,
    /// Messages that could not be read back because a queue segment was damaged (logged); they are now
    /// counted as gone.
    pub lost: u64,
    /// Seqs that were live but have no record: a rewind made them live (`QueueLog::rewind` goes by
    /// segment ranges, and a seq in one may never have been stored). They are gone now.
    pub holes: u64,
    /// Bytes this read took from the queue's files (`StoreStats::bytes_read`).
    pub bytes_read: u64,
}

/// An enqueue record that is only in the WAL so far.
#[derive(Debug, Clone)]
struct TailRecord {
    seq: u64,
    timestamp_ms: u64,
    /// The whole record as in the WAL (a slice of the writer's group buffer).
    record: Bytes,
    /// Where it is in the WAL: the segment's base and the file offset of the record.
    wal: WalPlace,
    /// The enqueue before it in the WAL segment was this queue's too, or one its run goes over
    /// (`crate::runs_over`); only acks and other non-message records, if anything, lie between
    /// them otherwise.
    follows_own: bool,
}

/// An open segment file for reads.
struct SegReader {
    file_of: SegFile,
    /// Opened for reads past the page cache. A direct reader the file system refused (it reads
    /// buffered) is kept as one: opening it again would be refused again.
    asked_direct: bool,
    /// Reads past the page cache (`O_DIRECT`).
    is_direct: bool,
    file: File,
}

/// The file a queue segment is in: consecutive extents of one WAL segment share it, so a read
/// going from one to the next keeps the file open. Keyed by segment, a draining quorum queue (its
/// records in extents of ~0.5-1 MB between its Raft entries) opened a WAL file for nearly every
/// pread: ~850 opens a second in Q2 of `bench/cluster.py`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegFile {
    Wal(u64),
    Own(u64),
}

impl SegFile {
    fn of(seg: &QSeg) -> SegFile {
        match seg.wal {
            Some(base) => SegFile::Wal(base),
            None => SegFile::Own(seg.first_seq),
        }
    }
}

/// Where a record sits in the WAL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WalPlace {
    pub base: u64,
    pub offset: u64,
}

impl TailRecord {
    fn payload(&self) -> &[u8] {
        self.record.get(RECORD_HEADER_SIZE + format::ENQUEUE_FIXED_LEN..).unwrap_or_default()
    }
}

/// One segment of a queue: a file of its own, or an extent of a WAL segment.
///
/// An extent is a byte range of a WAL segment in which (nearly) every record is one of this queue's
/// enqueues: when a queue falls behind, its messages stay where the WAL wrote them instead of being
/// written a second time (see `QueueLog::spill` for when). Reads skip other records inside the range. The
/// WAL segment is kept while any extent refers to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QSeg {
    pub first_seq: u64,
    /// File offset of the first record (after the header for own files).
    pub start: u64,
    /// File offset after the last record the segment holds (own files: bytes written, header included).
    pub len: u64,
    /// Seq after the last record in it (`first_seq` while empty).
    pub end_seq: u64,
    pub first_ts: u64,
    pub last_ts: u64,
    /// The base of the WAL segment this extent is in; `None` for the queue's own files.
    pub wal: Option<u64>,
}

/// Read positions a queue log keeps (see `QueueLog::cursors`).
const CURSORS: usize = 4;

/// Where a read left off: the next record of the queue in `segment` at file `offset` has a seq at
/// or after `seq`.
#[derive(Debug, Clone, Copy)]
struct Cursor {
    seq: u64,
    segment: u64,
    offset: u64,
    /// `QueueLog::reads` when it was last moved.
    used: u64,
}

pub(crate) struct QueueLog {
    pub id: u64,
    disk: Disk,
    dir: PathBuf,
    /// `dir` was created (or found) since this log was opened: a new segment need not make it again
    /// (a `mkdir` that fails with EEXIST cost ~0.2 ms; 1,000 Raft logs create segments often).
    dir_made: bool,
    wal_dir: PathBuf,
    pub segments: BTreeMap<u64, QSeg>,
    /// Append handle of the newest segment.
    active: Option<Appender>,
    /// Records copied in but not yet written to `active`.
    pending: Vec<u8>,
    /// (seq after, timestamp) of the last record in `pending`.
    pending_end: Option<(u64, u64)>,
    /// Seq after the last enqueue applied.
    pub next_seq: u64,
    /// Enqueues applied since the last checkpoint, still only in the WAL (and here, in memory): they
    /// are written to the queue's files at the next checkpoint only if still live then, so a queue whose
    /// consumers keep up never writes its messages twice.
    tail: VecDeque<TailRecord>,
    /// Seq after the last record the files account for: seqs from here on are in `tail` or gone.
    file_next_seq: u64,
    pub gone: GoneSet,
    /// Seq ranges rewinds made live since the queue last took them (`Store::take_rewound`).
    rewound: Vec<(u64, u64)>,
    /// Payload bytes of the live messages.
    pub live_bytes: u64,
    pub retention_ms: u64,
    /// The highest delivered mark (`Record::Delivered`) applied.
    pub delivered_until: u64,
    /// Written to since the last checkpoint.
    pub dirty: bool,
    /// When the last enqueue was applied (wall clock, ms).
    last_enqueue_ms: u64,
    /// Read handle of one segment.
    reader: Option<SegReader>,
    /// Where in-order reads left off, with when each was last used. A read at or after one
    /// continues from there instead of walking its segment from the start. Several, so that readers
    /// that take turns in different parts of the log each keep theirs: a quorum queue's two reads
    /// ahead of its consumers over its Raft log, a classic queue's rewound range and its span.
    /// (With one, each turn of one sent the other back to its segment's start: draining a rewound
    /// quorum queue read and checksummed its log's segment again for each entry.)
    cursors: [Option<Cursor>; CURSORS],
    /// Counts reads, to find the cursor used longest ago.
    reads: u64,
    /// Segments read for a rewrite and found not sparse enough by bytes: (first seq → gone count
    /// then), not read again until more of them is gone.
    compact_judged: HashMap<u64, u64>,
}

impl QueueLog {
    pub fn new(disk: &Disk, root: &Path, id: u64) -> QueueLog {
        QueueLog {
            id,
            disk: disk.clone(),
            dir: queue_dir(root, id),
            dir_made: false,
            wal_dir: crate::segment::wal_dir(root),
            segments: BTreeMap::new(),
            active: None,
            pending: Vec::new(),
            pending_end: None,
            next_seq: 0,
            tail: VecDeque::new(),
            file_next_seq: 0,
            gone: GoneSet::new(0),
            rewound: Vec::new(),
            live_bytes: 0,
            retention_ms: 0,
            delivered_until: 0,
            dirty: false,
            last_enqueue_ms: 0,
            reader: None,
            cursors: [None; CURSORS],
            reads: 0,
            compact_judged: HashMap::new(),
        }
    }

    /// Messages `from..seg.end_seq` of `seg` are lost (their bytes are gone): they become gone, and
    /// their bytes (estimated from the segment's average) leave `live_bytes`. Returns how many were
    /// live.
    fn lose(&mut self, seg: &QSeg, from: u64) -> u64 {
        let messages = self.gone.insert(from.max(seg.first_seq), seg.end_seq);
        let per_message = seg.len.saturating_sub(seg.start) / seg.end_seq.saturating_sub(seg.first_seq).max(1);
        self.live_bytes = self.live_bytes.saturating_sub(messages.saturating_mul(per_message));
        messages
    }

    pub fn live_count(&self) -> u64 {
        let floor = self.gone.floor();
        (self.next_seq.saturating_sub(floor)).saturating_sub(self.gone.count_in(floor, self.next_seq))
    }

    /// Accounts for enqueue `seq`. Seqs the queue skipped (messages it never stored) become gone. A seq
    /// below the next one cannot be kept: the files hold a queue's records in seq order and every seq
    /// below `next_seq` is already stored or counted gone. That is a bug in the caller (which must append
    /// a queue's seqs in increasing order), never a case to handle quietly: the callers log it loudly.
    fn admit(&mut self, seq: u64, payload_len: usize, now_ms: u64) -> Result<(), SeqRegression> {
        if seq < self.next_seq {
            return Err(SeqRegression { queue: self.id, seq, next_seq: self.next_seq });
        }
        if seq > self.next_seq {
            self.gone.insert(self.next_seq, seq);
        }
        self.next_seq = seq + 1;
        // Saturating: the count starts from the checkpoint, whose damage the CRC may have missed.
        self.live_bytes = self.live_bytes.saturating_add(payload_len as u64);
        self.dirty = true;
        self.last_enqueue_ms = now_ms;
        Ok(())
    }

    /// Keeps an enqueue record that is durable in the WAL in memory until the next checkpoint (see `tail`).
    /// Refuses (keeps nothing of) an enqueue below the queue's next seq: see `admit`.
    #[allow(clippy::too_many_arguments)]
    pub fn push_tail(&mut self, record: Bytes, wal: WalPlace, follows_own: bool, seq: u64, timestamp_ms: u64, payload_len: usize, now_ms: u64) -> Result<(), SeqRegression> {
        self.admit(seq, payload_len, now_ms)?;
        self.tail.push_back(TailRecord { seq, timestamp_ms, record, wal, follows_own });
        Ok(())
    }

    /// Writes one enqueue record (as encoded in the WAL) straight into the queue's files (recovery). An
    /// enqueue below the queue's next seq (see `admit`) is logged as an error and not applied.
    pub fn append(&mut self, record: &[u8], seq: u64, timestamp_ms: u64, payload_len: usize, seg_size: u64) -> std::io::Result<()> {
        if let Err(regression) = self.admit(seq, payload_len, crate::now_ms()) {
            tracing::error!(queue = self.id, seq, next_seq = regression.next_seq, "{regression}");
            return Ok(());
        }
        self.write_record(record, seq, timestamp_ms, seg_size)?;
        self.file_next_seq = self.next_seq;
        Ok(())
    }

    /// Checkpoint: makes the tail's still-live records part of the queue's segments. A run of this
    /// queue's records in one WAL segment with no other queue's message in between (acks and other
    /// non-message records may be) that spans at least `MIN_EXTENT` from its first to its last live
    /// record (the queue is behind: nothing consumed them) becomes an extent of that WAL segment, and
    /// nothing is written: a backlog is written once. So does a Raft group's log or state run of any
    /// length (`MAX_RAFT_EXTENTS`). Elsewhere the live records are copied into the queue's own
    /// files, so that a slow queue never keeps another queue's messages on disk. Returns bytes
    /// written.
    pub fn spill(&mut self, now_ms: u64, seg_size: u64) -> std::io::Result<u64> {
        let mut written = 0;
        while let Some(head) = self.tail.front() {
            let base = head.wal.base;
            let run = 1 + self.tail.iter().skip(1).take_while(|r| r.wal.base == base && r.follows_own).count();
            let kept = |r: &TailRecord| self.keeps(r, now_ms);
            let first = self.tail.iter().take(run).position(kept);
            let last = self.tail.iter().take(run).rposition(kept);
            if let (Some(first), Some(last)) = (first, last) {
                let (a, b) = (&self.tail[first], &self.tail[last]);
                let (start, end) = (a.wal.offset, b.wal.offset + b.record.len() as u64);
                let (first_seq, end_seq, first_ts, last_ts) = (a.seq, b.seq + 1, a.timestamp_ms, b.timestamp_ms);
                let raft_extent = crate::is_raft_queue(self.id) && self.segments.len() < MAX_RAFT_EXTENTS;
                if end.saturating_sub(start) >= MIN_EXTENT || raft_extent {
                    // Later copied records must go to a new file after this extent, in seq order.
                    self.flush()?;
                    self.active = None;
                    let seg = QSeg { first_seq, start, len: end, end_seq, first_ts, last_ts, wal: Some(base) };
                    self.segments.insert(first_seq, seg);
                    self.tail.drain(..run);
                    continue;
                }
            }
            for rec in self.tail.drain(..run).collect::<Vec<_>>() {
                if self.keeps(&rec, now_ms) {
                    self.write_record(&rec.record, rec.seq, rec.timestamp_ms, seg_size)?;
                    written += rec.record.len() as u64;
                }
            }
        }
        self.flush()?;
        // Between checkpoints a queue's write buffers are idle: a thousand queues keeping ~384 KiB each
        // (pending records and the direct-write buffer) came to hundreds of MB.
        self.pending = Vec::new();
        if let Some(f) = self.active.as_mut() {
            f.shrink_to(0);
        }
        self.file_next_seq = self.next_seq;
        Ok(written)
    }

    /// Whether `spill` keeps a tail record: it is live, or consumed but within the queue's
    /// retention (a rewind may deliver it again). A message acked before the next checkpoint (the
    /// usual case) is otherwise never written out, and its WAL segment goes after the checkpoint.
    fn keeps(&self, rec: &TailRecord, now_ms: u64) -> bool {
        !self.gone.contains(rec.seq) || self.retains(rec.timestamp_ms, now_ms)
    }

    /// Whether consumed messages enqueued at `timestamp_ms` are still within the queue's retention.
    fn retains(&self, timestamp_ms: u64, now_ms: u64) -> bool {
        self.retention_ms > 0 && timestamp_ms.saturating_add(self.retention_ms) > now_ms
    }

    /// Whether every seq of `seg` is gone (consumed, or never stored).
    fn all_gone(&self, seg: &QSeg) -> bool {
        self.gone.count_in(seg.first_seq, seg.end_seq) == seg.end_seq - seg.first_seq
    }

    /// Checkpoint, after `spill`: rewrites sparse segments (see `COMPACT_LIVE_PERCENT`) but the
    /// newest, reading at most `budget` bytes of them. A rewritten segment's live records go, in
    /// order and with their seqs, to a new file of the queue's own named by the segment's first seq
    /// (an extent) or its first live seq (an own file, whose name the last checkpoint still uses:
    /// the new file must not overwrite it; one whose first record is live is left as it is). The
    /// checkpoint's `syncfs` makes the new files durable before the checkpoint names them; a crash
    /// before it leaves them as files no checkpoint names, which a start deletes.
    pub fn compact(&mut self, now_ms: u64, seg_size: u64, budget: &mut u64) -> std::io::Result<Compacted> {
        // (Own files are at most `seg_size`: with small ones, a smaller span is worth it.)
        let min_span = COMPACT_MIN_SPAN.min(seg_size / 2);
        let mut out = Compacted::default();
        let floor = self.gone.floor();
        let newest = self.segments.keys().next_back().copied();
        let candidates: Vec<QSeg> = self.segments.values().filter(|s| Some(s.first_seq) != newest).copied().collect();
        self.compact_judged.retain(|first, _| candidates.iter().any(|s| s.first_seq == *first));
        for seg in candidates {
            let span = seg.len.saturating_sub(seg.start);
            let retained = self.retains(seg.last_ts, now_ms);
            let from = seg.first_seq.max(floor);
            if *budget == 0 || span < min_span || retained || from >= seg.end_seq {
                continue;
            }
            let total = seg.end_seq - from;
            let gone = self.gone.count_in(from, seg.end_seq);
            let live = total - gone.min(total);
            if live == 0 || u128::from(live) * 100 > u128::from(total) * u128::from(COMPACT_LIVE_PERCENT) || self.compact_judged.get(&seg.first_seq) == Some(&gone) {
                continue; // all gone (garbage collection's), dense, or judged already
            }
            *budget = budget.saturating_sub(span);
            let Some(found) = self.live_records(&seg)? else { continue };
            let key = if seg.wal.is_some() { seg.first_seq } else { found.first_seq };
            let sparse = found.bytes.len() as u128 * 100 <= u128::from(span) * u128::from(COMPACT_LIVE_PERCENT);
            if !sparse || (seg.wal.is_none() && key == seg.first_seq) || found.bytes.is_empty() {
                self.compact_judged.insert(seg.first_seq, gone);
                continue;
            }
            if !self.dir_made {
                self.disk.create_dir_all(&self.dir)?;
                self.dir_made = true;
            }
            let mut file = Appender::create(&self.disk, &seg_path(&self.dir, key))?;
            let mut bytes = format::encode_qseg_header(self.id, key).to_vec();
            bytes.extend_from_slice(&found.bytes);
            file.append(&bytes)?;
            let len = bytes.len() as u64;
            out.bytes_written += len;
            if seg.wal.is_none() {
                out.obsolete.push(seg_path(&self.dir, seg.first_seq));
            }
            self.forget_segment(&seg);
            let replacement = QSeg { first_seq: key, start: HEADER_SIZE as u64, len, end_seq: seg.end_seq, first_ts: found.first_ts, last_ts: found.last_ts, wal: None };
            self.segments.insert(key, replacement);
            self.dirty = true;
        }
        Ok(out)
    }

    /// The live records of `seg`, read whole; `None` if it holds damage (left for a read to find
    /// and report).
    fn live_records(&mut self, seg: &QSeg) -> std::io::Result<Option<LiveRecords>> {
        let mut out = LiveRecords { bytes: Vec::new(), first_seq: seg.end_seq, first_ts: 0, last_ts: 0 };
        let mut own_next = seg.first_seq;
        let mut offset = seg.start;
        while offset < seg.len {
            let chunk = self.pread(seg, offset, (seg.len - offset).min(4 << 20) as usize, false)?;
            let mut pos = 0usize;
            while pos < chunk.len() {
                match format::decode_record(&chunk[pos..]) {
                    Ok((Record::Enqueue { queue, seq, timestamp_ms, .. }, n)) if queue == self.id && seq < seg.end_seq => {
                        if seq >= own_next && !self.gone.contains(seq) {
                            if out.bytes.is_empty() {
                                out.first_seq = seq;
                                out.first_ts = timestamp_ms;
                            }
                            out.last_ts = out.last_ts.max(timestamp_ms);
                            out.bytes.extend_from_slice(&chunk[pos..pos + n]);
                        }
                        own_next = own_next.max(seq + 1);
                        pos += n;
                    }
                    Ok((_, n)) => pos += n,
                    Err(format::Damage::LengthPastEof { .. } | format::Damage::RecordHeaderTruncated { .. }) if pos > 0 => break,
                    Err(_) => return Ok(None),
                }
            }
            if pos == 0 {
                return Ok(None);
            }
            offset += pos as u64;
        }
        Ok(Some(out))
    }

    /// Takes `seg` out of the segments (its file, if it is one, stays): reads no longer go to it.
    fn forget_segment(&mut self, seg: &QSeg) {
        self.segments.remove(&seg.first_seq);
        if self.reader.as_ref().is_some_and(|r| r.file_of == SegFile::of(seg)) {
            self.reader = None;
        }
        for c in &mut self.cursors {
            *c = c.filter(|c| c.segment != seg.first_seq);
        }
        self.compact_judged.remove(&seg.first_seq);
    }

    /// This queue's extents: (WAL segment base, start offset, end offset).
    pub fn extents(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.segments.values().filter_map(|s| s.wal.map(|base| (base, s.start, s.len)))
    }

    fn write_record(&mut self, record: &[u8], seq: u64, timestamp_ms: u64, seg_size: u64) -> std::io::Result<()> {
        let full = self.segments.values().next_back().is_none_or(|last| last.wal.is_some() || last.len + self.pending.len() as u64 >= seg_size);
        if self.active.is_none() || full {
            self.flush()?;
            self.create_segment(seq)?;
        }
        self.pending.extend_from_slice(record);
        self.pending_end = Some((seq + 1, timestamp_ms));
        if self.pending.len() >= FLUSH_AT {
            self.flush()?;
        }
        Ok(())
    }

    fn create_segment(&mut self, first_seq: u64) -> std::io::Result<()> {
        if !self.dir_made {
            self.disk.create_dir_all(&self.dir)?;
            self.dir_made = true;
        }
        let path = seg_path(&self.dir, first_seq);
        let mut f = Appender::create(&self.disk, &path)?;
        f.append(&format::encode_qseg_header(self.id, first_seq))?;
        self.segments.insert(
            first_seq,
            QSeg { first_seq, start: HEADER_SIZE as u64, len: HEADER_SIZE as u64, end_seq: first_seq, first_ts: 0, last_ts: 0, wal: None },
        );
        self.active = Some(f);
        Ok(())
    }

    /// Writes what `append` buffered; only then do readers see it (`len`, `end_seq`).
    pub fn flush(&mut self) -> std::io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if let Some(f) = self.active.as_mut() {
            f.append(&self.pending)?;
        }
        let own_last = self.segments.values_mut().next_back().filter(|s| s.wal.is_none());
        if let (Some(last), Some((end_seq, ts))) = (own_last, self.pending_end.take()) {
            if last.end_seq == last.first_seq {
                last.first_ts = first_timestamp(&self.pending).unwrap_or(ts);
            }
            last.len += self.pending.len() as u64;
            last.end_seq = end_seq;
            last.last_ts = last.last_ts.max(ts);
        }
        self.pending.clear();
        // A thousand queues must not each keep a burst's worth of buffer.
        if self.pending.capacity() > 2 * FLUSH_AT {
            self.pending.shrink_to(FLUSH_AT);
        }
        if let Some(f) = self.active.as_mut() {
            f.shrink_to(2 * FLUSH_AT);
        }
        Ok(())
    }

    /// Marks `[start, end)` gone, `bytes` being their payload bytes.
    pub fn ack(&mut self, start: u64, end: u64, bytes: u64) {
        self.gone.insert(start, end.min(self.next_seq));
        self.live_bytes = self.live_bytes.saturating_sub(bytes);
        self.dirty = true;
    }

    /// A rewind: the gone seqs of `[from, until)` still on disk (in a segment's seq range, or a record
    /// of the tail) are live again, so reads return them and nothing lets them go. Applied by the
    /// writer and by replay alike, from the same state: replay lets nothing go (see
    /// `QueueLogs::apply_gone`), so a rewind that was answered finds the same seqs after a crash. A seq in a
    /// segment's range that was never stored (a store error at publish) becomes live without a record:
    /// `read` finds it missing and makes it gone again (`ReadBatch::holes`). Live bytes grow by an
    /// estimate (each segment's average). Returns how many seqs became live.
    pub fn rewind(&mut self, from: u64, until: u64) -> std::io::Result<u64> {
        self.flush()?;
        let until = until.min(self.next_seq);
        if from >= until {
            return Ok(0);
        }
        let mut made_live = Vec::new();
        let overlapping: Vec<QSeg> = self.segments.range(..until).map(|(_, s)| *s).filter(|s| s.end_seq > from).collect();
        for seg in overlapping {
            let per_message = seg.len.saturating_sub(seg.start) / seg.end_seq.saturating_sub(seg.first_seq).max(1);
            for (a, b) in self.gone.remove(from.max(seg.first_seq), until.min(seg.end_seq)) {
                self.live_bytes = self.live_bytes.saturating_add((b - a).saturating_mul(per_message));
                push_merged(&mut made_live, a, b);
            }
        }
        let tail_live: Vec<(u64, u64)> = self
            .tail
            .iter()
            .filter(|r| (from..until).contains(&r.seq) && r.seq >= self.file_next_seq && self.gone.contains(r.seq))
            .map(|r| (r.seq, r.payload().len() as u64))
            .collect();
        for (seq, bytes) in tail_live {
            self.gone.remove(seq, seq + 1);
            self.live_bytes = self.live_bytes.saturating_add(bytes);
            push_merged(&mut made_live, seq, seq + 1);
        }
        let count = made_live.iter().map(|(a, b)| b - a).sum();
        if count > 0 {
            self.dirty = true;
        }
        self.rewound.extend(made_live);
        Ok(count)
    }

    /// The seq ranges rewinds made live since the last call, in order of the rewinds.
    pub fn take_rewound(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.rewound)
    }

    /// Live seqs `[from, to)` that a read found without a record (see `rewind`): gone now.
    fn holes_found(&mut self, from: u64, to: u64, out: &mut ReadBatch) {
        if from < to {
            out.holes += self.gone.insert(from, to);
            self.dirty = true;
        }
    }

    /// The consumed messages kept for the queue's retention, and the oldest message's time; zero
    /// without retention. Counts segment by segment (and the tail's records), not message by message.
    pub fn retention_stats(&self) -> RetentionStats {
        if self.retention_ms == 0 {
            return RetentionStats::default();
        }
        let in_segments: u64 = self.segments.values().map(|seg| self.gone.count_in(seg.first_seq, seg.end_seq)).sum();
        let in_tail = self.tail.iter().filter(|r| self.gone.contains(r.seq)).count() as u64;
        let oldest_ms = match self.segments.values().next() {
            Some(seg) if seg.end_seq > seg.first_seq => Some(seg.first_ts),
            _ => self.tail.front().map(|r| r.timestamp_ms),
        };
        RetentionStats { consumed: in_segments + in_tail, oldest_ms }
    }

    /// When the first consumed segment held only for the queue's retention may go (unix ms): nothing
    /// else dirties a quiet store, so the writer checkpoints then to let it go (see `collect_garbage`).
    /// One whose retention ended but that `collect_garbage` kept (the newest, small and in use) may
    /// go once the queue has been idle `keep_active_idle_ms`.
    pub fn retention_ends_at(&self, now_ms: u64, keep_active_idle_ms: u64) -> Option<u64> {
        if self.retention_ms == 0 {
            return None;
        }
        self.segments
            .values()
            .filter(|seg| self.all_gone(seg))
            .map(|seg| match seg.last_ts.saturating_add(self.retention_ms) {
                ended if ended <= now_ms => self.last_enqueue_ms.saturating_add(keep_active_idle_ms),
                ends => ends,
            })
            .filter(|&at| at > now_ms)
            .min()
    }

    /// Deletes segments whose seqs are all gone and whose retention has passed; the newest one only if
    /// `newest_too` (at checkpoints, not on every ack). Returns (bytes, files) freed.
    pub fn collect_garbage(&mut self, now_ms: u64, newest_too: bool, keep_active_idle_ms: u64) -> (u64, u64) {
        let floor = self.gone.floor();
        let mut freed = 0;
        let mut files = 0;
        loop {
            let Some((_, seg)) = self.segments.iter().next() else { break };
            let newest = self.segments.len() == 1;
            let all_gone = if newest { self.next_seq <= floor } else { seg.end_seq <= floor };
            // A small newest segment in use stays: deleting and recreating it for every checkpoint of a
            // busy queue costs file-system metadata work (a thousand queues: thousands of files a second).
            let busy = now_ms.saturating_sub(self.last_enqueue_ms) < keep_active_idle_ms;
            let small_own = seg.wal.is_none() && seg.len < KEEP_ACTIVE_BELOW;
            if newest && all_gone && (!newest_too || (busy && small_own)) {
                break;
            }
            if !all_gone || self.retains(seg.last_ts, now_ms) {
                break;
            }
            let seg = *seg;
            match self.remove_segment(&seg, newest) {
                Some(n) => {
                    freed += n;
                    files += u64::from(seg.wal.is_none());
                }
                None => break,
            }
        }
        if newest_too {
            // At checkpoints also segments further on whose seqs are all gone (out-of-order acks, or a
            // slow first message): an extent in the middle must not pin its WAL segment.
            let middle: Vec<QSeg> = self.segments.values().rev().skip(1).copied().collect();
            for seg in middle {
                if self.all_gone(&seg) && !self.retains(seg.last_ts, now_ms) {
                    if let Some(n) = self.remove_segment(&seg, false) {
                        freed += n;
                        files += u64::from(seg.wal.is_none());
                    }
                }
            }
        }
        (freed, files)
    }

    /// Deletes a segment's file (or lets go of an extent: the checkpoint deletes WAL segments no extent
    /// is in). Returns the bytes freed, `None` if the file could not be deleted.
    fn remove_segment(&mut self, seg: &QSeg, newest: bool) -> Option<u64> {
        let mut freed = 0;
        if seg.wal.is_none() {
            if newest {
                // Pending records would be for seqs >= next_seq, so there are none; close before unlinking.
                self.active = None;
            }
            if let Err(e) = self.disk.remove_file(&seg_path(&self.dir, seg.first_seq)) {
                tracing::warn!(error = %e, queue = self.id, "could not delete a consumed queue segment; will retry");
                return None;
            }
            freed = seg.len;
        }
        self.forget_segment(seg);
        self.dirty = true;
        Some(freed)
    }

    /// The cursor a read of `seq` in segment `segment` continues from: the one in that segment
    /// closest below it, else the one used longest ago (to be replaced).
    fn cursor_for(&mut self, segment: u64, seq: u64) -> usize {
        self.reads += 1;
        let closest = (0..CURSORS)
            .filter(|&i| self.cursors[i].is_some_and(|c| c.segment == segment && c.seq <= seq))
            .max_by_key(|&i| self.cursors[i].map_or(0, |c| c.seq));
        closest.unwrap_or_else(|| (0..CURSORS).min_by_key(|&i| self.cursors[i].map_or(0, |c| c.used)).unwrap_or(0))
    }

    /// Reads live messages of `seqs` in order: at most `max_count` of them and about `max_bytes` of
    /// payload. `direct`: past the page cache (`direct::open_direct_reader`), for reads off the
    /// delivery path.
    pub fn read(&mut self, seqs: std::ops::Range<u64>, max_count: usize, max_bytes: usize, direct: bool) -> std::io::Result<ReadBatch> {
        let (from_seq, end_seq) = (seqs.start, seqs.end);
        let mut out = ReadBatch { next_seq: self.gone.next_live(from_seq), ..Default::default() };
        let mut bytes = 0usize;
        while out.messages.len() < max_count && bytes < max_bytes && out.next_seq < self.file_next_seq && out.next_seq < end_seq {
            let seq = out.next_seq;
            let Some((&first, &seg)) = self.segments.range(..=seq).next_back() else {
                // Below the oldest segment: all gone; continue at the oldest one.
                match self.segments.keys().next() {
                    Some(&f) if f > seq => {
                        out.next_seq = self.gone.next_live(f);
                        continue;
                    }
                    _ => break,
                }
            };
            if seq >= seg.end_seq {
                // Past this segment's records: on to the next one (or nothing more is written yet).
                match self.segments.range(seq + 1..).next() {
                    Some((&next_first, _)) => {
                        out.next_seq = self.gone.next_live(next_first);
                        continue;
                    }
                    None => break,
                }
            }
            // Every record of ours before `offset` has a seq below `own_next`.
            let slot = self.cursor_for(first, seq);
            let (offset, mut own_next) = match self.cursors[slot] {
                Some(c) if c.segment == first && c.seq <= seq => (c.offset, c.seq),
                _ => (seg.start, seg.first_seq),
            };
            if offset >= seg.len {
                // Every record of the segment is behind us (its length and end seq move together at a
                // flush): the live seqs left in its range have none.
                self.holes_found(seq, seg.end_seq, &mut out);
                out.next_seq = self.gone.next_live(seg.end_seq);
                continue;
            }
            let want = (max_bytes - bytes).clamp(64 << 10, 4 << 20) as u64;
            let mut chunk = self.pread(&seg, offset, want.min(seg.len - offset) as usize, direct)?;
            out.bytes_read += chunk.len() as u64;
            // A chunk must hold at least one whole record: read again if the first one is longer.
            let first_len = RECORD_HEADER_SIZE as u64 + u64::from(u32::from_le_bytes(format::array(&chunk, 0)));
            // (A length past the format's limit is damage, which the decode below reports: reading
            // it would allocate whatever a damaged header says, up to 4 GiB.)
            let plausible = first_len <= (RECORD_HEADER_SIZE + format::MAX_BODY_LEN) as u64;
            if first_len > chunk.len() as u64 && plausible && offset + first_len <= seg.len {
                chunk = self.pread(&seg, offset, first_len as usize, direct)?;
                out.bytes_read += chunk.len() as u64;
            }
            let mut pos = 0usize;
            // An empty chunk (the file ends before the segment does: cut or damaged on disk) is decoded
            // too, as damage at `offset`; skipping it would read the same nothing again forever.
            while pos < chunk.len() || pos == 0 {
                match format::decode_record(&chunk[pos..]) {
                    Ok((Record::Enqueue { queue, seq: rseq, timestamp_ms, payload }, n)) if queue == self.id && rseq < seg.end_seq => {
                        if rseq >= end_seq && rseq >= own_next {
                            // Past the range: the cursor stays at this record, where the read of the
                            // next range starts. Live seqs before it have no record (see below).
                            if rseq > out.next_seq && out.next_seq >= seq {
                                let from = out.next_seq;
                                self.holes_found(from, rseq, &mut out);
                            }
                            out.next_seq = rseq;
                            break;
                        }
                        let start = pos + RECORD_HEADER_SIZE + format::ENQUEUE_FIXED_LEN;
                        pos += n;
                        if rseq < own_next {
                            // Below a record of ours before it in this segment: the store never writes
                            // that (appends refuse a seq regression), so it is damage a checksum did not
                            // catch. Never returned: reads hand out seqs in rising order.
                            if rseq >= seq {
                                tracing::error!(queue = self.id, segment = first, offset = offset + pos as u64 - n as u64, seq = rseq, after = own_next - 1,
                                    "a record out of seq order in a queue segment is skipped");
                            }
                            self.cursors[slot] = Some(Cursor { seq: own_next, segment: first, offset: offset + pos as u64, used: self.reads });
                            continue;
                        }
                        own_next = rseq + 1;
                        self.cursors[slot] = Some(Cursor { seq: own_next, segment: first, offset: offset + pos as u64, used: self.reads });
                        if rseq < seq {
                            // Before where this read starts: `next_seq` must not go back to it, or the
                            // next chunk would continue from here.
                            continue;
                        }
                        if rseq > out.next_seq {
                            // Records come in seq order: the live seqs passed have none.
                            let from = out.next_seq;
                            self.holes_found(from, rseq, &mut out);
                        }
                        out.next_seq = self.gone.next_live(rseq + 1);
                        if self.gone.contains(rseq) {
                            continue;
                        }
                        bytes += payload.len();
                        out.messages.push(StoredMessage {
                            seq: rseq,
                            timestamp_ms,
                            payload: chunk.slice(start..start + payload.len()),
                        });
                        if out.messages.len() >= max_count || bytes >= max_bytes {
                            break;
                        }
                    }
                    Ok((_, n)) => {
                        // Another queue's record or an ack inside a WAL extent (own files hold only this
                        // queue's enqueues).
                        pos += n;
                        self.cursors[slot] = Some(Cursor { seq: own_next, segment: first, offset: offset + pos as u64, used: self.reads });
                    }
                    Err(format::Damage::LengthPastEof { .. } | format::Damage::RecordHeaderTruncated { .. })
                        if pos > 0 && offset + (pos as u64) < seg.len =>
                    {
                        break; // the chunk ended inside a record: the next round reads on from there
                    }
                    Err(damage) => {
                        let lost_from = seq.max(out.next_seq);
                        let lost = seg.end_seq.saturating_sub(lost_from).saturating_sub(self.gone.count_in(lost_from, seg.end_seq));
                        let at = offset + pos as u64;
                        let kept = self.keep_damaged(&seg, at);
                        tracing::error!(queue = self.id, segment = first, offset = at, %damage, lost, kept = %kept,
                            "damaged record in a queue segment; the rest of the segment is skipped");
                        self.gone.insert(lost_from, seg.end_seq);
                        out.lost += lost;
                        out.next_seq = self.gone.next_live(seg.end_seq);
                        for c in &mut self.cursors {
                            *c = c.filter(|c| c.segment != first);
                        }
                        break;
                    }
                }
            }
        }
        // Everything live below `file_next_seq` is in the files; the rest is in the tail, in memory.
        if out.messages.len() < max_count && bytes < max_bytes && out.next_seq < end_seq {
            let from = out.next_seq.max(self.file_next_seq);
            let start = self.tail.partition_point(|r| r.seq < from);
            out.next_seq = self.gone.next_live(from);
            for rec in self.tail.iter().skip(start) {
                if out.messages.len() >= max_count || bytes >= max_bytes || rec.seq >= end_seq {
                    break;
                }
                out.next_seq = self.gone.next_live(rec.seq + 1);
                if self.gone.contains(rec.seq) {
                    continue;
                }
                let payload = rec.payload();
                bytes += payload.len();
                // A copy: a slice would pin the writer's whole group buffer for as long as the message lives.
                out.messages.push(StoredMessage { seq: rec.seq, timestamp_ms: rec.timestamp_ms, payload: Bytes::copy_from_slice(payload) });
            }
        }
        Ok(out)
    }

    /// Copies the bytes of `seg` from the damaged record at `offset` on into `damaged/`, before the
    /// segment is let go with its seqs counted as gone. Returns where (or why not) for the log.
    fn keep_damaged(&mut self, seg: &QSeg, offset: u64) -> String {
        let (path, name) = match seg.wal {
            Some(base) => {
                let path = crate::segment::path(&self.wal_dir, base);
                let name = crate::damaged::aside_name(&path, offset);
                (path, name)
            }
            None => {
                let path = seg_path(&self.dir, seg.first_seq);
                let name = format!("queue-{}-{}", self.id, crate::damaged::aside_name(&path, offset));
                (path, name)
            }
        };
        let root = self.wal_dir.parent().map(Path::to_path_buf).unwrap_or_default();
        let result = crate::direct::open_reader(&path)
            .and_then(|f| {
                // Only what the file holds: the segment's recorded end can lie past it (a file cut short,
                // a damaged checkpoint claiming any length), and read_range allocates what it is asked.
                let end = seg.len.min(f.metadata()?.len());
                crate::direct::read_range(&f, offset, end.saturating_sub(offset) as usize)
            })
            .map_err(|e| e.to_string())
            .and_then(|bytes| crate::damaged::copy_aside(&self.disk, &root, &name, &bytes).map_err(|e| e.to_string()));
        match result {
            Ok(Some(kept)) => kept.display().to_string(),
            Ok(None) => "not kept: no room".to_owned(),
            Err(e) => format!("not kept: {e}"),
        }
    }

    fn pread(&mut self, seg: &QSeg, offset: u64, len: usize, direct: bool) -> std::io::Result<Bytes> {
        if self.reader.as_ref().is_none_or(|r| r.file_of != SegFile::of(seg) || r.asked_direct != direct) {
            let path = match seg.wal {
                Some(base) => crate::segment::path(&self.wal_dir, base),
                None => seg_path(&self.dir, seg.first_seq),
            };
            let (file, is_direct) = if direct { crate::direct::open_direct_reader(&path)? } else { (crate::direct::open_reader(&path)?, false) };
            self.reader = Some(SegReader { file_of: SegFile::of(seg), asked_direct: direct, is_direct, file });
        }
        match &self.reader {
            Some(r) if r.is_direct => crate::direct::read_range_direct(&r.file, offset, len),
            Some(r) => crate::direct::read_range(&r.file, offset, len),
            None => Ok(Bytes::new()),
        }
    }

    /// The first seq whose message was enqueued at or after `timestamp_ms` (gone ones included, as long as
    /// they are still on disk), or `next_seq` if there is none.
    pub fn seek_time(&mut self, timestamp_ms: u64) -> std::io::Result<u64> {
        Ok(self.first_at_or_after(timestamp_ms)?.map_or(self.next_seq, |(seq, _)| seq))
    }

    /// The first message on disk (gone or not) enqueued at or after `timestamp_ms`: (seq, when).
    pub fn first_at_or_after(&mut self, timestamp_ms: u64) -> std::io::Result<Option<(u64, u64)>> {
        let candidates: Vec<QSeg> = self.segments.values().copied().collect();
        for seg in candidates {
            if seg.last_ts < timestamp_ms {
                continue;
            }
            let data = self.pread(&seg, seg.start, seg.len.saturating_sub(seg.start) as usize, false)?;
            let mut pos = 0;
            while let Ok((record, n)) = format::decode_record(&data[pos..]) {
                if let Record::Enqueue { queue, seq, timestamp_ms: ts, .. } = record {
                    if queue == self.id && ts >= timestamp_ms && seq < seg.end_seq {
                        return Ok(Some((seq, ts)));
                    }
                }
                pos += n;
            }
        }
        Ok(self.tail.iter().find(|r| r.timestamp_ms >= timestamp_ms).map(|r| (r.seq, r.timestamp_ms)))
    }

    /// Removes the queue's files (the queue was deleted).
    pub fn destroy(&mut self) {
        self.tail.clear();
        self.active = None;
        self.reader = None;
        self.segments.clear();
        self.dir_made = false;
        if let Err(e) = self.disk.remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(error = %e, queue = self.id, "could not remove a deleted queue's files");
            }
        }
    }

    /// Restores a log from its checkpointed state: files are cut back to what the checkpoint made durable,
    /// files written after it are removed (the WAL replay writes them again).
    /// Messages the checkpoint listed that the files no longer hold (a queue segment file missing, or
    /// shorter than recorded: the records after the last whole one; a WAL segment holding an extent
    /// missing) become gone, so that nothing reports them live, and are pushed onto `lost` with
    /// their exact count: recovery decides whether to go on.
    pub fn restore(
        disk: &Disk,
        root: &Path,
        state: crate::checkpoint::QueueState,
        lost: &mut Vec<crate::recovery::LostMessages>,
    ) -> std::io::Result<QueueLog> {
        use crate::recovery::LostMessages;
        let mut log = QueueLog::new(disk, root, state.id);
        log.next_seq = state.next_seq;
        log.file_next_seq = state.next_seq;
        log.gone = GoneSet::from_parts(state.floor, state.ranges);
        log.live_bytes = state.live_bytes;
        log.retention_ms = state.retention_ms;
        log.delivered_until = state.delivered_until;
        let on_disk = list_segments(&log.dir)?;
        for first in &on_disk {
            if !state.segments.iter().any(|s| s.first_seq == *first && s.wal.is_none()) {
                disk.remove_file(&seg_path(&log.dir, *first))?;
            }
        }
        for seg in state.segments {
            if let Some(base) = seg.wal {
                // An extent of a WAL segment that the checkpoint made durable; damage shows when it is read.
                let path = crate::segment::path(&log.wal_dir, base);
                if path.exists() {
                    log.segments.insert(seg.first_seq, seg);
                } else {
                    let messages = log.lose(&seg, seg.first_seq);
                    let what = format!("the WAL segment holding messages {}..{} of queue {} is missing", seg.first_seq, seg.end_seq, state.id);
                    lost.push(LostMessages { queue: state.id, file: path, offset: seg.start, messages, what });
                }
                continue;
            }
            let path = seg_path(&log.dir, seg.first_seq);
            let Ok(meta) = fs::metadata(&path) else {
                // Deleted after the checkpoint because every seq in it was gone; or lost.
                let messages = log.lose(&seg, seg.first_seq);
                if messages > 0 {
                    let what = format!("the queue segment file holding messages {}..{} of queue {} is missing, though the checkpoint lists it", seg.first_seq, seg.end_seq, state.id);
                    lost.push(LostMessages { queue: state.id, file: path, offset: 0, messages, what });
                }
                continue;
            };
            let mut seg = seg;
            if meta.len() < seg.len {
                // The records that survived whole stay; those after them are lost.
                let (kept_end, next) = surviving_records(&path, seg.start, meta.len(), seg.first_seq);
                let messages = log.lose(&seg, next);
                let what = format!(
                    "queue segment of queue {} is {} bytes, shorter than the {} the checkpoint recorded; messages {}..{} in the missing part are lost",
                    state.id, meta.len(), seg.len, next, seg.end_seq
                );
                lost.push(LostMessages { queue: state.id, file: path.clone(), offset: kept_end, messages, what });
                disk.open(&path, Open::Existing, false)?.set_len(kept_end)?;
                seg.len = kept_end;
            } else if meta.len() > seg.len {
                disk.open(&path, Open::Existing, false)?.set_len(seg.len)?;
            }
            log.segments.insert(seg.first_seq, seg);
        }
        if let Some(last) = log.segments.values().next_back().filter(|s| s.wal.is_none()) {
            log.active = Some(Appender::open_at(disk, &seg_path(&log.dir, last.first_seq), last.len)?);
        }
        Ok(log)
    }
}

/// In a queue segment file cut short (`len` bytes left), the records from `start` that survived
/// whole: (the offset after the last of them, the seq after it; `first_seq` if none did).
fn surviving_records(path: &Path, start: u64, len: u64, first_seq: u64) -> (u64, u64) {
    let Ok(data) = fs::read(path) else { return (start.min(len), first_seq) };
    let data = &data[..(len as usize).min(data.len())];
    let (mut at, mut next) = (start as usize, first_seq);
    while at < data.len() {
        match format::decode_record(&data[at..]) {
            Ok((Record::Enqueue { seq, .. }, used)) => {
                at += used;
                next = seq + 1;
            }
            _ => break,
        }
    }
    ((at as u64).min(len).max(start.min(len)), next)
}

/// Appends `[a, b)` to ranges in rising order, merged with the last one if they touch.
fn push_merged(ranges: &mut Vec<(u64, u64)>, a: u64, b: u64) {
    match ranges.last_mut() {
        Some(last) if last.1 == a => last.1 = b,
        _ => ranges.push((a, b)),
    }
}

/// The timestamp of the first enqueue record in `buf`.
fn first_timestamp(buf: &[u8]) -> Option<u64> {
    match format::decode_record(buf) {
        Ok((Record::Enqueue { timestamp_ms, .. }, _)) => Some(timestamp_ms),
        _ => None,
    }
}

pub(crate) fn queue_dir(root: &Path, id: u64) -> PathBuf {
    root.join("queues").join(id.to_string())
}

fn seg_path(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(format!("{first_seq:020}.{QSEG_EXT}"))
}

fn list_segments(dir: &Path) -> std::io::Result<Vec<u64>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let name = entry?.file_name();
        if let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(QSEG_EXT)).and_then(|s| s.strip_suffix('.')) {
            if let Ok(n) = stem.parse() {
                out.push(n);
            }
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// All queue logs, by queue id.
pub(crate) struct QueueLogs {
    disk: Disk,
    logs: Mutex<HashMap<u64, Arc<Mutex<QueueLog>>>>,
    /// Something changed since the last checkpoint (acks, drops, retention), so a quiet store still
    /// checkpoints and reclaims disk.
    dirty: AtomicBool,
}

impl QueueLogs {
    pub fn new(disk: &Disk) -> QueueLogs {
        QueueLogs { disk: disk.clone(), logs: Mutex::default(), dirty: AtomicBool::new(false) }
    }

    pub fn any_dirty_hint(&self) -> bool {
        self.dirty.load(Ordering::Relaxed)
    }
    pub fn set_dirty_hint(&self) {
        self.dirty.store(true, Ordering::Relaxed);
    }
    pub fn clear_dirty_hint(&self) {
        self.dirty.store(false, Ordering::Relaxed);
    }

    pub fn get(&self, id: u64) -> Option<Arc<Mutex<QueueLog>>> {
        self.logs.lock().get(&id).cloned()
    }

    pub fn get_or_create(&self, root: &Path, id: u64) -> Arc<Mutex<QueueLog>> {
        self.logs.lock().entry(id).or_insert_with(|| Arc::new(Mutex::new(QueueLog::new(&self.disk, root, id)))).clone()
    }

    pub fn insert(&self, log: QueueLog) {
        self.logs.lock().insert(log.id, Arc::new(Mutex::new(log)));
    }

    pub fn remove(&self, id: u64) -> Option<Arc<Mutex<QueueLog>>> {
        self.logs.lock().remove(&id)
    }

    /// Applies an acks, drop, delivered-mark or rewind record (enqueues go through `QueueLog::push_tail` or
    /// `append`): the WAL replay and the writer thread share this. Returns the (bytes, files) of segments deleted.
    /// `now_ms` None (replay): nothing is let go. A queue created since the last checkpoint has no
    /// retention yet while the WAL is replayed (the broker sets it after the start), and a rewind
    /// further on must find on disk what it found when it was answered, however late the start: the
    /// first checkpoint after it lets go what is consumed.
    pub fn apply_gone(&self, record: Record<'_>, now_ms: Option<u64>, newest_too: bool, keep_active_idle_ms: u64) -> std::io::Result<(u64, u64)> {
        let freed = match record {
            Record::Acks { queue, bytes, ranges } => {
                let Some(log) = self.get(queue) else { return Ok((0, 0)) };
                let mut log = log.lock();
                // Buffered records must be in the file before a segment of it may be deleted.
                log.flush()?;
                let mut first = true;
                for (start, end) in ranges.iter() {
                    log.ack(start, end, if first { bytes } else { 0 });
                    first = false;
                }
                match now_ms {
                    Some(now_ms) => log.collect_garbage(now_ms, newest_too, keep_active_idle_ms),
                    None => (0, 0),
                }
            }
            Record::Delivered { queue, up_to } => {
                if let Some(log) = self.get(queue) {
                    let mut log = log.lock();
                    if up_to > log.delivered_until {
                        log.delivered_until = up_to;
                        log.dirty = true;
                    }
                }
                (0, 0)
            }
            Record::Drop { queue } => {
                if let Some(log) = self.remove(queue) {
                    log.lock().destroy();
                }
                (0, 0)
            }
            Record::Rewind { queue, from, until } => {
                if let Some(log) = self.get(queue) {
                    log.lock().rewind(from, until)?;
                }
                (0, 0)
            }
            Record::Enqueue { .. } | Record::Synced { .. } => return Ok((0, 0)),
        };
        self.set_dirty_hint();
        Ok(freed)
    }

    pub fn all(&self) -> Vec<Arc<Mutex<QueueLog>>> {
        self.logs.lock().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seq_below_the_next_one_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = QueueLog::new(&crate::io::Disk::real(), dir.path(), 7);
        for seq in 0..3 {
            log.admit(seq, 10, 0).unwrap();
        }
        let err = log.admit(1, 10, 0).unwrap_err();
        assert_eq!(err, SeqRegression { queue: 7, seq: 1, next_seq: 3 });
        assert!(err.to_string().contains("out of seq order"), "{err}");
        assert_eq!((log.next_seq, log.live_count(), log.live_bytes), (3, 3, 30));
        // A gap is not a regression: the skipped seqs are gone.
        log.admit(5, 10, 0).unwrap();
        assert_eq!((log.next_seq, log.live_count()), (6, 4));
        assert!(log.gone.contains(3) && log.gone.contains(4) && !log.gone.contains(2));
        assert!(log.admit(5, 10, 0).is_err(), "the same seq twice");
    }
}
