//! Unit tests of the quorum queue machine: the RabbitMQ behaviours it models, determinism,
//! snapshot + replay equivalence over random command sequences, and garbage input.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const S1: SessionId = SessionId { node: 1, channel: 7 };
const C1: ConsumerId = ConsumerId { node: 1, local: 1 };
const C2: ConsumerId = ConsumerId { node: 2, local: 1 };
const C3: ConsumerId = ConsumerId { node: 3, local: 1 };

/// A machine and the next Raft index to apply at (indexes skip, as other entries interleave).
struct Q {
    m: QuorumMachine,
    index: u64,
}

impl Q {
    fn new(config: QueueConfig) -> Q {
        Q { m: QuorumMachine::new(config), index: 10 }
    }

    fn apply(&mut self, build: impl FnOnce(&mut Encoder)) -> (Vec<Effect>, Reply) {
        let mut e = Encoder::new();
        build(&mut e);
        self.index += 2;
        self.m.apply(self.index, &e.finish())
    }

    /// Publishes one message per seq in one entry; returns the effects and the single reply.
    fn publish(&mut self, session: SessionId, now_ms: u64, seqs: std::ops::RangeInclusive<u64>, ttl: Option<u64>) -> (Vec<Effect>, Reply) {
        let (effects, reply) = self.apply(|e| {
            e.begin_enqueue(session, now_ms, false);
            for s in seqs {
                e.message(s, 10, ttl, format!("body {s}").as_bytes()).unwrap();
            }
        });
        (effects, single(reply))
    }

    fn attach(&mut self, consumer: ConsumerId, prefetch: u32, priority: i32) -> Vec<Effect> {
        let (effects, reply) =
            self.apply(|e| e.attach(&Attach { consumer, prefetch, auto_ack: false, exclusive: false, priority }));
        assert_eq!(single(reply), Reply::Ok);
        effects
    }
}

fn single(reply: Reply) -> Reply {
    match reply {
        Reply::Batch(mut r) if r.len() == 1 => r.pop().unwrap(),
        other => panic!("expected one reply, got {other:?}"),
    }
}

fn delivered(effects: &[Effect]) -> Vec<(ConsumerId, Vec<Delivery>)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Deliver { consumer, msgs, .. } => Some((*consumer, msgs.clone())),
            _ => None,
        })
        .collect()
}

fn delivered_ids(effects: &[Effect], to: ConsumerId) -> Vec<MsgId> {
    delivered(effects).into_iter().filter(|(c, _)| *c == to).flat_map(|(_, m)| m.into_iter().map(|d| d.msg_id)).collect()
}

fn gone(effects: &[Effect]) -> Vec<(&'static str, Reason, MsgId)> {
    let mut out = Vec::new();
    for e in effects {
        match e {
            Effect::DeadLetter { reason, msgs } => out.extend(run_ids(msgs).map(|id| ("dlx", *reason, id))),
            Effect::Dropped { reason, msgs } => out.extend(run_ids(msgs).map(|id| ("drop", *reason, id))),
            _ => {}
        }
    }
    out
}

#[test]
fn message_ids_are_index_and_place_and_enqueue_confirms() {
    let mut q = Q::new(QueueConfig::default());
    let (effects, reply) = q.publish(S1, 1000, 1..=3, None);
    let index = q.index;
    let stored: Vec<MsgId> = effects.iter().filter_map(|e| match e { Effect::Store { msg_id, .. } => Some(*msg_id), _ => None }).collect();
    assert_eq!(stored, vec![index << 16, (index << 16) | 1, (index << 16) | 2]);
    assert_eq!(reply, Reply::Enqueued { applied_up_to: 3, rejected: vec![] });
    assert!(effects.contains(&Effect::Published { session: S1, applied_up_to: 3, rejected: vec![] }));
    assert_eq!(q.m.ready_count(), 3);
}

#[test]
fn store_effect_names_the_payload_in_the_entry() {
    let mut e = Encoder::new();
    e.begin_enqueue(S1, 5, false);
    e.message(1, 3, None, b"abc").unwrap();
    e.message(2, 5, Some(100), b"hello").unwrap();
    let entry = e.finish();
    let mut m = QuorumMachine::new(QueueConfig::default());
    let (effects, _) = m.apply(1, &entry);
    let payloads: Vec<&[u8]> =
        effects.iter().filter_map(|e| match e { Effect::Store { payload, .. } => Some(&entry[payload.clone()]), _ => None }).collect();
    assert_eq!(payloads, vec![&b"abc"[..], &b"hello"[..]]);
}

#[test]
fn a_resent_batch_is_not_enqueued_twice() {
    let mut q = Q::new(QueueConfig::default());
    q.publish(S1, 0, 1..=5, None);
    // After a leader change the session re-sends 3..=8: only 6..=8 are new.
    let (effects, reply) = q.publish(S1, 0, 3..=8, None);
    assert_eq!(reply, Reply::Enqueued { applied_up_to: 8, rejected: vec![] });
    assert_eq!(effects.iter().filter(|e| matches!(e, Effect::Store { .. })).count(), 3);
    assert_eq!(q.m.ready_count(), 8);
    // The whole batch again: nothing new, still "applied up to 8".
    let (_, reply) = q.publish(S1, 0, 1..=8, None);
    assert_eq!(reply, Reply::Enqueued { applied_up_to: 8, rejected: vec![] });
    assert_eq!(q.m.ready_count(), 8);
    assert_eq!(q.m.counters().duplicates, 3 + 8);
    // Another session has its own seqs; an ended session starts over.
    q.publish(SessionId { node: 2, channel: 7 }, 0, 1..=2, None);
    assert_eq!(q.m.ready_count(), 10);
    q.apply(|e| e.session_end(S1));
    assert_eq!(q.m.session_seq(S1), None);
}

#[test]
fn idle_sessions_are_forgotten_after_an_hour() {
    let mut q = Q::new(QueueConfig::default());
    let s2 = SessionId { node: 2, channel: 9 };
    q.publish(S1, 1_000, 1..=2, None);
    q.publish(s2, 1_000, 1..=2, None);
    q.publish(S1, 1_000 + machine::SESSION_IDLE_MS / 2, 3..=3, None);
    q.apply(|e| e.tick(1_000 + machine::SESSION_IDLE_MS, u64::MAX));
    assert_eq!((q.m.session_seq(S1), q.m.session_seq(s2)), (Some(3), None));
}

#[test]
fn prefetch_is_respected_and_settles_give_credit_back() {
    let mut q = Q::new(QueueConfig::default());
    q.publish(S1, 0, 1..=10, None);
    let effects = q.attach(C1, 3, 0);
    let first = delivered_ids(&effects, C1);
    assert_eq!(first.len(), 3);
    assert_eq!(q.m.checked_out_count(), 3);
    // More publishes: nothing more for C1 until it settles.
    let (effects, _) = q.publish(S1, 0, 11..=12, None);
    assert!(delivered(&effects).is_empty());
    let (effects, _) = q.apply(|e| e.settle(C1, &first[..2]));
    assert!(effects.contains(&Effect::Release { msgs: vec![(first[0], 2)] }));
    let next = delivered_ids(&effects, C1);
    assert_eq!(next.len(), 2);
    assert!(next[0] > first[2], "deliveries go head first, in id order");
    assert_eq!(q.m.checked_out_count(), 3);
    // Settling ids the consumer does not hold changes nothing.
    let (effects, _) = q.apply(|e| e.settle(C1, &[first[0], 12345]));
    assert!(effects.is_empty());
    assert_eq!(q.m.checked_out_count(), 3);
}

#[test]
fn consumers_share_round_robin_and_higher_priority_goes_first() {
    let mut q = Q::new(QueueConfig::default());
    q.attach(C1, 0, 0);
    q.attach(C2, 0, 0);
    let (effects, _) = q.publish(S1, 0, 1..=4, None);
    assert_eq!(delivered_ids(&effects, C1).len(), 2);
    assert_eq!(delivered_ids(&effects, C2).len(), 2);
    // A higher-priority consumer with room takes everything; once full, the lower ones get the rest.
    q.attach(C3, 2, 5);
    let (effects, _) = q.publish(S1, 0, 5..=8, None);
    assert_eq!(delivered_ids(&effects, C3).len(), 2);
    assert_eq!(delivered_ids(&effects, C1).len() + delivered_ids(&effects, C2).len(), 2);
}

#[test]
fn consumer_down_returns_its_messages_as_redelivered_without_counting_a_failure() {
    let mut q = Q::new(QueueConfig::default());
    q.publish(S1, 0, 1..=4, None);
    let effects = q.attach(C2, 2, 0);
    let held = delivered_ids(&effects, C2);
    assert_eq!(held.len(), 2);
    assert!(delivered(&effects)[0].1.iter().all(|d| !d.redelivered));
    q.attach(C1, 0, 0); // takes the other two
    // Node 2 goes: its messages come back at the head and go to C1, flagged redelivered.
    let (effects, _) = q.apply(|e| e.consumer_down(2));
    let again = delivered(&effects);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].0, C1);
    assert_eq!(again[0].1.iter().map(|d| d.msg_id).collect::<Vec<_>>(), held);
    assert!(again[0].1.iter().all(|d| d.redelivered && d.delivery_count == 0));
    assert_eq!(q.m.consumer_count(), 1);
    // Late settles from the removed consumer are ignored.
    let (effects, _) = q.apply(|e| e.settle(C2, &held));
    assert!(effects.is_empty());
    assert_eq!(q.m.checked_out_count(), 4);
}

#[test]
fn requeued_messages_go_back_to_the_head_in_id_order() {
    let mut q = Q::new(QueueConfig::default());
    q.publish(S1, 0, 1..=5, None);
    let effects = q.attach(C1, 3, 0);
    let held = delivered_ids(&effects, C1);
    // Requeue in reverse order; C1 gets them back in id order, before the fresh ones.
    let (effects, _) = q.apply(|e| e.return_(C1, &[held[2], held[0]]));
    let got = delivered(&effects);
    let ids: Vec<MsgId> = got.iter().flat_map(|(_, m)| m.iter().map(|d| d.msg_id)).collect();
    assert_eq!(&ids[..2], &[held[0], held[2]]);
    assert!(got[0].1[..2].iter().all(|d| d.redelivered && d.delivery_count == 1));
}

#[test]
fn delivery_limit_dead_letters_the_poison_message() {
    let mut q = Q::new(QueueConfig { delivery_limit: Some(2), dead_letter: true, ..QueueConfig::default() });
    q.publish(S1, 0, 1..=1, None);
    let effects = q.attach(C1, 1, 0);
    let id = delivered_ids(&effects, C1)[0];
    for round in 1..=2 {
        let (effects, _) = q.apply(|e| e.return_(C1, &[id]));
        let d = &delivered(&effects)[0].1[0];
        assert_eq!((d.msg_id, d.redelivered, d.delivery_count), (id, true, round));
    }
    // The third failure is one more than the limit allows.
    let (effects, _) = q.apply(|e| e.return_(C1, &[id]));
    assert_eq!(gone(&effects), vec![("dlx", Reason::DeliveryLimit, id)]);
    assert!(delivered(&effects).is_empty());
    assert_eq!((q.m.ready_count(), q.m.checked_out_count()), (0, 0));
    // Without a dead-letter exchange it is dropped; a reject without requeue is `rejected`.
    let mut q = Q::new(QueueConfig { delivery_limit: Some(0), ..QueueConfig::default() });
    q.publish(S1, 0, 1..=2, None);
    let held = delivered_ids(&q.attach(C1, 2, 0), C1);
    let (effects, _) = q.apply(|e| {
        e.return_(C1, &held[..1]);
        e.discard(C1, &held[1..]);
    });
    assert_eq!(gone(&effects), vec![("drop", Reason::DeliveryLimit, held[0]), ("drop", Reason::Rejected, held[1])]);
}

#[test]
fn single_active_consumer_feeds_one_and_hands_over_when_it_goes() {
    let mut q = Q::new(QueueConfig { single_active_consumer: true, ..QueueConfig::default() });
    q.attach(C1, 2, 0);
    q.attach(C2, 10, 0); // same priority, attached later: waits
    let (effects, _) = q.publish(S1, 0, 1..=5, None);
    assert_eq!(delivered_ids(&effects, C1).len(), 2);
    assert!(delivered_ids(&effects, C2).is_empty(), "messages wait for the active consumer");
    assert_eq!(q.m.active_consumer(), Some(C1));
    // C1's channel closes: its two come back and everything goes to C2, in id order.
    let (effects, _) = q.apply(|e| e.detach(C1, true));
    assert_eq!(q.m.active_consumer(), Some(C2));
    let got = delivered_ids(&effects, C2);
    assert_eq!(got.len(), 5);
    assert!(got.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn single_active_consumer_switches_to_a_higher_priority_one_once_the_active_has_settled() {
    for requeue in [false, true] {
        let mut q = Q::new(QueueConfig { single_active_consumer: true, ..QueueConfig::default() });
        q.attach(C1, 2, 0);
        let (effects, _) = q.publish(S1, 0, 1..=5, None);
        let held = delivered_ids(&effects, C1);
        // A higher-priority consumer: C1 fades (nothing more for it), C2 waits for C1's two.
        let effects = q.attach(C2, 10, 9);
        assert!(delivered(&effects).is_empty());
        assert_eq!(q.m.active_consumer(), Some(C1));
        let (effects, _) = q.apply(|e| e.settle(C1, &held[..1]));
        assert!(delivered(&effects).is_empty());
        // The last one settled (or requeued: rabbitmq-server#14141 stalled there): C2 takes over.
        let (effects, _) = q.apply(|e| if requeue { e.return_(C1, &held[1..]) } else { e.settle(C1, &held[1..]) });
        assert_eq!(q.m.active_consumer(), Some(C2));
        assert_eq!(delivered_ids(&effects, C2).len(), if requeue { 4 } else { 3 });
        assert!(delivered_ids(&effects, C1).is_empty());
    }
    // An idle active consumer hands over at once.
    let mut q = Q::new(QueueConfig { single_active_consumer: true, ..QueueConfig::default() });
    q.attach(C1, 2, 0);
    q.attach(C2, 2, 1);
    assert_eq!(q.m.active_consumer(), Some(C2));
}

#[test]
fn cancel_keeps_unacked_messages_until_settled() {
    let mut q = Q::new(QueueConfig::default());
    q.publish(S1, 0, 1..=3, None);
    let held = delivered_ids(&q.attach(C1, 2, 0), C1);
    let (effects, _) = q.apply(|e| e.detach(C1, false));
    assert!(delivered(&effects).is_empty());
    assert_eq!((q.m.consumer_count(), q.m.checked_out_count()), (0, 2));
    q.apply(|e| e.settle(C1, &held));
    assert_eq!(q.m.checked_out_by(C1), Vec::<MsgId>::new());
    assert_eq!(q.m.checked_out_count(), 0);
    assert_eq!(q.m.ready_count(), 1);
}

#[test]
fn ttl_expires_at_the_head_on_tick() {
    let mut q = Q::new(QueueConfig { message_ttl_ms: Some(1000), dead_letter: true, ..QueueConfig::default() });
    q.publish(S1, 10_000, 1..=2, None); // expire at 11,000 (queue TTL)
    q.publish(S1, 10_500, 3..=3, Some(100)); // own TTL: 10,600, but behind the others
    let (effects, _) = q.apply(|e| e.tick(10_900, u64::MAX));
    assert!(gone(&effects).is_empty());
    let (effects, _) = q.apply(|e| e.tick(11_001, u64::MAX));
    let expired = gone(&effects);
    assert_eq!(expired.len(), 3);
    assert!(expired.iter().all(|(k, r, _)| *k == "dlx" && *r == Reason::Expired));
    assert_eq!(q.m.ready_count(), 0);
    // Time never goes back: an older tick changes nothing.
    q.apply(|e| e.tick(5, u64::MAX));
    assert_eq!(q.m.now_ms(), 11_001);
    // Checked-out messages do not expire; returned ones expire once at the head.
    q.publish(S1, 20_000, 4..=4, None);
    let held = delivered_ids(&q.attach(C1, 1, 0), C1);
    let (effects, _) = q.apply(|e| e.tick(30_000, u64::MAX));
    assert!(gone(&effects).is_empty());
    let (effects, _) = q.apply(|e| {
        e.detach(C1, true);
        e.tick(30_001, u64::MAX);
    });
    assert_eq!(gone(&effects), vec![("dlx", Reason::Expired, held[0])]);
}

#[test]
fn a_node_whose_clock_runs_ahead_does_not_expire_the_others_messages() {
    let mut q = Q::new(QueueConfig { message_ttl_ms: Some(1000), ..QueueConfig::default() });
    q.publish(S1, 1000, 1..=1, None);
    q.publish(SessionId { node: 2, channel: 1 }, 1_000_000_000, 1..=1, None);
    assert_eq!(q.m.now_ms(), 0, "enqueues do not move the machine's clock");
    let (effects, _) = q.apply(|e| e.tick(1500, u64::MAX));
    assert!(gone(&effects).is_empty());
    let (effects, _) = q.apply(|e| e.tick(2001, u64::MAX));
    assert_eq!(gone(&effects).len(), 1, "only the message dated by a sane clock expired");
    // A message dated before the machine's clock starts its TTL at the machine's clock.
    let mut q = Q::new(QueueConfig { message_ttl_ms: Some(1000), ..QueueConfig::default() });
    q.apply(|e| e.tick(2000, u64::MAX));
    q.publish(S1, 5, 1..=1, None);
    let (effects, _) = q.apply(|e| e.tick(2500, u64::MAX));
    assert!(gone(&effects).is_empty());
    let (effects, _) = q.apply(|e| e.tick(3001, u64::MAX));
    assert_eq!(gone(&effects).len(), 1);
}

#[test]
fn max_length_drop_head_drops_the_oldest() {
    let mut q = Q::new(QueueConfig { max_length: Some(3), dead_letter: true, ..QueueConfig::default() });
    let (_, _) = q.publish(S1, 0, 1..=3, None);
    let first = q.index << 16;
    let (effects, reply) = q.publish(S1, 0, 4..=5, None);
    assert_eq!(reply, Reply::Enqueued { applied_up_to: 5, rejected: vec![] });
    assert_eq!(gone(&effects), vec![("dlx", Reason::MaxLen, first), ("dlx", Reason::MaxLen, first | 1)]);
    assert_eq!(q.m.ready_count(), 3);
    // Checked-out messages do not count; a consumer with credit takes them before any drop.
    q.attach(C1, 2, 0);
    let (effects, _) = q.publish(S1, 0, 6..=7, None);
    assert!(gone(&effects).is_empty());
    assert_eq!(q.m.ready_count(), 3);
    // By bytes: each test message is 10 bytes.
    let mut q = Q::new(QueueConfig { max_length_bytes: Some(25), ..QueueConfig::default() });
    let (effects, _) = q.publish(S1, 0, 1..=3, None);
    assert_eq!(gone(&effects).len(), 1);
    assert_eq!((q.m.ready_count(), q.m.ready_bytes()), (2, 20));
}

#[test]
fn max_length_reject_publish_names_the_rejected_seqs() {
    let mut q = Q::new(QueueConfig { max_length: Some(2), overflow: Overflow::RejectPublish, ..QueueConfig::default() });
    let (effects, reply) = q.publish(S1, 0, 1..=4, None);
    assert_eq!(reply, Reply::Enqueued { applied_up_to: 4, rejected: vec![3, 4] });
    assert!(effects.contains(&Effect::Published { session: S1, applied_up_to: 4, rejected: vec![3, 4] }));
    assert!(gone(&effects).is_empty());
    assert_eq!(q.m.ready_count(), 2);
    // A consumer makes room: accepted again.
    let held = delivered_ids(&q.attach(C1, 1, 0), C1);
    q.apply(|e| e.settle(C1, &held));
    let (_, reply) = q.publish(S1, 0, 5..=6, None);
    assert_eq!(reply, Reply::Enqueued { applied_up_to: 6, rejected: vec![] });
}

#[test]
fn auto_ack_consumers_use_credit_and_deliveries_are_settled() {
    let mut q = Q::new(QueueConfig::default());
    q.publish(S1, 0, 1..=5, None);
    let (effects, _) = q.apply(|e| e.attach(&Attach { consumer: C1, prefetch: 2, auto_ack: true, exclusive: false, priority: 0 }));
    assert!(matches!(&effects[..], [Effect::Deliver { settled: true, msgs, .. }] if msgs.len() == 2));
    assert_eq!((q.m.ready_count(), q.m.checked_out_count()), (3, 0));
    let (effects, _) = q.apply(|e| e.credit(C1, 10));
    assert_eq!(delivered_ids(&effects, C1).len(), 3);
}

#[test]
fn basic_get_takes_the_head() {
    let mut q = Q::new(QueueConfig::default());
    let getter = ConsumerId { node: 3, local: 99 };
    let (_, reply) = q.apply(|e| e.dequeue(getter, false));
    assert_eq!(single(reply), Reply::Dequeued(None));
    q.publish(S1, 0, 1..=2, None);
    let (effects, reply) = q.apply(|e| e.dequeue(getter, false));
    let Reply::Dequeued(Some(d)) = single(reply) else { panic!() };
    assert_eq!((d.msg_id, d.redelivered, d.ready_after), (q.index - 2 << 16, false, 1));
    assert_eq!(delivered_ids(&effects, getter), vec![d.msg_id]);
    assert_eq!(q.m.consumer_count(), 0, "a getter is not a consumer");
    q.apply(|e| e.return_(getter, &[d.msg_id]));
    let (_, reply) = q.apply(|e| e.dequeue(getter, true));
    let Reply::Dequeued(Some(again)) = single(reply) else { panic!() };
    assert_eq!((again.msg_id, again.redelivered, again.delivery_count), (d.msg_id, true, 1));
    assert_eq!(q.m.checked_out_count(), 0);
}

#[test]
fn exclusive_consumers_exclude_others() {
    let mut q = Q::new(QueueConfig::default());
    q.attach(C1, 0, 0);
    let (_, reply) = q.apply(|e| e.attach(&Attach { consumer: C2, prefetch: 0, auto_ack: false, exclusive: true, priority: 0 }));
    assert_eq!(single(reply), Reply::Refused(Refusal::ExclusiveConsumer));
    q.apply(|e| e.detach(C1, true));
    let (_, reply) = q.apply(|e| e.attach(&Attach { consumer: C2, prefetch: 0, auto_ack: false, exclusive: true, priority: 0 }));
    assert_eq!(single(reply), Reply::Ok);
    let (_, reply) = q.apply(|e| e.attach(&Attach { consumer: C1, prefetch: 0, auto_ack: false, exclusive: false, priority: 0 }));
    assert_eq!(single(reply), Reply::Refused(Refusal::ExclusiveConsumer));
}

#[test]
fn purge_drops_ready_messages_as_runs() {
    let mut q = Q::new(QueueConfig { dead_letter: true, ..QueueConfig::default() });
    q.publish(S1, 0, 1..=1000, None);
    let (effects, reply) = q.apply(|e| e.purge());
    assert_eq!(single(reply), Reply::Purged { count: 1000 });
    assert!(matches!(&effects[..], [Effect::Dropped { reason: Reason::Purged, msgs }] if msgs.len() == 1 && msgs[0].1 == 1000));
    assert_eq!(q.m.ready_count(), 0);
}

#[test]
fn queue_expires_once_unused() {
    let mut q = Q::new(QueueConfig { expires_ms: Some(1000), ..QueueConfig::default() });
    q.apply(|e| e.tick(5000, u64::MAX));
    q.attach(C1, 0, 0);
    let (effects, _) = q.apply(|e| e.tick(10_000, u64::MAX));
    assert!(effects.is_empty(), "a queue with consumers is in use");
    q.apply(|e| e.detach(C1, true));
    let (effects, _) = q.apply(|e| e.tick(10_999, u64::MAX));
    assert!(effects.is_empty());
    let (effects, _) = q.apply(|e| e.tick(11_000, u64::MAX));
    assert_eq!(effects, vec![Effect::QueueExpired]);
    let (effects, _) = q.apply(|e| e.tick(12_000, u64::MAX));
    assert!(effects.is_empty(), "reported once");
}

#[test]
fn stale_indexes_and_bad_entries_are_refused_without_change() {
    let mut q = Q::new(QueueConfig::default());
    q.publish(S1, 0, 1..=1, None);
    let mut before = q.m.clone();
    let mut e = Encoder::new();
    e.purge();
    let entry = e.finish();
    assert_eq!(q.m.apply(q.index, &entry).1, Reply::Refused(Refusal::StaleIndex));
    assert_eq!(q.m.apply(q.index + 1, b"\x01\xff").1, Reply::Refused(Refusal::BadCommand));
    assert_eq!(q.m.last_index(), Some(q.index + 1));
    before.last_index = q.m.last_index();
    assert_eq!(q.m, before, "only the applied index moved");
}

#[test]
fn a_large_batched_backlog_costs_runs_not_messages() {
    let mut q = Q::new(QueueConfig { message_ttl_ms: Some(60_000), ..QueueConfig::default() });
    for b in 0..100u64 {
        q.publish(S1, 1000, b * 10_000 + 1..=(b + 1) * 10_000, None);
    }
    assert_eq!(q.m.ready_count(), 1_000_000);
    let (returned, runs, sizes, _, sessions) = q.m.memory_entries();
    assert_eq!((returned, runs, sizes, sessions), (0, 100, 0, 1));
    assert!(q.m.snapshot().len() < 4096, "snapshot of a 1M backlog: {} bytes", q.m.snapshot().len());
}

#[test]
fn a_backlog_of_one_message_entries_costs_runs_not_messages() {
    // A publisher waiting for each confirm: one message an entry, with a tick now and then.
    let mut m = QuorumMachine::new(QueueConfig::default());
    for index in 1..=200_000u64 {
        let mut e = Encoder::new();
        if index % 1000 == 0 {
            e.tick(index, u64::MAX);
        } else {
            e.begin_enqueue(S1, index, false);
            e.message(index, 10, None, b"m").unwrap();
        }
        m.apply(index, &e.finish());
    }
    assert_eq!(m.ready_count(), 199_800);
    let (returned, runs, _, _, _) = m.memory_entries();
    assert_eq!((returned, runs), (0, 200));
    // Consumed in order across the runs.
    let mut e = Encoder::new();
    e.attach(&Attach { consumer: C1, prefetch: 3, auto_ack: false, exclusive: false, priority: 0 });
    let (effects, _) = m.apply(200_001, &e.finish());
    assert_eq!(delivered_ids(&effects, C1), vec![1 << 16, 2 << 16, 3 << 16]);
}

#[test]
fn commands_round_trip_through_the_encoding() {
    let mut e = Encoder::new();
    e.begin_enqueue(S1, 123, false);
    e.message(9, 3, Some(0), b"xyz").unwrap();
    e.message(10, 0, None, b"").unwrap();
    e.attach(&Attach { consumer: C1, prefetch: 5, auto_ack: true, exclusive: true, priority: -3 });
    e.detach(C2, true);
    e.settle(C1, &[5, 3, 900, 1]);
    e.return_(C1, &[]);
    e.discard(C3, &[u64::MAX, 0]);
    e.credit(C1, u32::MAX);
    e.dequeue(C2, true);
    e.consumer_down(4);
    e.session_end(S1);
    e.tick(u64::MAX, u64::MAX);
    e.touch(0);
    e.purge();
    e.begin_enqueue(SessionId { node: 2, channel: 1 }, 124, true);
    e.message(11, 1, None, b"h").unwrap();
    let entry = e.finish();
    let cmd = Command::decode(&entry).unwrap();
    let Command::Batch(cmds) = &cmd else { panic!() };
    assert_eq!(cmds.len(), 14);
    let Command::Enqueue { msgs, .. } = &cmds[13] else { panic!() };
    assert!(msgs[0].high);
    let Command::Enqueue { msgs, .. } = &cmds[0] else { panic!() };
    assert!(!msgs[0].high && !msgs[1].high);
    assert_eq!(cmds[3], Command::Settle { consumer: C1, msg_ids: vec![5, 3, 900, 1] });
    assert_eq!(cmds[5], Command::Discard { consumer: C3, msg_ids: vec![u64::MAX, 0] });
    assert_eq!(cmd.encode(&entry).unwrap(), entry);
    for reply in [
        Reply::Ok,
        Reply::Enqueued { applied_up_to: 7, rejected: vec![3, 9] },
        Reply::Dequeued(None),
        Reply::Dequeued(Some(Dequeued { msg_id: 1 << 40, redelivered: true, delivery_count: 3, ready_after: 8 })),
        Reply::Purged { count: 5 },
        Reply::Refused(Refusal::ExclusiveConsumer),
        Reply::Batch(vec![Reply::Ok, Reply::Purged { count: 1 }]),
    ] {
        assert_eq!(Reply::decode(&reply.encode()).unwrap(), reply);
    }
}

#[test]
fn an_entry_holds_at_most_65535_messages() {
    let mut e = Encoder::new();
    e.begin_enqueue(S1, 0, false);
    for s in 0..MAX_MESSAGES_PER_ENTRY as u64 {
        e.message(s, 0, None, b"").unwrap();
    }
    assert_eq!(e.message(1 << 20, 0, None, b""), Err(EncodeError::EntryFull));
    let entry = e.finish();
    let mut m = QuorumMachine::new(QueueConfig::default());
    let (effects, _) = m.apply(7, &entry);
    let last = effects.iter().filter_map(|e| match e { Effect::Store { msg_id, .. } => Some(*msg_id), _ => None }).last();
    assert_eq!(last, Some((7 << 16) | 65_534));
}

// ---- random command sequences ----

fn random_config(rng: &mut StdRng) -> QueueConfig {
    let overflow = if rng.gen_bool(0.5) { Overflow::DropHead } else { Overflow::RejectPublish };
    let dead_letter = rng.gen_bool(0.5);
    QueueConfig {
        max_length: rng.gen_bool(0.3).then(|| rng.gen_range(0..20)),
        max_length_bytes: rng.gen_bool(0.2).then(|| rng.gen_range(0..400)),
        overflow,
        delivery_limit: if rng.gen_bool(0.8) { Some(rng.gen_range(0..4)) } else { None },
        message_ttl_ms: rng.gen_bool(0.3).then(|| rng.gen_range(0..500)),
        dead_letter,
        at_least_once: dead_letter && overflow == Overflow::RejectPublish && rng.gen_bool(0.6),
        single_active_consumer: rng.gen_bool(0.3),
        expires_ms: rng.gen_bool(0.2).then(|| rng.gen_range(1..2000)),
        retention_ms: rng.gen_bool(0.4).then(|| rng.gen_range(1..3000)),
    }
}

/// Builds a random entry that makes sense for `m`'s current state (settles name held messages).
fn random_entry(rng: &mut StdRng, m: &QuorumMachine, now: &mut u64, seqs: &mut [u64; 3]) -> bytes::Bytes {
    let consumers: Vec<ConsumerId> = (1..=3).flat_map(|node| (1..=2).map(move |local| ConsumerId { node, local })).collect();
    let mut e = Encoder::new();
    for _ in 0..rng.gen_range(1..4) {
        let c = consumers[rng.gen_range(0..consumers.len())];
        let held = m.checked_out_by(c);
        let pick = |rng: &mut StdRng| -> Vec<MsgId> { held.iter().copied().filter(|_| rng.gen_bool(0.5)).collect() };
        match rng.gen_range(0..106) {
            0..=34 => {
                let s = rng.gen_range(0..3);
                *now += rng.gen_range(0..50);
                let delayed = rng.gen_bool(0.25);
                let session = SessionId { node: s as u64 + 1, channel: 1 };
                if delayed {
                    e.begin_enqueue_delayed(session, *now, rng.gen_bool(0.3));
                } else {
                    e.begin_enqueue(session, *now, rng.gen_bool(0.3));
                }
                // Sometimes re-send some already applied seqs (a leader change).
                let from = if rng.gen_bool(0.2) { seqs[s].saturating_sub(rng.gen_range(0..5)) } else { seqs[s] };
                let n = rng.gen_range(0..6);
                for k in 1..=n {
                    let ttl = rng.gen_bool(0.2).then(|| rng.gen_range(0..300));
                    if delayed {
                        e.message_delayed(from + k, rng.gen_range(0..100), ttl, rng.gen_range(1..900), &[k as u8; 3]).unwrap();
                    } else {
                        e.message(from + k, rng.gen_range(0..100), ttl, &[k as u8; 3]).unwrap();
                    }
                }
                seqs[s] = seqs[s].max(from + n);
            }
            35..=44 => e.attach(&Attach {
                consumer: c,
                prefetch: rng.gen_range(0..4),
                auto_ack: rng.gen_bool(0.2),
                exclusive: rng.gen_bool(0.05),
                priority: rng.gen_range(-1..2),
            }),
            45..=49 => e.detach(c, rng.gen_bool(0.5)),
            50..=64 => e.settle(c, &pick(rng)),
            65..=72 => e.return_(c, &pick(rng)),
            73..=77 => e.discard(c, &pick(rng)),
            78..=80 => e.credit(c, rng.gen_range(0..5)),
            81..=84 => e.dequeue(c, rng.gen_bool(0.5)),
            85..=86 => e.consumer_down(rng.gen_range(1..4)),
            // At-least-once: some dead letters reached their target (and an id that is not one).
            88 if m.dead_letter_count() > 0 => {
                let mut ids: Vec<MsgId> = m.dead_letters_waiting().map(|(id, _)| id).filter(|_| rng.gen_bool(0.6)).collect();
                ids.push(rng.gen_range(0..1 << 30));
                e.dead_lettered(&ids);
            }
            87..=95 => {
                *now += rng.gen_range(0..400);
                e.tick(*now, u64::MAX);
            }
            96 => e.session_end(SessionId { node: rng.gen_range(1..4), channel: 1 }),
            97 => e.touch(*now),
            98..=99 => e.purge(),
            _ => e.rewind(now.saturating_sub(rng.gen_range(0..2000))),
        }
    }
    e.finish()
}

/// A random run: the config and the entries with their indexes.
fn random_run(seed: u64, len: usize) -> (QueueConfig, Vec<(u64, bytes::Bytes)>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let config = random_config(&mut rng);
    let mut m = QuorumMachine::new(config.clone());
    let (mut now, mut seqs, mut index) = (1000, [0u64; 3], 0u64);
    let mut entries = Vec::with_capacity(len);
    for _ in 0..len {
        let entry = random_entry(&mut rng, &m, &mut now, &mut seqs);
        index += rng.gen_range(1..3);
        m.apply(index, &entry);
        entries.push((index, entry));
    }
    (config, entries)
}

#[test]
fn two_replicas_applying_the_same_log_agree() {
    for seed in 0..20 {
        let (config, entries) = random_run(seed, 300);
        let mut a = QuorumMachine::new(config.clone());
        let mut b = QuorumMachine::new(config);
        for (index, entry) in &entries {
            assert_eq!(a.apply(*index, entry), b.apply(*index, entry), "seed {seed} index {index}");
        }
        assert_eq!(a.snapshot(), b.snapshot());
        assert!(a.counters().delivered > 0 || seed > 0 || a.counters().enqueued == 0);
    }
}

#[test]
fn restoring_a_snapshot_at_any_point_then_replaying_equals_applying_everything() {
    let mut exercised = Counters::default();
    let mut saw_per_entry_runs = false;
    let (mut saw_fired, mut saw_delayed, mut saw_rewound, mut saw_kept) = (false, false, false, false);
    for seed in 100..140 {
        let (config, entries) = random_run(seed, 200);
        let mut straight = QuorumMachine::new(config.clone());
        let mut results = Vec::new();
        for (index, entry) in &entries {
            results.push(straight.apply(*index, entry));
        }
        let k = straight.counters();
        exercised.delivered += k.delivered;
        exercised.returned += k.returned;
        exercised.dead_lettered += k.dead_lettered;
        exercised.dropped += k.dropped;
        exercised.rejected += k.rejected;
        exercised.duplicates += k.duplicates;
        for cut in (0..=entries.len()).step_by(7) {
            let mut prefix = QuorumMachine::new(config.clone());
            for (index, entry) in &entries[..cut] {
                prefix.apply(*index, entry);
            }
            saw_per_entry_runs |= prefix.ready.normal.fresh.iter().chain(prefix.ready.high.fresh.iter()).any(|r| r.per_entry && r.count > 1);
            saw_fired |= !prefix.ready.normal.fired.is_empty() || !prefix.ready.high.fired.is_empty();
            saw_delayed |= prefix.delayed_count() > 0;
            saw_rewound |= !prefix.ready.normal.rewound.is_empty();
            saw_kept |= prefix.retained_count() > 0 && prefix.retention_floor() > 0;
            let snap = prefix.snapshot();
            let mut restored = QuorumMachine::new(QueueConfig::default());
            restored.restore(&snap).unwrap_or_else(|e| panic!("seed {seed} cut {cut}: {e}"));
            assert_eq!(restored, prefix, "seed {seed} cut {cut}: restore must rebuild the same state");
            for (i, (index, entry)) in entries.iter().enumerate().skip(cut) {
                assert_eq!(restored.apply(*index, entry), results[i], "seed {seed} cut {cut} entry {i}");
            }
            assert_eq!(restored.snapshot(), straight.snapshot(), "seed {seed} cut {cut}");
        }
    }
    // The runs covered the interesting paths.
    assert!(exercised.delivered > 100 && exercised.returned > 10 && exercised.duplicates > 10, "{exercised:?}");
    assert!(saw_fired && saw_delayed, "delayed messages, and fired ones waiting, were in some snapshot");
    assert!(saw_rewound && saw_kept, "rewound messages waiting, and kept ones above a floor, were in some snapshot");
    assert!(exercised.dead_lettered + exercised.dropped > 10 && exercised.rejected > 0, "{exercised:?}");
    assert!(saw_per_entry_runs, "no snapshot held a run of one-message entries");
}

#[test]
fn garbage_never_panics_the_decoders_or_the_machine() {
    let mut rng = StdRng::seed_from_u64(42);
    let (config, entries) = random_run(7, 100);
    let mut m = QuorumMachine::new(config);
    let mut snapshots = Vec::new();
    for (index, entry) in &entries {
        m.apply(*index, entry);
        snapshots.push(m.snapshot());
    }
    let mut index = 1_000_000;
    for round in 0..20_000 {
        // Random bytes, and valid encodings with a few bytes flipped or cut.
        let mut bytes: Vec<u8> = match round % 3 {
            0 => (0..rng.gen_range(0..64)).map(|_| rng.gen()).collect(),
            1 => entries[rng.gen_range(0..entries.len())].1.to_vec(),
            _ => snapshots[rng.gen_range(0..snapshots.len())].to_vec(),
        };
        if round % 3 != 0 && !bytes.is_empty() {
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..bytes.len());
                bytes[at] = rng.gen();
            }
            if rng.gen_bool(0.3) {
                bytes.truncate(rng.gen_range(0..bytes.len()));
            }
        }
        let _ = Command::decode(&bytes);
        let _ = Reply::decode(&bytes);
        let mut other = QuorumMachine::new(QueueConfig::default());
        if other.restore(&bytes).is_ok() {
            // A snapshot that decodes is consistent enough to keep applying.
            index += 1;
            other.apply(index, &entries[0].1);
            other.snapshot();
        }
        index += 1;
        m.apply(index, &bytes);
    }
}

/// Figures, not a test of speed: `cargo test --release -p warren-broker --lib quorum::tests::apply_throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn apply_throughput() {
    let body = [7u8; 100];
    for batch in [1usize, 10, 100, 1000] {
        let total = 1_000_000usize;
        let mut m = QuorumMachine::new(QueueConfig::default());
        let mut index = 1;
        m.apply(index, &{
            let mut e = Encoder::new();
            e.attach(&Attach { consumer: C1, prefetch: 2000, auto_ack: false, exclusive: false, priority: 0 });
            e.finish()
        });
        let mut to_settle: Vec<MsgId> = Vec::new();
        let (mut seq, mut apply_time, mut encode_time, mut effects_seen) = (0u64, std::time::Duration::ZERO, std::time::Duration::ZERO, 0usize);
        while (seq as usize) < total {
            let t = std::time::Instant::now();
            let mut e = Encoder::new();
            e.settle(C1, &to_settle);
            e.begin_enqueue(S1, 0, false);
            for _ in 0..batch {
                seq += 1;
                e.message(seq, body.len() as u32, None, &body).unwrap();
            }
            let entry = e.finish();
            encode_time += t.elapsed();
            index += 1;
            let t = std::time::Instant::now();
            let (effects, _) = m.apply(index, &entry);
            apply_time += t.elapsed();
            effects_seen += effects.len();
            to_settle = effects.iter().flat_map(|e| match e { Effect::Deliver { msgs, .. } => msgs.iter().map(|d| d.msg_id).collect(), _ => vec![] }).collect();
        }
        println!(
            "batch {batch:>4}: apply {:>6.0} ns/message ({:.1} M messages/s), encode {:>5.0} ns/message, {} effects, {} checked out at the end",
            apply_time.as_nanos() as f64 / total as f64,
            total as f64 / apply_time.as_secs_f64() / 1e6,
            encode_time.as_nanos() as f64 / total as f64,
            effects_seen,
            m.checked_out_count()
        );
    }
}

#[test]
fn entries_past_index_2_pow_48_enqueue_nothing() {
    let mut m = QuorumMachine::new(QueueConfig::default());
    let mut e = Encoder::new();
    e.begin_enqueue(S1, 0, false);
    e.message(1, 1, None, b"x").unwrap();
    let (effects, reply) = m.apply(machine::MAX_INDEX, &e.finish());
    assert_eq!(single(reply), Reply::Enqueued { applied_up_to: 1, rejected: vec![1] });
    assert!(!effects.iter().any(|e| matches!(e, Effect::Store { .. })));
    assert_eq!(m.ready_count(), 0);
    assert_eq!(QuorumMachine::new(QueueConfig::default()).restore(&m.snapshot()), Ok(()));
}

/// The wrapper's contract over random logs: a message is stored once; delivered only while it is
/// in the queue and not held by a consumer; leaves exactly once (release, dead-letter, drop or a
/// settled delivery); and the messages neither gone nor held are exactly the ready ones.
#[test]
fn every_message_is_stored_once_and_leaves_once_over_random_logs() {
    use std::collections::BTreeMap;
    let mut saw_settled_dead_letters = false;
    for seed in 300..330 {
        let (config, entries) = random_run(seed, 300);
        let mut m = QuorumMachine::new(config);
        // id -> holder (None: ready)
        let mut live: BTreeMap<MsgId, Option<ConsumerId>> = BTreeMap::new();
        // At-least-once dead letters waiting for their target.
        let mut waiting = std::collections::BTreeSet::new();
        let leave = |live: &mut BTreeMap<MsgId, Option<ConsumerId>>, id: MsgId, why: &str| {
            assert!(live.remove(&id).is_some(), "seed {seed}: {id} left ({why}) but was not in the queue");
        };
        for (index, entry) in &entries {
            // What this entry may give back before redelivering it.
            let mut returnable = std::collections::BTreeSet::new();
            let mut detached = std::collections::BTreeSet::new();
            let mut down = std::collections::BTreeSet::new();
            let cmds = match Command::decode(entry).unwrap() {
                Command::Batch(c) => c,
                c => vec![c],
            };
            for c in cmds {
                match c {
                    Command::Return { msg_ids, .. } => returnable.extend(msg_ids),
                    Command::Detach { consumer, .. } => {
                        detached.insert(consumer);
                    }
                    Command::ConsumerDown { node } => {
                        down.insert(node);
                    }
                    _ => {}
                }
            }
            let (effects, _) = m.apply(*index, entry);
            for e in &effects {
                match e {
                    Effect::Store { msg_id, .. } => {
                        assert!(live.insert(*msg_id, None).is_none(), "seed {seed}: {msg_id} stored twice");
                    }
                    Effect::Deliver { consumer, settled, msgs } => {
                        for d in msgs {
                            // Held before this entry: only if the entry returned it first.
                            let free = match live.get(&d.msg_id) {
                                Some(None) => true,
                                Some(Some(c)) => returnable.contains(&d.msg_id) || detached.contains(c) || down.contains(&c.node),
                                None => false,
                            };
                            assert!(free, "seed {seed}: delivered {} while {:?}", d.msg_id, live.get(&d.msg_id));
                            if *settled {
                                live.remove(&d.msg_id);
                            } else {
                                live.insert(d.msg_id, Some(*consumer));
                            }
                        }
                    }
                    Effect::Release { msgs } => run_ids(msgs).for_each(|id| {
                        if waiting.remove(&id) {
                            saw_settled_dead_letters = true;
                        } else {
                            leave(&mut live, id, "release")
                        }
                    }),
                    Effect::DeadLetterHeld { msgs, .. } => run_ids(msgs).for_each(|id| {
                        leave(&mut live, id, "held dead letter");
                        assert!(waiting.insert(id), "seed {seed}: {id} dead-lettered twice");
                    }),
                    Effect::DeadLetter { msgs, .. } => run_ids(msgs).for_each(|id| leave(&mut live, id, "dead-letter")),
                    Effect::Dropped { msgs, .. } => run_ids(msgs).for_each(|id| leave(&mut live, id, "drop")),
                    Effect::Rewound { runs } => {
                        for id in runs.iter().flat_map(crate::quorum::ready::Run::ids) {
                            assert!(live.insert(id, None).is_none(), "seed {seed}: {id} rewound while in the queue");
                        }
                    }
                    Effect::Published { .. } | Effect::QueueExpired => {}
                }
            }
            // Messages the entry returned (requeue, detach, consumer gone) are ready again; every
            // message the machine says a consumer holds was delivered to it.
            let mut consumers: std::collections::BTreeSet<ConsumerId> = live.values().flatten().copied().collect();
            consumers.extend((1..=3).flat_map(|node| (1..=2).map(move |local| ConsumerId { node, local })));
            for c in consumers {
                let now: std::collections::BTreeSet<MsgId> = m.checked_out_by(c).into_iter().collect();
                for (id, h) in live.iter_mut() {
                    if *h == Some(c) && !now.contains(id) {
                        *h = None;
                    }
                }
                assert!(now.iter().all(|id| live.get(id) == Some(&Some(c))), "seed {seed} index {index}: {c:?} holds what it was not given last");
            }
            let held = live.values().filter(|h| h.is_some()).count() as u64;
            let ready = live.len() as u64 - held;
            // Delayed messages not due are live, neither ready nor held.
            assert_eq!((ready, held), (m.ready_count() + m.delayed_count(), m.checked_out_count()), "seed {seed} index {index}");
            assert_eq!(waiting.len() as u64, m.dead_letter_count(), "seed {seed} index {index}");
            assert!(waiting.iter().all(|id| m.is_live(*id)));
        }
    }
    assert!(saw_settled_dead_letters, "no run settled an at-least-once dead letter");
}

#[test]
fn is_live_names_ready_checked_out_and_returned_messages_only() {
    let mut q = Q::new(QueueConfig::default());
    // One entry of three messages (a run of step 1), then single messages of consecutive entries
    // (a run of step 2^16, as a publisher waiting for each confirm makes them).
    q.publish(S1, 0, 1..=3, None);
    let batch: Vec<MsgId> = (0..3).map(|i| msg_id(q.index, i)).collect();
    let mut singles = Vec::new();
    for s in 4..=6 {
        q.index -= 1; // consecutive indexes
        q.publish(S1, 0, s..=s, None);
        singles.push(msg_id(q.index, 0));
    }
    for id in batch.iter().chain(&singles) {
        assert!(q.m.is_live(*id), "{id:#x} is ready");
    }
    assert!(!q.m.is_live(batch[2] + 1), "past a run's end");
    assert!(!q.m.is_live(singles[0] + 1), "between a per-entry run's ids");
    assert!(!q.m.is_live(0) && !q.m.is_live(msg_id(q.index + 1, 0)));
    // Checked out, returned and settled.
    let held = delivered_ids(&q.attach(C1, 2, 0), C1);
    assert_eq!(held, batch[..2]);
    assert!(held.iter().all(|id| q.m.is_live(*id)));
    q.apply(|e| e.settle(C1, &held[..1]));
    assert!(!q.m.is_live(held[0]), "settled");
    q.apply(|e| e.detach(C1, true));
    assert!(q.m.is_live(held[1]), "returned");
    // A snapshot's machine says the same.
    let mut restored = QuorumMachine::new(QueueConfig::default());
    restored.restore(&q.m.snapshot()).unwrap();
    for id in batch.iter().chain(&singles) {
        assert_eq!(restored.is_live(*id), q.m.is_live(*id));
    }
}

/// A body is read back from its entry by its place (`msg_id & 0xffff`, `Command::enqueued_payloads`):
/// that place must be the one the machine numbered it with, across an entry's sessions, around
/// duplicates and refused publishes (numbered too) and other commands in between.
#[test]
fn enqueued_payloads_give_each_stored_message_its_own_bytes() {
    const S2: SessionId = SessionId { node: 2, channel: 3 };
    let mut q = Q::new(QueueConfig { max_length: Some(6), overflow: Overflow::RejectPublish, ..QueueConfig::default() });
    q.publish(S1, 1, 1..=2, None);
    let mut e = Encoder::new();
    e.begin_enqueue(S1, 2, false);
    for s in [2, 3, 4] {
        e.message(s, 10, None, format!("s1 {s}").as_bytes()).unwrap(); // 2: a duplicate
    }
    e.settle(C2, &[12345]);
    e.begin_enqueue(S2, 2, false);
    for s in [1, 2, 3] {
        e.message(s, 10, None, format!("s2 {s}").as_bytes()).unwrap(); // 3: past max-length, refused
    }
    let entry = e.finish();
    let (effects, _) = q.m.apply(100, &entry);
    let places = Command::enqueued_payloads(&entry).unwrap();
    let stored: Vec<(MsgId, std::ops::Range<usize>)> = effects
        .into_iter()
        .filter_map(|e| match e {
            Effect::Store { msg_id, payload } => Some((msg_id, payload)),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 4, "s1 3, s1 4, s2 1, s2 2");
    for (msg_id, payload) in stored {
        assert_eq!(msg_id >> 16, 100);
        assert_eq!(places[(msg_id & 0xffff) as usize], payload, "message {msg_id:#x}");
    }
    assert_eq!(&entry[places[5].clone()], b"s2 3", "a refused message has its place too");
}

/// Issue 33, item 1: a tick of a queue that dead-letters expires at most its bound; the expired
/// messages left wait at the head, never delivered nor taken by basic.get, until a later tick.
/// Without dead-lettering (a drop costs nothing) expiry is not bounded.
#[test]
fn a_tick_dead_letters_at_most_its_bound_and_expired_messages_left_are_never_delivered() {
    let mut q = Q::new(QueueConfig { message_ttl_ms: Some(1000), dead_letter: true, ..QueueConfig::default() });
    q.publish(S1, 0, 1..=10, None);
    let (effects, _) = q.apply(|e| e.tick(2000, 4));
    assert_eq!(gone(&effects).len(), 4);
    assert!(q.m.head_expired());
    assert!(delivered_ids(&q.attach(C1, 100, 0), C1).is_empty(), "an expired message was delivered");
    let (_, reply) = q.apply(|e| e.dequeue(C2, false));
    assert_eq!(single(reply), Reply::Dequeued(None), "basic.get took an expired message");
    let (effects, _) = q.apply(|e| e.tick(2001, 0));
    assert!(gone(&effects).is_empty());
    let (effects, _) = q.apply(|e| e.tick(2002, u64::MAX));
    assert_eq!(gone(&effects).len(), 6);
    assert!(!q.m.head_expired());
    assert_eq!(q.m.ready_count(), 0);

    let mut q = Q::new(QueueConfig { message_ttl_ms: Some(1000), ..QueueConfig::default() });
    q.publish(S1, 0, 1..=10, None);
    let (effects, _) = q.apply(|e| e.tick(2000, 4));
    assert_eq!(gone(&effects).len(), 10, "dropped, not dead-lettered: all at once");
}

/// Issue 33, item 5: a message unassigned (assigned, never sent to the client) goes back as if never
/// assigned: delivered next not redelivered, its delivery count unchanged, never past the limit.
#[test]
fn an_unassigned_message_is_not_a_failed_delivery() {
    let mut q = Q::new(QueueConfig { delivery_limit: Some(0), dead_letter: true, ..QueueConfig::default() });
    q.publish(S1, 0, 1..=1, None);
    let id = delivered_ids(&q.attach(C1, 1, 0), C1)[0];
    for _ in 0..5 {
        let (effects, _) = q.apply(|e| {
            e.detach(C1, false);
            e.unassign(C1, &[id]);
        });
        assert!(gone(&effects).is_empty(), "dead-lettered: {effects:?}");
        assert_eq!((q.m.ready_count(), q.m.checked_out_count()), (1, 0));
        let effects = q.attach(C1, 1, 0);
        let d = &delivered(&effects)[0].1[0];
        assert_eq!((d.msg_id, d.redelivered, d.delivery_count), (id, false, 0));
    }
    // An ack of an unassigned id is ignored: the message is no longer the consumer's.
    let (_, _) = q.apply(|e| {
        e.detach(C1, false);
        e.unassign(C1, &[id]);
        e.settle(C1, &[id]);
    });
    assert_eq!(q.m.ready_count(), 1);
}


/// RabbitMQ 4's quorum queue priorities: messages above priority 4 go first, two for each normal
/// one while both wait, through requeues, snapshots and replays alike.
#[test]
fn high_priority_messages_go_two_for_each_normal_one() {
    let mut q = Q::new(QueueConfig::default());
    q.apply(|e| {
        e.begin_enqueue(S1, 1, false);
        for seq in 1..=3 {
            e.message(seq, 1, None, b"n").unwrap();
        }
        e.begin_enqueue(S1, 1, true);
        for seq in 4..=7 {
            e.message(seq, 1, None, b"h").unwrap();
        }
    });
    let index = q.index;
    let normal: Vec<MsgId> = (0..3).map(|i| msg_id(index, i)).collect();
    let high: Vec<MsgId> = (3..7).map(|i| msg_id(index, i)).collect();
    let restored = {
        let mut m = QuorumMachine::new(QueueConfig::default());
        m.restore(&q.m.snapshot()).unwrap();
        m
    };
    assert_eq!(restored, q.m);
    let effects = q.attach(C1, 0, 0);
    let order = delivered_ids(&effects, C1);
    assert_eq!(order, vec![high[0], high[1], normal[0], high[2], high[3], normal[1], normal[2]]);
    // A requeued high-priority message goes back to the head of its lane.
    q.apply(|e| e.return_(C1, &[high[3], normal[2]]));
    let snapshot = q.m.snapshot();
    let mut again = QuorumMachine::new(QueueConfig::default());
    again.restore(&snapshot).unwrap();
    assert_eq!(again.snapshot(), snapshot);
}

/// Publishes delayed messages (seq, delay) in one entry.
fn publish_delayed(q: &mut Q, now_ms: u64, msgs: &[(u64, u64)], ttl: Option<u64>) -> Vec<Effect> {
    let (effects, _) = q.apply(|e| {
        e.begin_enqueue_delayed(S1, now_ms, false);
        for &(s, delay) in msgs {
            e.message_delayed(s, 10, ttl, delay, format!("body {s}").as_bytes()).unwrap();
        }
    });
    effects
}

fn tick(q: &mut Q, now_ms: u64) -> Vec<Effect> {
    q.apply(|e| e.tick(now_ms, u64::MAX)).0
}

fn pop_all(m: &mut QuorumMachine) -> Vec<MsgId> {
    std::iter::from_fn(|| m.ready.pop().map(|(id, _)| id)).collect()
}

#[test]
fn a_delayed_message_is_ready_only_once_a_tick_reaches_its_due_time_in_due_then_publish_order() {
    let mut q = Q::new(QueueConfig::default());
    // Seqs 1..=3: due at 1000 + 500, 1000 + 200, 1000 + 500; stored at once, confirmed at once.
    let effects = publish_delayed(&mut q, 1000, &[(1, 500), (2, 200), (3, 500)], None);
    let ids: Vec<MsgId> = effects.iter().filter_map(|e| if let Effect::Store { msg_id, .. } = e { Some(*msg_id) } else { None }).collect();
    assert_eq!(ids.len(), 3);
    assert!(effects.iter().any(|e| matches!(e, Effect::Published { applied_up_to: 3, .. })));
    assert_eq!((q.m.ready_count(), q.m.delayed_count(), q.m.next_due()), (0, 3, Some(1200)));
    assert!(ids.iter().all(|id| q.m.is_live(*id)) && q.m.live_ids() == ids);
    // A consumer gets nothing before due.
    assert!(delivered(&q.attach(C1, 0, 0)).is_empty());
    assert!(delivered(&tick(&mut q, 1199)).is_empty());
    let got = delivered(&tick(&mut q, 1200));
    assert_eq!(got.iter().flat_map(|(_, d)| d.iter().map(|d| d.msg_id)).collect::<Vec<_>>(), vec![ids[1]]);
    assert!(!got[0].1[0].redelivered);
    let got = delivered(&tick(&mut q, 5000));
    assert_eq!(got.iter().flat_map(|(_, d)| d.iter().map(|d| d.msg_id)).collect::<Vec<_>>(), vec![ids[0], ids[2]]);
    assert_eq!((q.m.delayed_count(), q.m.next_due()), (0, None));
}

#[test]
fn a_due_message_joins_the_queue_after_what_was_enqueued_before_its_tick_and_before_what_comes_after() {
    let mut q = Q::new(QueueConfig::default());
    let d = publish_delayed(&mut q, 1000, &[(1, 100)], None);
    let Some(Effect::Store { msg_id: delayed, .. }) = d.first() else { panic!("{d:?}") };
    let delayed = *delayed;
    let (before, _) = q.publish(S1, 1000, 2..=3, None);
    tick(&mut q, 1100);
    let (after, _) = q.publish(S1, 1100, 4..=4, None);
    let stored = |effects: &[Effect]| -> Vec<MsgId> { effects.iter().filter_map(|e| if let Effect::Store { msg_id, .. } = e { Some(*msg_id) } else { None }).collect() };
    let mut want = stored(&before);
    want.push(delayed);
    want.extend(stored(&after));
    assert_eq!(pop_all(&mut q.m), want);
}

#[test]
fn a_due_message_gets_its_ttl_from_then_and_meets_the_length_limit_then() {
    // TTL 300 from due (not from publish): alive at due + 299, expired at due + 301.
    let mut q = Q::new(QueueConfig { message_ttl_ms: Some(300), dead_letter: true, ..QueueConfig::default() });
    publish_delayed(&mut q, 1000, &[(1, 1000)], None);
    tick(&mut q, 2000);
    assert_eq!(q.m.ready_count(), 1);
    tick(&mut q, 2299);
    assert_eq!(q.m.ready_count(), 1);
    let effects = tick(&mut q, 2301);
    assert!(effects.iter().any(|e| matches!(e, Effect::DeadLetter { reason: Reason::Expired, .. })), "{effects:?}");

    // Full with reject-publish: accepted while delayed (not counted), dead-lettered maxlen when due.
    let mut q = Q::new(QueueConfig { max_length: Some(1), overflow: Overflow::RejectPublish, dead_letter: true, ..QueueConfig::default() });
    q.publish(S1, 1000, 1..=1, None);
    let effects = publish_delayed(&mut q, 1000, &[(2, 50)], None);
    assert!(effects.iter().any(|e| matches!(e, Effect::Published { rejected, .. } if rejected.is_empty())), "{effects:?}");
    let effects = tick(&mut q, 1050);
    assert!(effects.iter().any(|e| matches!(e, Effect::DeadLetter { reason: Reason::MaxLen, .. })), "{effects:?}");
    assert_eq!((q.m.ready_count(), q.m.delayed_count()), (1, 0));

    // A purge leaves delayed messages; they come due after it.
    let mut q = Q::new(QueueConfig::default());
    publish_delayed(&mut q, 1000, &[(1, 50)], None);
    q.apply(|e| e.purge());
    assert_eq!(q.m.delayed_count(), 1);
    tick(&mut q, 1050);
    assert_eq!(q.m.ready_count(), 1);
}

#[test]
fn delayed_and_fired_messages_survive_a_snapshot() {
    let mut q = Q::new(QueueConfig { max_length_bytes: Some(1 << 20), ..QueueConfig::default() });
    publish_delayed(&mut q, 1000, &[(1, 10), (2, 20), (3, 5_000)], Some(100_000));
    q.publish(S1, 1000, 4..=5, None);
    tick(&mut q, 1020);
    assert_eq!((q.m.ready_count(), q.m.delayed_count(), q.m.ready_bytes()), (4, 1, 40));
    let mut restored = QuorumMachine::new(QueueConfig::default());
    restored.restore(&q.m.snapshot()).unwrap();
    assert_eq!(restored, q.m);
    assert_eq!(pop_all(&mut restored), pop_all(&mut q.m));
    // A version 2 snapshot (no delayed messages) still decodes.
    let mut plain = Q::new(QueueConfig::default());
    plain.publish(S1, 1000, 1..=2, None);
    let mut v4 = plain.m.snapshot().to_vec();
    assert_eq!(v4[0], 4);
    // Version 3: no retention (the config's last field, byte 10 of a default config, and the
    // four empty parts at the end).
    assert_eq!(v4.split_off(v4.len() - 4), vec![0, 0, 0, 0]);
    assert_eq!(v4.remove(10), 0);
    let mut v3 = v4;
    v3[0] = 3;
    let mut restored = QuorumMachine::new(QueueConfig::default());
    restored.restore(&v3).unwrap();
    assert_eq!(restored, plain.m);
    let mut v2 = v3;
    v2[0] = 2;
    v2.truncate(v2.len() - 3); // two empty fired lists and no delayed messages
    let mut restored = QuorumMachine::new(QueueConfig::default());
    restored.restore(&v2).unwrap();
    assert_eq!(restored, plain.m);
}

#[test]
fn delayed_enqueues_decode_and_encode_again_with_their_delays() {
    let mut e = Encoder::new();
    e.begin_enqueue(S1, 5, false);
    e.message(1, 3, None, b"abc").unwrap();
    assert!(e.message_delayed(2, 3, None, 10, b"abc").is_err(), "a delay needs an enqueue of delayed messages");
    e.begin_enqueue_delayed(S1, 5, true);
    e.message_delayed(2, 5, Some(100), 90_000, b"hello").unwrap();
    assert!(e.message(3, 3, None, b"abc").is_err(), "an enqueue of delayed messages takes only delayed ones");
    let entry = e.finish();
    // (pub seq, delay, high, payload) of each message of an entry.
    let messages = |entry: &[u8]| -> Vec<(u64, u64, bool, Vec<u8>)> {
        let cmds = match Command::decode(entry).unwrap() {
            Command::Batch(c) => c,
            c => vec![c],
        };
        cmds.iter()
            .flat_map(|c| match c {
                Command::Enqueue { msgs, .. } => msgs.iter().map(|m| (m.pub_seq, m.delay_ms, m.high, entry[m.payload.clone()].to_vec())).collect(),
                _ => Vec::new(),
            })
            .collect()
    };
    assert_eq!(messages(&entry), vec![(1, 0, false, b"abc".to_vec()), (2, 90_000, true, b"hello".to_vec())]);
    let mut again = Encoder::new();
    again.push(&Command::decode(&entry).unwrap(), &entry).unwrap();
    assert_eq!(messages(&again.finish()), messages(&entry));
    assert_eq!(Command::enqueued_payloads(&entry).unwrap().len(), 2);
}

#[test]
fn a_delayed_message_fired_in_the_entry_that_enqueued_it_comes_after_the_messages_before_it() {
    // One entry: five messages, a delayed one due 1 ms later, and a Tick past its due time (the
    // leader's open entry collects publishes and its Tick alike).
    let mut q = Q::new(QueueConfig::default());
    let (effects, _) = q.apply(|e| {
        e.begin_enqueue(S1, 1000, false);
        for s in 1..=5 {
            e.message(s, 10, None, b"m").unwrap();
        }
        e.begin_enqueue_delayed(S1, 1000, false);
        e.message_delayed(6, 10, None, 1, b"d").unwrap();
        e.tick(1002, u64::MAX);
    });
    let ids: Vec<MsgId> = effects.iter().filter_map(|e| if let Effect::Store { msg_id, .. } = e { Some(*msg_id) } else { None }).collect();
    assert_eq!((ids.len(), q.m.delayed_count(), q.m.ready_count()), (6, 0, 6));
    // A get takes the first message; the state (one checked out, the rest ready) round-trips.
    let (_, reply) = q.apply(|e| e.dequeue(C1, false));
    assert!(matches!(single(reply), Reply::Dequeued(Some(d)) if d.msg_id == ids[0]));
    let mut restored = QuorumMachine::new(QueueConfig::default());
    restored.restore(&q.m.snapshot()).unwrap();
    assert_eq!(restored, q.m);
    assert_eq!(pop_all(&mut q.m), ids[1..].to_vec());
}

#[test]
fn a_tick_dead_letters_at_most_its_bound_of_due_delayed_messages_and_leaves_the_rest_due() {
    let mut q = Q::new(QueueConfig { max_length: Some(1), overflow: Overflow::RejectPublish, dead_letter: true, ..QueueConfig::default() });
    q.publish(S1, 1000, 1..=1, None);
    publish_delayed(&mut q, 1000, &(2..=11).map(|s| (s, 50)).collect::<Vec<_>>(), None);
    let dead = |effects: &[Effect]| -> u32 {
        effects.iter().map(|e| if let Effect::DeadLetter { reason: Reason::MaxLen, msgs } = e { msgs.iter().map(|r| r.1).sum() } else { 0 }).sum()
    };
    let (effects, _) = q.apply(|e| e.tick(1050, 3));
    assert_eq!((dead(&effects), q.m.delayed_count()), (3, 7));
    assert!(q.m.due_left());
    let (effects, _) = q.apply(|e| e.tick(1051, 100));
    assert_eq!((dead(&effects), q.m.delayed_count()), (7, 0));
    assert!(!q.m.due_left());
}

#[test]
fn a_snapshot_with_a_message_both_checked_out_and_fresh_in_the_other_lane_is_refused() {
    // Found by the fuzz target (2026-11-29): consumer (1, 1) holds id 1 (normal lane) while the high
    // lane's fresh run starts at 1; once restored, delivering id 1 again counted it twice.
    let snapshot = hex("020400001500010000914e05000100070200030000010001010507fc070002010100020002000281800008010000008280080001000400020102000100000002020102010000010101000000000282800c0100910883800c010000000000010180100000800000");
    let mut m = QuorumMachine::new(QueueConfig::default());
    let e = m.restore(&snapshot).unwrap_err();
    assert!(e.to_string().contains("fresh message"), "{e}");
    // And the lanes' fresh runs may not share an id, whatever their steps.
    let mut q = Q::new(QueueConfig::default());
    q.publish(S1, 0, 1..=3, None);
    let mut snap = q.m.snapshot().to_vec();
    let mut restored = QuorumMachine::new(QueueConfig::default());
    restored.restore(&snap).unwrap();
    restored.ready.high = restored.ready.normal.clone();
    for s in restored.ready.high.returned.values_mut() {
        s.high = true;
    }
    snap = restored.snapshot().to_vec();
    let e = QuorumMachine::new(QueueConfig::default()).restore(&snap).unwrap_err();
    assert!(e.to_string().contains("both priority lanes"), "{e}");
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

// ---- retention and rewind ----

/// Ten single-message entries published at 1000, 1100, ..., 1900 (seqs 1..=10); their ids.
fn publish_ten(q: &mut Q) -> Vec<MsgId> {
    (0..10u64)
        .map(|k| {
            q.publish(S1, 1000 + 100 * k, k + 1..=k + 1, None);
            msg_id(q.index, 0)
        })
        .collect()
}

fn rewind(q: &mut Q, to_ms: u64) -> (Vec<Effect>, Reply) {
    let (effects, reply) = q.apply(|e| e.rewind(to_ms));
    (effects, single(reply))
}

#[test]
fn a_rewind_brings_back_consumed_messages_from_a_time_on_in_order_and_redelivered() {
    let mut q = Q::new(QueueConfig { retention_ms: Some(60_000), ..QueueConfig::default() });
    let ids = publish_ten(&mut q);
    // C1 takes all ten, acks the first eight; two stay unacked.
    let held = delivered_ids(&q.attach(C1, 100, 0), C1);
    assert_eq!(held, ids);
    q.apply(|e| e.settle(C1, &ids[..8]));
    assert_eq!((q.m.retained_count(), q.m.ready_count()), (8, 0));
    // Rewind to the 4th publish's time (1300): 4..=8 come back; 9 and 10 stay with C1.
    q.apply(|e| e.detach(C1, false));
    let (_, reply) = rewind(&mut q, 1300);
    assert_eq!(reply, Reply::Rewound { count: 5, from_ms: Some(1300), clamped: false });
    assert_eq!((q.m.retained_count(), q.m.ready_count(), q.m.checked_out_count()), (3, 5, 2));
    // A second rewind to the same time duplicates nothing: those are ready already.
    assert_eq!(rewind(&mut q, 1300).1, Reply::Rewound { count: 0, from_ms: Some(1300), clamped: false });
    let effects = q.attach(C2, 100, 0);
    let got = delivered(&effects);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].1.iter().map(|d| d.msg_id).collect::<Vec<_>>(), ids[3..8]);
    assert!(got[0].1.iter().all(|d| d.redelivered && d.delivery_count == 0));
    q.apply(|e| e.settle(C2, &ids[3..8]));
    q.apply(|e| e.detach(C2, true));
    // Between two publishes: from the one after.
    let (_, reply) = rewind(&mut q, 1350);
    assert_eq!(reply, Reply::Rewound { count: 4, from_ms: Some(1400), clamped: false });
    // Before the oldest kept: from the oldest, said so.
    let (effects, reply) = rewind(&mut q, 10);
    assert_eq!(reply, Reply::Rewound { count: 4, from_ms: Some(1000), clamped: true });
    assert!(effects.iter().any(|e| matches!(e, Effect::Rewound { runs } if runs.iter().map(|r| r.count as u64).sum::<u64>() == 4)));
    // Returned messages and rewound ones come back in id order, all before fresh ones.
    q.publish(S1, 2000, 11..=11, None);
    let fresh = msg_id(q.index, 0);
    let got = delivered_ids(&q.attach(C3, 100, 0), C3);
    let mut expected = ids[..8].to_vec();
    expected.push(fresh);
    assert_eq!(got[..], expected[..]);
}

#[test]
fn retention_ends_by_the_clock_and_a_queue_without_it_keeps_nothing() {
    let mut q = Q::new(QueueConfig { retention_ms: Some(5_000), ..QueueConfig::default() });
    let ids = publish_ten(&mut q);
    let held = delivered_ids(&q.attach(C1, 100, 0), C1);
    q.apply(|e| e.settle(C1, &held));
    assert_eq!(q.m.retained_count(), 10);
    // Kept while the retention of the next sample lasts: 1000's message ends once 1100 + 5000 passed.
    tick(&mut q, 6_099);
    assert_eq!(q.m.retained_count(), 10);
    tick(&mut q, 6_100);
    assert_eq!(q.m.retained_count(), 9);
    assert_eq!(q.m.retention_floor(), ids[1]);
    tick(&mut q, 7_000);
    assert_eq!((q.m.retained_count(), q.m.retention_floor()), (0, msg_id(q.index, 0)));
    assert_eq!(rewind(&mut q, 0).1, Reply::Rewound { count: 0, from_ms: None, clamped: false });
    // A snapshot keeps what retention holds.
    let mut q = Q::new(QueueConfig { retention_ms: Some(5_000), ..QueueConfig::default() });
    let ids = publish_ten(&mut q);
    let held = delivered_ids(&q.attach(C1, 100, 0), C1);
    q.apply(|e| e.settle(C1, &held));
    q.apply(|e| e.detach(C1, true));
    rewind(&mut q, 1500);
    let mut restored = QuorumMachine::new(QueueConfig::default());
    restored.restore(&q.m.snapshot()).unwrap();
    assert_eq!(restored, q.m);
    assert_eq!(restored.ready_count(), 5);
    assert_eq!(restored.retained_entries().collect::<Vec<_>>(), ids[..5].iter().map(|id| id >> 16).collect::<Vec<_>>());
    // Without retention: nothing kept, a rewind finds nothing.
    let mut q = Q::new(QueueConfig::default());
    publish_ten(&mut q);
    let held = delivered_ids(&q.attach(C1, 100, 0), C1);
    q.apply(|e| e.settle(C1, &held));
    assert_eq!(q.m.retained_count(), 0);
    assert_eq!(rewind(&mut q, 0).1, Reply::Rewound { count: 0, from_ms: None, clamped: false });
}

#[test]
fn every_way_out_of_the_queue_is_kept_for_a_rewind() {
    let mut q = Q::new(QueueConfig { retention_ms: Some(60_000), max_length: Some(8), dead_letter: true, ..QueueConfig::default() });
    let ids = publish_ten(&mut q); // two dropped by max-length (dead-lettered maxlen)
    assert_eq!(q.m.retained_count(), 2);
    let (effects, _) = q.apply(|e| e.dequeue(C2, true)); // auto-ack get
    assert_eq!(delivered_ids(&effects, C2), vec![ids[2]]);
    let held = delivered_ids(&q.attach(C1, 3, 0), C1);
    q.apply(|e| e.discard(C1, &held[..1])); // rejected
    q.apply(|e| e.settle(C1, &held[1..])); // acked
    q.apply(|e| e.detach(C1, true)); // what C1 took since goes back
    q.apply(|e| e.purge()); // the rest
    assert_eq!((q.m.retained_count(), q.m.ready_count()), (10, 0));
    assert_eq!(rewind(&mut q, 0).1, Reply::Rewound { count: 10, from_ms: Some(1000), clamped: true });
}

#[test]
fn retention_with_a_byte_limit_is_refused_on_quorum_queues() {
    let args = crate::queue_args::QueueArgs { retention_ms: 60_000, max_length_bytes: Some(1000), ..Default::default() };
    let refused = QueueConfig::from_queue_args(&args, None).unwrap_err();
    assert!(refused.contains("x-max-length-bytes"), "{refused}");
    let args = crate::queue_args::QueueArgs { retention_ms: 60_000, max_length: Some(10), ..Default::default() };
    assert_eq!(QueueConfig::from_queue_args(&args, None).unwrap().retention_ms, Some(60_000));
}
