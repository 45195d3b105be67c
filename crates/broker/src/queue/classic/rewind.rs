//! Rewind of a classic queue with retention (`x-retention-seconds`): the consumed messages it still
//! keeps, published at or after a point in time, are ready again.
//!
//! Nothing is copied. Per lane, the store finds the first message on disk at or after the time
//! (`Store::first_at_or_after`), and one WAL record (`Batch::rewind`) makes the consumed seqs from
//! there up to the span live again (`QueueLog::rewind`). Once that is durable and readable, the
//! queue takes the ranges it made live (`Store::take_rewound`) into the lane's `rewound` set, which
//! counts as ready and is read back range by range before any later message of the window is
//! delivered (`refill_rewound_locked`), so messages keep their publish order, with the redelivered
//! flag set.
//!
//! What is ready or unacked at the rewind is live, not consumed, so it is neither rewound nor
//! duplicated: an unacked message stays with its consumer. A message consumed by the time the
//! record is applied is rewound; one acked after it is not. After a restart the rewound messages are
//! simply live, and the span holds them.

use super::*;
use std::time::Duration;

/// Rewound messages read per read, at most (and about this many bytes): the window may hold this
/// much beyond its budget while a rewind is delivered.
const REWOUND_READ_MESSAGES: usize = 1024;
const REWOUND_READ_BYTES: usize = 4 << 20;

/// How long a rewind waits for the store's writer to apply its record once durable.
const READABLE_WITHIN: Duration = Duration::from_secs(30);

impl Queue {
    /// `Queue::rewind` of a classic queue on this node.
    pub(in crate::queue) async fn classic_rewind(self: &Arc<Self>, c: &Classic, to_ms: u64) -> Result<RewindOutcome> {
        let _one_at_a_time = c.rewinding.lock().await;
        let now = crate::now_ms();
        let oldest_kept = now.saturating_sub(self.args.retention_ms);
        let at = to_ms.max(oldest_kept);
        let store_ids: Vec<u64> = self.store_ids().collect();
        // Off the runtime: a seek reads segments.
        let (store, ids) = (self.store.clone(), store_ids.clone());
        let starts = blocking(move || ids.iter().map(|&id| store.first_at_or_after(id, at)).collect::<std::result::Result<Vec<_>, _>>())
            .await?
            .map_err(|e| BrokerError::internal(format!("could not read queue '{}' from the store to rewind it: {e}", self.name)))?;
        let from_ms = starts.iter().flatten().map(|&(_, ts)| ts).min();
        let clamped = to_ms < oldest_kept && from_ms.is_some();

        let mut batch = Batch::new();
        let epochs = {
            let mut st = c.state.lock();
            if st.deleted {
                return Err(BrokerError::not_found(format!("queue '{}' was deleted", self.name)));
            }
            let mut epochs = Vec::with_capacity(store_ids.len());
            for (level, start) in starts.iter().enumerate() {
                st.select(level);
                // Up to the span: what is there is live, and a rewound range must stay below it.
                let until = if st.span_count > 0 { st.span_from } else { st.next_seq };
                if let Some((from, _)) = *start {
                    if from < until {
                        batch.rewind(st.store_id, from, until);
                    }
                }
                epochs.push(st.span_epoch);
            }
            epochs
        };
        if batch.is_empty() {
            return Ok(RewindOutcome { rewound: 0, from_ms, clamped });
        }
        let ticket = self.store.append(&mut batch).map_err(crate::queue::store_error)?;
        let (store, ids) = (self.store.clone(), store_ids.clone());
        let taken = blocking(move || {
            store.wait_durable(ticket).map_err(|e| e.to_string())?;
            // Applied once readable: the writer applies a record after its group's write.
            if !store.wait_readable(ticket, READABLE_WITHIN) {
                return Err(format!("not applied within {} s", READABLE_WITHIN.as_secs()));
            }
            Ok(ids.iter().map(|&id| store.take_rewound(id)).collect::<Vec<_>>())
        })
        .await?
        .map_err(|e| BrokerError::internal(format!("the rewind of queue '{}' is written but its outcome is unknown (the store: {e}); it takes effect at the latest after a restart", self.name)))?;

        let mut after = AfterUnlock::default();
        let mut rewound = 0;
        {
            let mut st = c.state.lock();
            for (level, ranges) in taken.iter().enumerate() {
                st.select(level);
                let store_id = st.store_id;
                if st.deleted {
                    break; // the store dropped the queue
                }
                if st.span_epoch != epochs[level] {
                    // Purged after the rewind was appended: what it made ready is purged too.
                    for &(start, end) in ranges {
                        after.acks.ack_range(store_id, start, end, 0);
                    }
                    continue;
                }
                st.rewound.add(ranges);
                rewound += ranges.iter().map(|(a, b)| b - a).sum::<u64>();
                self.drop_head_over_limit(&mut st, &mut after);
            }
            self.dispatch_locked(&mut st, crate::now_ms(), &mut after);
        }
        self.finish(after);
        tracing::info!(queue = %self.name, to_ms, ?from_ms, rewound, "queue rewound");
        Ok(RewindOutcome { rewound, from_ms, clamped })
    }

    /// Reads the current lane's lowest rewound range (see `refill_locked`): on a blocking thread when
    /// there is a runtime (then false: the merge continues), else here (true if it made progress).
    pub(super) fn refill_rewound_locked(&self, st: &mut QueueState, after: &mut AfterUnlock) -> bool {
        let Some((start, end)) = st.rewound.first() else { return false };
        let (store_id, epoch) = (st.store_id, st.span_epoch);
        if let (Ok(rt), Some(me)) = (tokio::runtime::Handle::try_current(), self.me.upgrade()) {
            st.refill_in_flight = true;
            rt.spawn_blocking(move || {
                let read = me.read_rewound(store_id, start, end);
                me.refilled_rewound(store_id, start, epoch, read);
            });
            return false;
        }
        let read = self.read_rewound(store_id, start, end);
        self.take_rewound_read(st, after, start, read);
        true
    }

    fn read_rewound(&self, store_id: u64, start: u64, end: u64) -> SpanRead {
        let watermark = *self.store.readable().borrow();
        SpanRead { watermark, read: self.store.read_range(store_id, start..end, REWOUND_READ_MESSAGES, REWOUND_READ_BYTES) }
    }

    /// Merges a read of rewound messages made off the lock, unless the lane was emptied meanwhile
    /// (purge, delete: it acked them), then delivers.
    fn refilled_rewound(self: &Arc<Self>, store_id: u64, start: u64, epoch: u64, read: SpanRead) {
        self.merge_read(store_id, |me, st, after| {
            if st.span_epoch == epoch && st.rewound.first().is_some_and(|(a, _)| a == start) {
                me.take_rewound_read(st, after, start, read);
                me.drop_head_over_limit(st, after);
            }
        });
    }

    /// Puts rewound messages into the window by seq, redelivered; what the read covered leaves the
    /// rewound set (messages the store no longer had, too: see `ReadBatch::holes`).
    fn take_rewound_read(&self, st: &mut QueueState, after: &mut AfterUnlock, start: u64, read: SpanRead) {
        let batch = match read.read {
            Ok(b) => b,
            Err(e) => {
                // Left live in the store: a restart brings them back.
                tracing::error!(queue = %self.name, error = %e, "could not read rewound messages back from the store; skipping them");
                let end = st.rewound.first().map_or(start, |(_, b)| b);
                st.rewound.taken_to(end);
                return;
            }
        };
        let covered = if batch.next_seq > start { batch.next_seq } else { st.rewound.first().map_or(start, |(_, b)| b) };
        st.rewound.taken_to(covered);
        let now = crate::now_ms();
        for m in batch.messages {
            let stored_bytes = m.payload.len() as u64;
            let Some((message, expires_at_ms)) = self.decode_read(st.store_id, &m, after) else { continue };
            if self.lost_to_restart(st, m.seq, &message) {
                after.acks.ack(st.store_id, m.seq, stored_bytes);
                continue;
            }
            if expires_at_ms.is_some_and(|at| at <= now) {
                // Past its TTL: never delivered again, and not dead-lettered a second time (it was
                // when it expired, if it did in the queue).
                after.acks.ack(st.store_id, m.seq, stored_bytes);
                continue;
            }
            let entry = Entry { message, seq: m.seq, stored_bytes, expires_at_ms, redelivered: true, returned: 0 };
            push_ready_sorted(st, entry);
        }
    }
}

/// Runs `f` on a blocking thread (the store's seeks and waits block).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| BrokerError::internal(format!("a rewind's store work failed: {e}")))
}
