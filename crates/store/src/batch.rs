//! [`Batch`]: the records one caller appends at once, encoded outside the store's lock.

use crate::format::{self, ENQUEUE_FIXED_LEN, MAX_BODY_LEN, RECORD_HEADER_SIZE};
use crate::MsgId;

/// Enqueues and acks to append together (one ticket, one copy into the write buffer).
///
/// Enqueue records are encoded when they are added, so the payload is copied once here and once into the
/// store's buffer; `append` only fills in ids and CRCs. Reuse a batch with [`Batch::clear`] to keep its
/// allocations.
#[derive(Debug, Default)]
pub struct Batch {
    /// Encoded enqueue records, ids and CRCs still zero until `append` seals them.
    pub(crate) records: Vec<u8>,
    pub(crate) enqueues: Vec<Unsealed>,
    pub(crate) acks: Vec<MsgId>,
    /// Encoded acks records, built by `append` outside the lock.
    pub(crate) ack_records: Vec<u8>,
    pub(crate) ids: Vec<MsgId>,
    /// Largest payload added, checked by `append` (enqueue itself cannot fail).
    pub(crate) largest_payload: usize,
}

/// Where an enqueue record sits in `Batch::records`, and the CRC of its queue + payload.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unsealed {
    pub offset: usize,
    pub tail_crc: u32,
    pub tail_len: usize,
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues an enqueue; the payload is given in parts (e.g. header bytes + body) to avoid a concatenation
    /// copy. Returns the index of this enqueue within the batch; after `append`, `batch.ids()[i]` is its MsgId.
    pub fn enqueue(&mut self, queue: u64, payload_parts: &[&[u8]]) -> usize {
        let offset = self.records.len();
        let tail_crc = format::encode_enqueue_unsealed(&mut self.records, queue, payload_parts);
        let body_len = self.records.len() - offset - RECORD_HEADER_SIZE;
        self.largest_payload = self.largest_payload.max(body_len - ENQUEUE_FIXED_LEN);
        self.enqueues.push(Unsealed {
            offset,
            tail_crc,
            tail_len: body_len - 9,
        });
        self.enqueues.len() - 1
    }

    /// Records that message `msg` is gone. Acking an id twice, or one the store does not know, is harmless.
    pub fn ack(&mut self, msg: MsgId) {
        self.acks.push(msg);
    }

    /// The ids assigned to this batch's enqueues by the last `append`, in enqueue order.
    pub fn ids(&self) -> &[MsgId] {
        &self.ids
    }

    pub fn is_empty(&self) -> bool {
        self.enqueues.is_empty() && self.acks.is_empty()
    }

    pub fn clear(&mut self) {
        self.records.clear();
        self.enqueues.clear();
        self.acks.clear();
        self.ack_records.clear();
        self.ids.clear();
        self.largest_payload = 0;
    }

    /// Bytes this batch adds to the log.
    pub(crate) fn encoded_len(&self) -> usize {
        self.records.len() + self.ack_records.len()
    }

    pub(crate) fn max_payload() -> usize {
        MAX_BODY_LEN - ENQUEUE_FIXED_LEN
    }
}
