//! What time does to a quorum queue's machine: delayed messages coming due, TTL expiry at the head,
//! x-expires, idle publisher sessions, and rewinds to a point in time.

use super::*;

impl QuorumMachine {
    /// Delayed messages due by the machine's clock become ready, in due order (same due: publish
    /// order), each where a message enqueued by this `Tick` would be: its order key is the id the
    /// entry's next message would get (`msg_id(index, next_i)`), above every id enqueued before,
    /// at or below every later one (ties go to the fired message; the keys of one Tick tie, and
    /// `fired` keeps them in order). TTL counts from now, and the length limits apply now, as if
    /// published now (the delayed-message plugin's way): past `x-max-length` with reject-publish
    /// the message is dead-lettered (or dropped) `maxlen`; with drop-head the oldest ready ones go.
    /// Of a queue that dead-letters, at most `max_dead_letters` are made (as `expire_head`: the
    /// rest stay due, for the next Tick); returns how many.
    pub(super) fn fire_due(&mut self, index: u64, next_i: u32, max_dead_letters: u64, out: &mut Out) -> u64 {
        let limited = self.config.max_length.is_some() || self.config.max_length_bytes.is_some();
        let track_sizes = self.config.max_length_bytes.is_some();
        let key = msg_id(index, next_i.min(u16::MAX as u32) as u16);
        let dead_letters = |m: &QuorumMachine| m.counters.dead_lettered + m.dlx.len() as u64;
        let dead_letters_before = dead_letters(self);
        while let Some(&(due, id)) = self.timer.first() {
            if due > self.now_ms {
                break;
            }
            let made = dead_letters(self).saturating_sub(dead_letters_before);
            if limited && self.config.dead_letter && made >= max_dead_letters {
                break;
            }
            self.timer.pop_first();
            let Some(held) = self.delayed.remove(&id) else { continue };
            let expires_at = held.ttl_ms.map_or(NEVER, |t| self.now_ms.saturating_add(t).min(NEVER - 1));
            let size = if track_sizes { held.size } else { 0 };
            let state = MsgState { delivery_count: 0, acquired: 0, size, expires_at, high: held.high };
            if limited && self.config.overflow == Overflow::RejectPublish {
                if self.over_limit(1, held.size as u64) {
                    self.assign(out);
                }
                if self.over_limit(1, held.size as u64) {
                    self.remove(out, id, state, Reason::MaxLen);
                    continue;
                }
            }
            self.ready.push_fired(key, id, state);
            if limited {
                self.drop_head_over_limit(out);
            }
        }
        dead_letters(self).saturating_sub(dead_letters_before)
    }

    /// Delayed messages are due by the machine's clock but not ready yet: a Tick left them (its
    /// bound on dead letters) for the next.
    pub fn due_left(&self) -> bool {
        self.next_due().is_some_and(|due| due <= self.now_ms)
    }

    /// Rewind: the kept messages from the sample whose step reaches `to_ms` on are ready again,
    /// redelivered, in id order with the messages returned by consumers (all before fresh ones:
    /// each was the head once). TTL (the queue's) counts from now; a message's own expiration is
    /// not kept. All go to the normal priority lane.
    pub(super) fn rewind(&mut self, to_ms: u64, out: &mut Out) -> Reply {
        let point = self.config.retention_ms.and_then(|retention| self.retained.rewind_point(retention, to_ms));
        let Some(point) = point else { return Reply::Rewound { count: 0, from_ms: None, clamped: false } };
        let mut ids = self.retained.kept.split_off(point.from);
        let count = ids.len();
        if count > 0 {
            ids.set_expiry(self.config.message_ttl_ms.map_or(NEVER, |t| self.now_ms.saturating_add(t).min(NEVER - 1)));
            out.push(Effect::Rewound { runs: ids.runs().copied().collect() });
            self.ready.push_rewound(ids);
            // Past `x-max-length` with drop-head, the oldest go: the rewound ones first (a classic
            // queue does the same). Reject-publish refuses publishes, not a rewind.
            self.drop_head_over_limit(out);
        }
        Reply::Rewound { count, from_ms: Some(point.from_ms), clamped: point.clamped }
    }

    /// Expires the head while it is past its TTL (messages expire at the head only, as RabbitMQ):
    /// of a queue that dead-letters, at most `max_dead_letters` (the rest wait at the head, never
    /// delivered, for the next `Tick`).
    ///
    /// Why: the leader re-publishes what a queue dead-letters from memory, and a tick that expired
    /// a whole backlog at once made millions of dead letters in one go (a vhost's list of them to
    /// re-publish dropped those past 65,536). Bounding the work leaves the rest in the queue, as
    /// back-pressure: the leader proposes the next tick when the vhost has re-published enough
    /// (`QuorumReplica::tick`). Dropping (no dead-letter exchange) costs nothing: not bounded.
    pub(super) fn expire_head(&mut self, out: &mut Out, max_dead_letters: u64) {
        let mut left = if self.config.dead_letter { max_dead_letters } else { u64::MAX };
        while left > 0 && self.head_expired() {
            let Some((id, st)) = self.ready.pop() else { break };
            self.remove(out, id, st, Reason::Expired);
            left -= 1;
        }
    }

    /// Whether the queue has expired (`x-expires`): unused for that long, as of the last apply. Every
    /// replica knows it; whichever leads deletes the queue.
    pub fn queue_expired(&self) -> bool {
        self.expired_reported
    }

    /// Whether the head message's TTL has passed (it is never delivered: see `expire_head`).
    pub fn head_expired(&self) -> bool {
        self.ready.head().is_some_and(|(_, expires_at)| expires_at != NEVER && expires_at < self.now_ms)
    }

    /// Forgets sessions that published nothing for [`SESSION_IDLE_MS`] (their channels are most
    /// likely gone without a `SessionEnd`, e.g. with their node): a re-send comes within seconds
    /// of a leader change, so their dedup state is of no more use, and this bounds its memory.
    pub(super) fn forget_idle_sessions(&mut self) {
        if self.now_ms < self.next_session_sweep_ms {
            return;
        }
        self.next_session_sweep_ms = self.now_ms.saturating_add(SESSION_SWEEP_EVERY_MS);
        let now = self.now_ms;
        self.sessions.retain(|_, s| now.saturating_sub(s.last_ms) < SESSION_IDLE_MS);
    }

    pub(super) fn check_queue_expiry(&mut self, out: &mut Out) {
        let Some(expires) = self.config.expires_ms else { return };
        if self.expired_reported || self.consumer_count() > 0 {
            return;
        }
        let last_used = self.last_used_ms.unwrap_or(self.now_ms);
        if self.now_ms >= last_used.saturating_add(expires) {
            self.expired_reported = true;
            out.push(Effect::QueueExpired);
        }
    }
}
