//! The classic-queue requests between nodes (`warren_broker::queue::remote::wire`): arbitrary bytes
//! as a peer's request or answer. Decoding may refuse, never panic; a request that decodes
//! re-encodes to the same bytes' meaning (decode ∘ encode is the identity on decoded requests).
//!
//! Input: `kind u8 | bytes`: kind 0 a request, 1 an answer to a batch of 3 publishes, 2 an answer
//! to a relay check (or a purge's or stat's counts), 3 an answer to a get.

use bytes::Bytes;
use warren_broker::channel::Settle;
use warren_broker::queue::remote::wire::{decode_flags, decode_got, decode_ids, encode_flags, encode_got, encode_ids, GotMessage, QueueRef, Relayed, Request};

pub fn check_classic(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else { return };
    let bytes = Bytes::copy_from_slice(rest);
    match kind % 4 {
        0 => {
            if let Ok(request) = Request::decode(&bytes) {
                let again = Request::decode(&request.encode()).expect("a decoded request re-encodes to one that decodes");
                assert_eq!(again, request, "a request changes through encode and decode");
            }
        }
        1 => {
            if let Ok(flags) = decode_flags(rest, 3) {
                assert_eq!(decode_flags(&encode_flags(&flags), 3).ok(), Some(flags));
            }
        }
        2 => {
            if let Ok(ids) = decode_ids(rest) {
                assert_eq!(decode_ids(&encode_ids(&ids)).ok(), Some(ids));
            }
        }
        _ => {
            if let Ok(got) = decode_got(&bytes) {
                assert_eq!(decode_got(&encode_got(got.as_ref())).ok(), Some(got));
            }
        }
    }
}

/// One valid input of every kind.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let queue = QueueRef { vhost: "/".into(), name: "orders".into(), id: 42 };
    let requests = [
        ("publish", Request::Publish { queue: queue.clone(), messages: vec![Bytes::from_static(b"\x02body")] }),
        ("open", Request::Open { queue: queue.clone(), relay: 7 << 32 | 1, tag: "ctag".into(), prefetch: 100, no_ack: false, exclusive: false, priority: 0 }),
        ("settle", Request::Settle { relay: 1, how: Settle::Reject { requeue: true }, tags: vec![1, 2, 3] }),
        ("cancel", Request::Cancel { relay: 1 }),
        ("close", Request::Close { relay: 1 }),
        ("check", Request::Check { relays: vec![1, 2] }),
        ("get", Request::Get { queue: queue.clone(), relay: 7 << 32 | 2, no_ack: false }),
        ("purge", Request::Purge { queue: queue.clone() }),
        ("stat", Request::Stat { queue: queue.clone() }),
        ("deliver", Request::Deliver { queue, relay: 1, deliveries: vec![Relayed { tag: 1, redelivered: true, message: Bytes::from_static(b"m") }] }),
    ];
    let mut out: Vec<(String, Vec<u8>)> = requests
        .into_iter()
        .map(|(name, r)| {
            let mut input = vec![0];
            input.extend_from_slice(&r.encode());
            (format!("request-{name}"), input)
        })
        .collect();
    let mut flags = vec![1];
    flags.extend_from_slice(&encode_flags(&[false, true, false]));
    out.push(("answer-flags".into(), flags));
    let mut ids = vec![2];
    ids.extend_from_slice(&encode_ids(&[5, 6]));
    out.push(("answer-ids".into(), ids));
    let mut got = vec![3];
    got.extend_from_slice(&encode_got(Some(&GotMessage { delivery: Relayed { tag: 3, redelivered: false, message: Bytes::from_static(b"\x02body") }, remaining: 9 })));
    out.push(("answer-got".into(), got));
    out
}
