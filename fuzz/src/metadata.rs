//! The metadata recovery fuzz target: the broker's durable topology log (`metadata.log`, see
//! `warren_broker::metadata`) or the `definitions.json` of earlier versions, with arbitrary bytes.
//! Opening may refuse with an error (bad header, corruption in the middle, a record that is not
//! JSON), but must never panic; if it opens, it opens again after, to the same topology (recovery
//! leaves a log it can recover).
//!
//! Input: `flags | file`. `flags` bit 0 opens in the mode that skips corruption (else refuses),
//! bit 1 reseals the frames' checksums and bit 2 the header's (so the bytes reach the JSON decoder
//! and the topology), bit 3 writes `file` as `definitions.json` (the import) instead of the log.

use std::path::Path;

use warren_broker::definitions::{BindingDef, ExchangeDef, QueueDef, VHostDefs};
use warren_broker::metadata::log::{encode_header, OnCorruption, HEADER_SIZE};
use warren_broker::metadata::{Metadata, Op, FILE_NAME};

const FRAME_HEADER: usize = 8;

/// Rewrites the checksums of the header and of every frame whose length fits.
fn reseal(data: &mut [u8], frames: bool, header: bool) {
    let h = HEADER_SIZE as usize;
    if header && data.len() >= h {
        let crc = crc32c::crc32c(&data[..12]);
        data[12..16].copy_from_slice(&crc.to_le_bytes());
    }
    let mut at = h;
    while frames && at + FRAME_HEADER <= data.len() {
        let len = u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]) as usize;
        let Some(end) = (at + FRAME_HEADER).checked_add(len).filter(|&e| len > 0 && e <= data.len()) else { break };
        let crc = crc32c::crc32c_append(crc32c::crc32c(&data[at..at + 4]), &data[at + FRAME_HEADER..end]);
        data[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
        at = end;
    }
}

/// Everything the topology says, to compare two opens.
fn topology(m: &Metadata) -> (Vec<(String, VHostDefs)>, u64) {
    (m.vhost_names().into_iter().map(|v| (v.clone(), m.vhost(&v))).collect(), m.next_queue_id())
}

pub fn check_metadata(input: &[u8]) {
    let Some((&flags, file)) = input.split_first() else { return };
    let dir = crate::store::scratch_dir("meta");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut data = file.to_vec();
    if flags & 8 != 0 {
        std::fs::write(dir.join(warren_broker::definitions::FILE_NAME), &data).expect("write");
    } else {
        reseal(&mut data, flags & 2 != 0, flags & 4 != 0);
        std::fs::write(dir.join(FILE_NAME), &data).expect("write");
    }
    let mode = if flags & 1 != 0 { OnCorruption::Skip } else { OnCorruption::Refuse };
    if let Ok((m, _)) = Metadata::open(&dir, mode) {
        let first = topology(&m);
        drop(m);
        let (m, report) = Metadata::open(&dir, OnCorruption::Refuse)
            .unwrap_or_else(|e| panic!("a metadata log that opened once is refused the second time: {e}"));
        assert!(report.skipped.is_empty() && report.torn_tail_at.is_none(), "the second open found damage: {report:?}");
        assert_eq!(topology(&m), first, "the second open sees another topology");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A log as the broker writes it: every kind of change, in two vhosts.
pub fn sample_log(dir: &Path) -> Vec<u8> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("mkdir");
    let (m, _) = Metadata::open(dir, OnCorruption::Refuse).expect("open a new log");
    let args = serde_json::json!({"x-message-ttl": 60000, "x-dead-letter-exchange": "dlx", "nested": {"list": [1, "two", true, null, 2.5]}});
    let ex = |name: &str| ExchangeDef { name: name.into(), kind: "topic".into(), auto_delete: false, internal: false, arguments: args.clone() };
    let q = |name: &str, id| QueueDef { name: name.into(), id, auto_delete: false, arguments: args.clone(), home: None, members: None, leader: None, members_changed: false, transient: None };
    let b = |source: &str, destination: &str, kind: &str| BindingDef {
        source: source.into(),
        destination: destination.into(),
        destination_type: kind.into(),
        routing_key: "a.*.c".into(),
        arguments: serde_json::json!({}),
    };
    for vhost in ["/", "other"] {
        let v = || vhost.to_string();
        let ops = [
            vec![Op::ExchangeDeclared { vhost: v(), exchange: ex("orders") }, Op::ExchangeDeclared { vhost: v(), exchange: ex("dlx") }],
            vec![Op::QueueDeclared { vhost: v(), queue: q("q1", 1) }, Op::QueueDeclared { vhost: v(), queue: q("q2", 2) }],
            vec![Op::Bound { vhost: v(), binding: b("orders", "q1", "queue") }, Op::Bound { vhost: v(), binding: b("orders", "dlx", "exchange") }],
            vec![Op::Unbound { vhost: v(), binding: b("orders", "dlx", "exchange") }],
            vec![Op::QueueMembers { vhost: v(), name: "q1".into(), id: 1, members: vec![1, 2, 4] }],
            vec![Op::QueueDeleted { vhost: v(), name: "q2".into(), id: 2 }, Op::ExchangeDeleted { vhost: v(), name: "dlx".into() }],
            vec![Op::NextQueueId { value: 9 }],
        ];
        for change in ops {
            m.commit(change).expect("commit");
        }
    }
    drop(m);
    let bytes = std::fs::read(dir.join(FILE_NAME)).expect("read the log");
    let _ = std::fs::remove_dir_all(dir);
    bytes
}

/// A `definitions.json` as earlier versions wrote it.
pub fn sample_definitions() -> Vec<u8> {
    let text = r#"{"version":1,"next_queue_id":4,"vhosts":{"/":{"exchanges":[{"name":"orders","type":"direct","auto_delete":false,"internal":false,"arguments":{}}],"queues":[{"name":"q1","id":1,"auto_delete":false,"arguments":{"x-max-length":10}},{"name":"q3","id":3,"auto_delete":true,"arguments":{}}],"bindings":[{"source":"orders","destination":"q1","destination_type":"queue","routing_key":"k","arguments":{}}]}}}"#;
    text.as_bytes().to_vec()
}

/// Seeds: the sample log (as is, resealed, with a torn tail), the bare header, the legacy file.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let log = sample_log(&crate::store::scratch_dir("meta-seed"));
    let with = |flags: u8, bytes: &[u8]| {
        let mut v = vec![flags];
        v.extend_from_slice(bytes);
        v
    };
    let mut torn = log.clone();
    torn.truncate(log.len() - 5);
    // A record declaring queue id u64::MAX: its next id overflowed (the fix has a unit test).
    let mut queue_id_max = encode_header().to_vec();
    let op = br#"[{"op":"queue_declared","vhost":"/","queue":{"name":"q","id":18446744073709551615,"auto_delete":false,"arguments":{}}}]"#;
    queue_id_max.extend_from_slice(&warren_broker::metadata::log::encode_frame(op).expect("a frame"));
    let mut garbled_middle = log.clone();
    garbled_middle[HEADER_SIZE as usize + 20] ^= 0x40;
    vec![
        ("log".into(), with(0, &log)),
        ("log-resealed".into(), with(2 | 4, &log)),
        ("log-torn-tail".into(), with(0, &torn)),
        ("log-corrupt-middle".into(), with(0, &garbled_middle)),
        ("log-corrupt-middle-skipped".into(), with(1, &garbled_middle)),
        ("header-only".into(), with(0, &encode_header())),
        ("definitions-json".into(), with(8, &sample_definitions())),
        ("queue-id-max".into(), with(2 | 4, &queue_id_max)),
    ]
}
