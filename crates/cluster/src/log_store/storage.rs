//! openraft's `RaftLogStorage` and `RaftLogReader` for one group, over [`Group`]: the only place the
//! log store meets openraft's traits.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use futures_util::{stream, Stream, TryStreamExt};
use openraft::{OptionalSend, RaftLogReader};

use super::cache::ReadMark;
use super::{Group, Shared};
use crate::types::{Entry, GroupId, LogId, TypeConfig, Vote};

/// Entries a `limited_get_log_entries` reads from the store at most (replication batches).
const LIMITED_READ_BYTES: usize = 8 << 20;

/// Entries `entries_stream` reads from the store at once (the state machine's apply).
const STREAM_CHUNK_BYTES: usize = 4 << 20;

/// One group's Raft log: openraft's `RaftLogStorage` (and its log reader: clones share the group).
#[derive(Clone)]
pub struct LogStore {
    group: Arc<Group>,
    shared: Arc<Shared>,
    /// A reader's: where its last replication read (`limited_get_log_entries`) started.
    mark: Option<Arc<ReadMark>>,
}

impl LogStore {
    pub(crate) fn new(group: Arc<Group>, shared: Arc<Shared>) -> LogStore {
        LogStore { group, shared, mark: None }
    }

    pub fn group_id(&self) -> GroupId {
        self.group.id
    }

    /// The log state now (also what `get_log_state` returns), for status and tests.
    pub fn log_state(&self) -> LogState<TypeConfig> {
        let g = self.group.inner.lock();
        LogState { last_purged_log_id: g.last_purged(), last_log_id: g.last_log_id() }
    }

    fn read(&self, range: impl RangeBounds<u64>, max_bytes: usize) -> io::Result<Vec<Entry>> {
        let (start, end) = bounds(range);
        let read = || self.group.read(&self.shared.store, start, end, max_bytes);
        // Older entries may come from the store's files: let the runtime's other tasks run
        // meanwhile (on a multi-threaded runtime; a current-thread one cannot hand them over).
        let multi_thread = tokio::runtime::Handle::try_current().is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread && self.group.reads_store(&self.shared.store, start, end) {
            tokio::task::block_in_place(read)
        } else {
            read()
        }
    }
}

/// `[start, end)` of a range of indexes.
fn bounds(range: impl RangeBounds<u64>) -> (u64, u64) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => u64::MAX,
    };
    (start, end)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(&mut self, range: RB) -> Result<Vec<Entry>, io::Error> {
        self.read(range, usize::MAX)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.group.inner.lock().vote())
    }

    /// Replication's read (openraft gives each replication stream its own reader).
    async fn limited_get_log_entries(&mut self, start: u64, end: u64) -> Result<Vec<Entry>, io::Error> {
        // The mark is where this read starts, not where it ends: a stream's next read may start
        // again from its follower's matched entry, before entries it already sent (seen with
        // 1,000 busy groups: most store reads were of the entry just before the mark).
        if let Some(mark) = &self.mark {
            mark.set(start);
        }
        self.read(start..end, LIMITED_READ_BYTES)
    }

    /// Committed entries for the state machine, read a chunk at a time: a follower catching up
    /// applies thousands of entries in one go, which need not all be in memory at once.
    async fn entries_stream<RB>(&mut self, range: RB) -> impl Stream<Item = Result<Entry, io::Error>> + OptionalSend
    where
        RB: RangeBounds<u64> + Clone + Debug + OptionalSend,
    {
        let (start, end) = bounds(range);
        let chunks = stream::try_unfold((self.clone(), start), move |(reader, next)| async move {
            if next >= end {
                return Ok::<_, io::Error>(None);
            }
            let chunk = reader.read(next..end, STREAM_CHUNK_BYTES)?;
            // Nothing more: the log ends before `end` (a read never leaves a hole).
            let Some(last) = chunk.last().map(|e| e.log_id.index) else { return Ok(None) };
            Ok(Some((stream::iter(chunk.into_iter().map(Ok)), (reader, last + 1))))
        });
        chunks.try_flatten()
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        Ok(self.log_state())
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        LogStore { mark: Some(self.group.add_reader()), ..self.clone() }
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        let ticket = {
            let queue = self.group.state_queue();
            let mut g = self.group.inner.lock();
            g.save_hard(&self.shared.store, queue, |h| h.vote = Some(*vote))?
        };
        // Durable before returning; the WAL is ordered, so every earlier append of every group is too.
        self.shared.durable(ticket).await
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        let queue = self.group.state_queue();
        let mut g = self.group.inner.lock();
        if g.committed() == committed {
            return Ok(());
        }
        // Not waited for: a committed id lost in a crash is only a shorter re-apply at the next start.
        g.save_hard(&self.shared.store, queue, |h| h.committed = committed).map(|_| ())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.group.inner.lock().committed())
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<TypeConfig>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let ticket = {
            let (log_queue, state_queue) = (self.group.log_queue(), self.group.state_queue());
            let mut g = self.group.inner.lock();
            g.append(&self.shared.store, log_queue, state_queue, self.shared.options.layout_every, entries)?
        };
        self.shared.flusher.when_durable(ticket, callback);
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let (log_queue, state_queue) = (self.group.log_queue(), self.group.state_queue());
        self.group.inner.lock().truncate_after(&self.shared.store, log_queue, state_queue, last_log_id)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        let (log_queue, state_queue) = (self.group.log_queue(), self.group.state_queue());
        self.group.inner.lock().purge(&self.shared.store, log_queue, state_queue, log_id)
    }
}
