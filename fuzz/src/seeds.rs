//! The seed corpus: valid inputs for every target, so the fuzzers start from real frames, methods,
//! properties, tables and stores rather than from nothing. Built from the codec tests' samples (one
//! value of every method, a table with every field type, every property) and the store's own API;
//! `examples/seed_corpus.rs` writes them to `fuzz/corpus/<target>/`.

use bytes::BytesMut;
use warren_protocol::frame;
use warren_protocol::properties::BasicProperties;

use crate::store;

#[path = "../../crates/protocol/tests/common/mod.rs"]
mod samples;
use samples::*;

/// `(target, seed name, bytes)`.
pub type Seed = (&'static str, String, Vec<u8>);

fn method_name(m: &warren_protocol::Method) -> String {
    spec(m).name.to_string()
}

/// A frame-stream input: `mode` (frame_max 131072), the chunk sizes, then the stream.
fn stream(sizes: &[u8], frames: &[u8]) -> Vec<u8> {
    let mut out = vec![2, sizes.len() as u8];
    out.extend_from_slice(sizes);
    out.extend_from_slice(frames);
    out
}

pub fn protocol_seeds() -> Vec<Seed> {
    let mut out: Vec<Seed> = Vec::new();
    let props = BasicProperties { headers: Some(args()), ..all_properties() };
    let props_raw = encode_props(&props);

    // Methods, bare, with their bits all set and all clear.
    let mut all_frames = BytesMut::new();
    for m in every_method() {
        let name = method_name(&m);
        out.push(("methods", name.clone(), encode_method(&m).to_vec()));
        let (ones, n) = with_bits(&m, u32::MAX);
        if n > 0 {
            out.push(("methods", format!("{name}-bits-set"), encode_method(&ones).to_vec()));
            out.push(("methods", format!("{name}-bits-clear"), encode_method(&with_bits(&m, 0).0).to_vec()));
        }
        let mut f = BytesMut::new();
        frame::write_method(&mut f, 1, &m);
        out.push(("frames", name, stream(&[0, 6, 200], &f)));
        all_frames.extend_from_slice(&f);
    }
    // Every method back to back, fed whole-ish and byte by byte.
    out.push(("frames", "every-method".into(), stream(&[255], &all_frames)));
    out.push(("frames", "every-method-bytewise".into(), stream(&[], &all_frames)));

    // Content: method, header, body frames (the body split by a small frame_max), heartbeats, confirms.
    let mut content = BytesMut::new();
    frame::write_basic_deliver(&mut content, 2, "ctag", 9, true, "ex", "rk", &props_raw, &[b'b'; 300], 4096);
    frame::write_heartbeat(&mut content);
    frame::write_basic_get_ok(&mut content, 3, 10, false, "", "q", 5, &encode_props(&BasicProperties::default()), b"", 4096);
    frame::write_basic_return(&mut content, 4, 312, "NO_ROUTE", "ex", "rk", &props_raw, b"returned", 4096);
    frame::write_basic_ack(&mut content, 5, 77, true);
    frame::write_content(&mut content, 6, 60, &props_raw, &[b'x'; 200], 64);
    out.push(("frames", "content".into(), stream(&[7, 0, 31, 255, 2], &content)));

    // Properties: all of them, none, and subsets.
    let all = all_properties();
    for mask in [0x3fffu16, 0, 0b100, 0b1000_1000, 0x2a2a, 0x1555, 1 << 2, 1 << 11] {
        out.push(("properties", format!("mask-{mask:04x}"), encode_props(&subset(&all, mask)).to_vec()));
        out.push(("properties", format!("small-headers-mask-{mask:04x}"), encode_props(&subset(&props, mask)).to_vec()));
    }
    // A continuation flag word after the first.
    out.push(("properties", "continuation".into(), vec![0x00, 0x01, 0x00, 0x00]));

    // Field tables: every type, each type alone, nesting at the depth limit.
    out.push(("field_tables", "every-type".into(), encode_table(&every_type_table()).to_vec()));
    out.push(("field_tables", "args".into(), encode_table(&args()).to_vec()));
    out.push(("field_tables", "empty".into(), vec![0, 0, 0, 0]));
    for (key, value) in every_type_table().iter() {
        let t = warren_protocol::FieldTable(vec![(key.clone(), value.clone())]);
        let name: String = key.chars().filter(char::is_ascii_alphanumeric).take(20).collect();
        out.push(("field_tables", format!("one-{name}-{}", out.len()), encode_table(&t).to_vec()));
    }
    out.push(("field_tables", "nested-tables".into(), nested_wire(b'F', warren_protocol::field::MAX_DEPTH)));
    out.push(("field_tables", "nested-arrays".into(), nested_wire(b'A', warren_protocol::field::MAX_DEPTH)));
    out
}

/// Store-recovery inputs: each base store as built, resealed, and with the damage a crash or a disk
/// does (a cut or garbled WAL tail, a garbled checkpoint or queue segment, a lost file).
pub fn store_seeds() -> Vec<Seed> {
    let mut out: Vec<Seed> = Vec::new();
    for (base, base_name) in store::BASES.iter().enumerate() {
        let files = &store::bases()[base];
        let names = store::file_names(base);
        let flags = base as u8;
        // The last of the base's own files that `pred` picks.
        let index = |pred: &dyn Fn(&str) -> bool| {
            names.iter().rposition(|p| pred(&p.to_string_lossy()) && files.iter().any(|(f, _)| f == p))
        };
        let size = |idx: usize| files.iter().find(|(p, _)| *p == names[idx]).map_or(0, |(_, d)| d.len()) as u32;
        let mut push = |name: &str, flags: u8, edits: Vec<store::Edit>| {
            let mut input = vec![flags];
            edits.iter().for_each(|e| e.encode(&mut input));
            out.push(("store_recovery", format!("{base_name}-{name}"), input));
        };
        push("intact", flags, vec![]);
        push("resealed", flags | 2 | 4 | 8, vec![]);
        let op = |idx: usize, kind: u8| (idx * 5) as u8 + kind;
        if let Some(wal) = index(&|p| p.ends_with(".wlog")) {
            let len = size(wal);
            push("wal-tail-cut", flags, vec![store::Edit { op: op(wal, 2), at: len - len / 3, data: vec![] }]);
            push("wal-tail-garbled", flags, vec![store::Edit { op: op(wal, 0), at: len / 2, data: vec![0x5a; 64] }]);
            push("wal-record-forged", flags | 2, vec![store::Edit { op: op(wal, 0), at: 32 + 8 + 9, data: vec![0xff; 8] }]);
        }
        if let Some(first_wal) = index(&|p| p.ends_with("00000000000000000000.wlog")) {
            push("old-wal-garbled", flags, vec![store::Edit { op: op(first_wal, 0), at: 200, data: vec![0; 16] }]);
        }
        if let Some(cp) = index(&|p| p == "checkpoint") {
            push("checkpoint-gone", flags, vec![store::Edit { op: op(cp, 3), at: 0, data: vec![] }]);
            push("checkpoint-forged", flags | 8, vec![store::Edit { op: op(cp, 0), at: 20, data: vec![0xff, 0xff, 0, 0, 0, 0, 0, 1] }]);
            push("checkpoint-garbled", flags, vec![store::Edit { op: op(cp, 0), at: 30, data: vec![1, 2, 3] }]);
        }
        if let Some(qseg) = index(&|p| p.ends_with(".qseg")) {
            let len = size(qseg);
            push("qseg-cut", flags, vec![store::Edit { op: op(qseg, 2), at: len / 2, data: vec![] }]);
            push("qseg-gone", flags, vec![store::Edit { op: op(qseg, 3), at: 0, data: vec![] }]);
            push("qseg-forged", flags | 2, vec![store::Edit { op: op(qseg, 0), at: 32 + 8 + 9 + 8, data: vec![0x10; 8] }]);
        }
        let named = |name: &str| names.iter().position(|p| p.to_string_lossy() == name).expect("an extra file");
        push("stray-files", flags, vec![
            store::Edit { op: op(named(store::EXTRA_FILES[0]), 4), at: 0, data: store_header_and_junk() },
            store::Edit { op: op(named(store::EXTRA_FILES[2]), 4), at: 0, data: vec![7; 100] },
            store::Edit { op: op(named(store::EXTRA_FILES[4]), 4), at: 0, data: b"half a checkpoint".to_vec() },
        ]);
    }
    out
}

/// A valid WAL segment header followed by bytes that are no record.
fn store_header_and_junk() -> Vec<u8> {
    let mut v = warren_store::format::encode_wal_header().to_vec();
    v.extend_from_slice(&[0xab; 40]);
    v
}
