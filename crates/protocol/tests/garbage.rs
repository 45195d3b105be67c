//! Hostile input: random bytes, and random mutations (bit flips, overwrites, cuts, insertions,
//! deletions) of valid methods, properties, field tables and frames. Every decoder must return
//! Ok or Err, never panic; errors carry protocol reply codes; and where two decoders read the
//! same bytes (full decode vs. allocation-free view/validator) they must agree. Fixed seeds.
//! Tables nested far beyond MAX_DEPTH are refused without exhausting the stack.

mod common;

use bytes::{BufMut, BytesMut};
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::panic::{catch_unwind, AssertUnwindSafe};
use warren_protocol::constants as c;
use warren_protocol::error::FrameError;
use warren_protocol::field::{validate_table, FieldTable, MAX_DEPTH};
use warren_protocol::frame::{self, Frame};
use warren_protocol::method::{Method, QueueDeclare};
use warren_protocol::properties::{BasicProperties, PropertiesView};

const FRAME_MAX: u32 = 131_072;

/// Runs `f`, turning a panic into a test failure that shows the input.
fn guard<T>(what: &str, input: &[u8], f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => panic!("{what} panicked on input {}", hex(input)),
    }
}

fn assert_protocol_error(e: &FrameError, what: &str, input: &[u8]) {
    assert!([c::FRAME_ERROR, c::SYNTAX_ERROR, c::NOT_IMPLEMENTED].contains(&e.reply_code()), "{what}: {e} on {}", hex(input));
    assert!(!e.to_string().is_empty());
}

fn table_bytes(t: &FieldTable) -> Vec<u8> {
    encode_table(t).to_vec()
}

/// Which decoders accepted an input (to show the mutations reach past the first check).
#[derive(Default, Debug)]
struct Accepted {
    methods: usize,
    tables: usize,
    properties: usize,
    frames: usize,
}

/// Feeds `input` to every decoder and checks what they say against each other.
fn check_all(input: &[u8], acc: &mut Accepted) {
    // Methods: a decoded method re-encodes to bytes that decode to the same bytes again.
    match guard("Method::decode", input, || Method::decode(input)) {
        Ok(m) => {
            acc.methods += 1;
            let once = encode_method(&m);
            let again = Method::decode(&once).unwrap_or_else(|e| panic!("re-decode of {}: {e}", m.name()));
            assert_eq!(encode_method(&again), once, "method encoding is a fixpoint");
        }
        Err(e) => assert_protocol_error(&e, "Method::decode", input),
    }

    // Field tables: decoder vs. validator.
    let decoded = guard("FieldTable::decode", input, || FieldTable::decode(input));
    let validated = guard("validate_table", input, || validate_table(input));
    let exact = input.len() >= 4 && u32::from_be_bytes(input[..4].try_into().unwrap()) as usize == input.len() - 4;
    match &decoded {
        Ok(t) => {
            acc.tables += 1;
            let once = table_bytes(t);
            assert_eq!(table_bytes(&FieldTable::decode(&once).expect("re-decode")), once, "table encoding is a fixpoint");
            if exact {
                assert!(validated.is_ok(), "decoder accepts, validator refuses: {:?} on {}", validated, hex(input));
            }
        }
        Err(e) => assert_protocol_error(e, "FieldTable::decode", input),
    }
    if validated.is_ok() {
        // The validator does not check key UTF-8; that is the only thing the decoder may add.
        if let Err(e) = &decoded {
            assert!(matches!(e, FrameError::Syntax { detail, .. } if detail.contains("UTF-8")), "validator accepts, decoder: {e}");
        }
    }

    // Properties: full decode vs. allocation-free view.
    let full = guard("BasicProperties::decode", input, || BasicProperties::decode(input));
    let view = guard("PropertiesView::new", input, || PropertiesView::new(input));
    let headers = guard("PropertiesView::headers", input, || view.as_ref().ok().and_then(|v| v.headers()));
    match &full {
        Ok(p) => {
            acc.properties += 1;
            let v = view.as_ref().unwrap_or_else(|e| panic!("decode accepts, view refuses ({e}): {}", hex(input)));
            assert_eq!(v.delivery_mode(), p.delivery_mode);
            assert_eq!(v.priority(), p.priority);
            assert_eq!(v.expiration(), p.expiration.as_deref());
            assert_eq!(v.user_id(), p.user_id.as_deref().map(str::as_bytes));
            assert_eq!(v.timestamp(), p.timestamp);
            let view_headers = headers.map(|h| table_bytes(&h.expect("headers the decoder accepted")));
            assert_eq!(view_headers, p.headers.as_ref().map(table_bytes));
            let once = encode_props(p);
            assert_eq!(encode_props(&BasicProperties::decode(&once).expect("re-decode")), once, "properties encoding is a fixpoint");
        }
        Err(e) => assert_protocol_error(e, "BasicProperties::decode", input),
    }
    if let Err(e) = &view {
        assert!(full.is_err(), "view refuses ({e}), decoder accepts");
    }

    // Frames: parse as a stream until it needs more or fails.
    let mut buf = BytesMut::from(input);
    loop {
        let before = buf.len();
        match guard("parse_frame", input, || frame::parse_frame(&mut buf, FRAME_MAX)) {
            Ok(Some(f)) => {
                acc.frames += 1;
                assert!(buf.len() < before, "a parsed frame consumes bytes");
                if let Frame::Header { header, .. } = f {
                    assert!(PropertiesView::new(&header.properties).is_ok(), "header frames carry valid properties");
                }
            }
            Ok(None) => {
                assert_eq!(buf.len(), before, "needing more consumes nothing");
                break;
            }
            Err(e) => {
                assert_protocol_error(&e, "parse_frame", input);
                break;
            }
        }
    }
}

/// A field table in wire form built from plausible but unchecked entries.
fn table_noise(rng: &mut StdRng) -> Vec<u8> {
    let letters = b"tbBsuIilLfdDSxTVFAZ\x00";
    let mut body = Vec::new();
    for _ in 0..rng.gen_range(0..6) {
        let key_len = rng.gen_range(0..4u8);
        body.push(key_len);
        body.extend((0..key_len).map(|_| rng.gen_range(b'a'..=b'z')));
        let letter = letters[rng.gen_range(0..letters.len())];
        body.push(letter);
        let mut size = match letter {
            b'V' => 0,
            b't' | b'b' | b'B' => 1,
            b's' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'l' | b'L' | b'd' | b'T' => 8,
            b'S' | b'x' | b'F' | b'A' => {
                let n = rng.gen_range(0..6u32);
                body.extend_from_slice(&n.to_be_bytes());
                n as usize
            }
            _ => rng.gen_range(0..4),
        };
        if rng.gen_bool(0.1) {
            size += 1;
        }
        body.extend((0..size).map(|_| rng.gen::<u8>()));
    }
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

/// One random change to `bytes`.
fn mutate(rng: &mut StdRng, bytes: &mut Vec<u8>) {
    let at = |rng: &mut StdRng, v: &Vec<u8>| rng.gen_range(0..v.len().max(1));
    match rng.gen_range(0..7) {
        0 if !bytes.is_empty() => {
            let i = at(rng, bytes);
            bytes[i] ^= 1 << rng.gen_range(0..8);
        }
        1 if !bytes.is_empty() => {
            let i = at(rng, bytes);
            bytes[i] = [0x00, 0x01, 0x7f, 0x80, 0xfe, 0xff, b'F', b'A', b'S'][rng.gen_range(0..9)];
        }
        2 => {
            let n = rng.gen_range(0..=bytes.len());
            bytes.truncate(n);
        }
        3 => {
            let i = rng.gen_range(0..=bytes.len());
            let extra: Vec<u8> = (0..rng.gen_range(1..8)).map(|_| rng.gen()).collect();
            bytes.splice(i..i, extra);
        }
        4 if !bytes.is_empty() => {
            let i = at(rng, bytes);
            let j = (i + rng.gen_range(1..8)).min(bytes.len());
            bytes.drain(i..j);
        }
        5 if bytes.len() >= 4 => {
            // Overwrite a 4-byte window as a big length.
            let i = rng.gen_range(0..=bytes.len() - 4);
            let v: u32 = [0, 1, 0x7fff_ffff, 0xffff_ffff, rng.gen()][rng.gen_range(0..5)];
            bytes[i..i + 4].copy_from_slice(&v.to_be_bytes());
        }
        _ => {
            if let Some(b) = bytes.last_mut() {
                *b = rng.gen();
            }
        }
    }
}

/// Valid encodings to mutate: every method (bare and framed), properties, tables, content frames.
fn corpus() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for m in every_method() {
        out.push(encode_method(&m).to_vec());
        let mut f = BytesMut::new();
        frame::write_method(&mut f, 1, &m);
        out.push(f.to_vec());
    }
    let all = all_properties();
    let small = BasicProperties { headers: Some(args()), ..all.clone() };
    for mask in [0x3fffu16, 0, 0b100, 0b1000_1000, 0x2a2a, 0x1555] {
        out.push(encode_props(&subset(&all, mask)).to_vec());
        out.push(encode_props(&subset(&small, mask)).to_vec());
    }
    out.push(table_bytes(&every_type_table()));
    out.push(table_bytes(&args()));
    out.push(nested_wire(b'F', MAX_DEPTH));
    out.push(nested_wire(b'A', MAX_DEPTH));
    let mut content = BytesMut::new();
    frame::write_basic_deliver(&mut content, 2, "ctag", 9, true, "ex", "rk", &encode_props(&small), b"body bytes", 4096);
    out.push(content.to_vec());
    out
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = StdRng::seed_from_u64(0x6a7ba6e);
    let method_ids: Vec<[u8; 4]> = every_method().iter().map(|m| {
        let sp = spec(m);
        let mut id = [0u8; 4];
        id[..2].copy_from_slice(&sp.class_id.to_be_bytes());
        id[2..].copy_from_slice(&sp.method_id.to_be_bytes());
        id
    }).collect();
    let mut acc = Accepted::default();
    for i in 0..30_000 {
        let len = rng.gen_range(0..200);
        let mut input: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        match i % 4 {
            // Pure noise.
            0 => {}
            // A real method id, then noise: reaches every method's argument decoder.
            1 => input.splice(0..0, method_ids[rng.gen_range(0..method_ids.len())]).for_each(drop),
            // A table of plausible entries: short keys, real type letters, roughly right sizes.
            2 => input = table_noise(&mut rng),
            // A frame envelope of a valid type and exact size around noise.
            _ => {
                let ty = [c::FRAME_METHOD, c::FRAME_HEADER, c::FRAME_BODY, c::FRAME_HEARTBEAT][rng.gen_range(0..4)];
                let mut f = vec![ty, 0, 1];
                f.extend_from_slice(&(len as u32).to_be_bytes());
                f.extend_from_slice(&input);
                f.push(c::FRAME_END);
                input = f;
            }
        }
        check_all(&input, &mut acc);
    }
    // Not only early refusals: each decoder accepted a share of the structured noise.
    assert!(acc.methods > 1000 && acc.tables > 1000 && acc.properties > 1000 && acc.frames > 1000, "{acc:?}");
}

#[test]
fn mutated_valid_encodings_never_panic() {
    let mut rng = StdRng::seed_from_u64(0xf11b);
    let corpus = corpus();
    let mut acc = Accepted::default();
    for _ in 0..20_000 {
        let mut input = corpus[rng.gen_range(0..corpus.len())].clone();
        for _ in 0..rng.gen_range(1..4) {
            mutate(&mut rng, &mut input);
        }
        check_all(&input, &mut acc);
    }
    assert!(acc.methods > 1000 && acc.tables > 100 && acc.properties > 1000 && acc.frames > 500, "{acc:?}");
    // And every single-bit flip of a few small samples, exhaustively.
    let small: Vec<Vec<u8>> = vec![
        encode_method(&every_method()[22]).to_vec(), // exchange.declare
        encode_props(&BasicProperties { headers: Some(args()), ..subset(&all_properties(), 0b11_1111_1011) }).to_vec(),
        table_bytes(&args()),
    ];
    for base in small {
        for bit in 0..base.len() * 8 {
            let mut input = base.clone();
            input[bit / 8] ^= 1 << (bit % 8);
            check_all(&input, &mut acc);
        }
    }
}

/// A table in wire form whose single value nests `depth` containers, chosen per level by `kind`
/// (b'F' or b'A', outermost first). Built back to front in O(depth).
fn nest(depth: usize, kind: impl Fn(usize) -> u8) -> Vec<u8> {
    let mut rev = vec![b'V']; // the innermost value, reversed bytes from here on
    for level in (0..depth).rev() {
        let inner = rev.len();
        match kind(level) {
            b'F' => {
                rev.extend_from_slice(&[b'k', 1]);
                rev.extend((inner as u32 + 2).to_be_bytes().iter().rev());
                rev.push(b'F');
            }
            _ => {
                rev.extend((inner as u32).to_be_bytes().iter().rev());
                rev.push(b'A');
            }
        }
    }
    let inner = rev.len();
    rev.extend_from_slice(&[b'k', 1]);
    rev.extend((inner as u32 + 2).to_be_bytes().iter().rev());
    rev.reverse();
    rev
}

#[test]
fn nesting_far_beyond_max_depth_is_refused_without_exhausting_the_stack() {
    // On a small stack: a decoder that recursed once per level would overflow long before.
    let worker = std::thread::Builder::new().stack_size(512 * 1024).spawn(|| {
        let deep = 100_000;
        let cases = [
            ("tables", nest(deep, |_| b'F')),
            ("arrays", nest(deep, |_| b'A')),
            ("alternating", nest(deep, |l| if l % 2 == 0 { b'F' } else { b'A' })),
            ("common tables", nested_wire(b'F', deep)),
            ("common arrays", nested_wire(b'A', deep)),
        ];
        for (what, wire) in &cases {
            assert!(FieldTable::decode(wire).is_err(), "{what}");
            assert!(validate_table(wire).is_err(), "{what}");

            // As the headers property.
            let mut props = vec![0x20, 0x00];
            props.extend_from_slice(wire);
            assert!(BasicProperties::decode(&props).is_err(), "{what}");
            assert!(PropertiesView::new(&props).is_err(), "{what}");

            // As method arguments: queue.declare with this arguments table.
            let mut args = encode_method(&Method::QueueDeclare(QueueDeclare { queue: s("q"), ..Default::default() }));
            args.truncate(args.len() - 4); // drop the empty table
            args.extend_from_slice(wire);
            let e = Method::decode(&args).expect_err(what);
            assert_eq!(e.reply_code(), c::SYNTAX_ERROR);
            assert_eq!(e.method_ids(), Some((50, 10)));

            // In a content header frame.
            let mut payload = BytesMut::new();
            payload.put_u16(60);
            payload.put_u16(0);
            payload.put_u64(0);
            payload.put_slice(&props);
            let mut f = BytesMut::new();
            f.put_u8(c::FRAME_HEADER);
            f.put_u16(1);
            f.put_u32(payload.len() as u32);
            f.put_slice(&payload);
            f.put_u8(c::FRAME_END);
            let e = frame::parse_frame(&mut f, 0).expect_err(what);
            assert_eq!(e.reply_code(), c::SYNTAX_ERROR);
        }
        // The same builders at the limit are accepted, so the refusals above are about depth.
        assert!(FieldTable::decode(&nest(MAX_DEPTH, |_| b'F')).is_ok());
        assert!(FieldTable::decode(&nest(MAX_DEPTH, |_| b'A')).is_ok());
        assert!(FieldTable::decode(&nest(MAX_DEPTH + 1, |_| b'F')).is_err());
        assert!(FieldTable::decode(&nest(MAX_DEPTH + 1, |_| b'A')).is_err());
    });
    worker.expect("spawn").join().expect("no stack overflow or panic");
}
