//! Field tables: every type letter, edge values, deep and random nesting round-trip byte-exact;
//! the decoder and the allocation-free validator agree on what is well formed.

mod common;

use bytes::{Bytes, BytesMut};
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warren_protocol::constants as c;
use warren_protocol::error::FrameError;
use warren_protocol::field::{validate_table, Decimal, FieldTable, FieldValue, MAX_DEPTH};

/// Encode → decode → equal → re-encode to the same bytes; the validator accepts the bytes.
fn assert_round_trip(t: &FieldTable) -> BytesMut {
    let bytes = encode_table(t);
    assert_eq!(u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize, bytes.len() - 4, "length prefix");
    let back = FieldTable::decode(&bytes).unwrap_or_else(|e| panic!("{e}: {}", hex(&bytes)));
    assert_eq!(&back, t);
    assert_eq!(encode_table(&back), bytes, "re-encodes identically");
    validate_table(&bytes).unwrap_or_else(|e| panic!("validate: {e}"));
    bytes
}

#[test]
fn every_type_at_its_edges_round_trips() {
    let t = every_type_table();
    assert_round_trip(&t);
    // Duplicates and order are kept; `get` finds the first.
    assert_eq!(t.0.iter().filter(|(k, _)| k == "t-true").count(), 2);
    assert_eq!(t.get("t-true"), Some(&FieldValue::Bool(true)));
}

#[test]
fn long_strings_beyond_64k() {
    let big = Bytes::from((0..200_000u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let t = table(vec![("S", FieldValue::LongString(big.clone())), ("x", FieldValue::ByteArray(big))]);
    let bytes = assert_round_trip(&t);
    assert_eq!(&bytes[7..11], &200_000u32.to_be_bytes());
}

#[test]
fn empty_table() {
    let bytes = assert_round_trip(&FieldTable::new());
    assert_eq!(&bytes[..], &[0, 0, 0, 0]);
    assert!(FieldTable::decode(&bytes).unwrap().is_empty());
}

#[test]
fn each_type_has_rabbitmqs_letter_and_layout() {
    let cases: Vec<(FieldValue, &[u8])> = vec![
        (FieldValue::Bool(true), b"t\x01"),
        (FieldValue::Bool(false), b"t\x00"),
        (FieldValue::I8(-2), b"b\xfe"),
        (FieldValue::U8(0xfe), b"B\xfe"),
        (FieldValue::I16(-2), b"s\xff\xfe"),
        (FieldValue::U16(0xfffe), b"u\xff\xfe"),
        (FieldValue::I32(-2), b"I\xff\xff\xff\xfe"),
        (FieldValue::U32(0xfffffffe), b"i\xff\xff\xff\xfe"),
        (FieldValue::I64(-2), b"l\xff\xff\xff\xff\xff\xff\xff\xfe"),
        (FieldValue::U64(u64::MAX - 1), b"L\xff\xff\xff\xff\xff\xff\xff\xfe"),
        (FieldValue::F32(1.0), b"f\x3f\x80\x00\x00"),
        (FieldValue::F64(-2.0), b"d\xc0\x00\x00\x00\x00\x00\x00\x00"),
        (FieldValue::Decimal(Decimal { scale: 2, value: 314 }), b"D\x02\x00\x00\x01\x3a"),
        (FieldValue::LongString(b(b"a\xff")), b"S\x00\x00\x00\x02a\xff"),
        (FieldValue::ByteArray(b(b"\x00\x01")), b"x\x00\x00\x00\x02\x00\x01"),
        (FieldValue::Timestamp(1_700_000_000), b"T\x00\x00\x00\x00\x65\x53\xf1\x00"),
        (FieldValue::Void, b"V"),
        (FieldValue::Array(vec![]), b"A\x00\x00\x00\x00"),
        (FieldValue::Array(vec![FieldValue::U8(1), FieldValue::Void]), b"A\x00\x00\x00\x03B\x01V"),
        (FieldValue::Table(FieldTable::new()), b"F\x00\x00\x00\x00"),
        (FieldValue::Table(table(vec![("k", FieldValue::Void)])), b"F\x00\x00\x00\x03\x01kV"),
    ];
    for (v, wire) in cases {
        let t = table(vec![("k", v.clone())]);
        let bytes = assert_round_trip(&t);
        assert_eq!(&bytes[6..], wire, "{v:?}"); // after the length and key "k"
        // An array holding the value uses the same bytes.
        let a = table(vec![("k", FieldValue::Array(vec![v.clone()]))]);
        let bytes = assert_round_trip(&a);
        assert_eq!(&bytes[11..], wire, "{v:?} in an array");
    }
}

#[test]
fn unknown_type_letters_are_refused_and_known_ones_accepted() {
    let known = b"tbBsuIilLfdDSxTVFA";
    for letter in 0..=255u8 {
        // Key "k", the letter, then enough zeros for any fixed-size value or an empty string/table.
        let mut wire = vec![0, 0, 0, 11, 1, b'k', letter];
        wire.extend_from_slice(&[0u8; 8]);
        let decoded = FieldTable::decode(&wire);
        let validated = validate_table(&wire);
        if known.contains(&letter) {
            // Fixed-size values shorter than 8 bytes leave trailing zeros that read as more
            // entries; either way decoder and validator must agree.
            assert_eq!(decoded.is_ok(), validated.is_ok(), "letter {}", letter.escape_ascii());
            let mut exact = vec![0, 0, 0, 0, 1, b'k', letter];
            let size = match letter {
                b'V' => 0,
                b't' | b'b' | b'B' => 1,
                b's' | b'u' => 2,
                b'I' | b'i' | b'f' | b'S' | b'x' | b'F' | b'A' => 4,
                b'D' => 5,
                _ => 8,
            };
            exact.resize(exact.len() + size, 0);
            let len = (exact.len() - 4) as u32;
            exact[..4].copy_from_slice(&len.to_be_bytes());
            let t = FieldTable::decode(&exact).unwrap_or_else(|e| panic!("letter {}: {e}", letter.escape_ascii()));
            assert_eq!(encode_table(&t)[..], exact[..], "letter {}", letter.escape_ascii());
            assert!(validate_table(&exact).is_ok());
        } else {
            let e = decoded.expect_err("unknown letter");
            assert!(matches!(e, FrameError::Syntax { offset: 2, .. }), "letter {}: {e:?}", letter.escape_ascii());
            assert_eq!(e.reply_code(), c::SYNTAX_ERROR);
            assert!(validated.is_err(), "validator accepts letter {}", letter.escape_ascii());
        }
    }
}

#[test]
fn floats_keep_their_exact_bits() {
    // NaN != NaN, so compare bytes: payload and sign of NaN and of zero survive.
    for bits in [0x7fc0_0001u32, 0xffc0_0000, 0x8000_0000, 0x7f80_0000] {
        let t = table(vec![("f", FieldValue::F32(f32::from_bits(bits)))]);
        let bytes = encode_table(&t);
        let back = FieldTable::decode(&bytes).unwrap();
        match back.get("f") {
            Some(FieldValue::F32(x)) => assert_eq!(x.to_bits(), bits),
            other => panic!("{other:?}"),
        }
        assert_eq!(encode_table(&back), bytes);
    }
    for bits in [0x7ff8_0000_0000_0001u64, 0x8000_0000_0000_0000, 1] {
        let t = table(vec![("d", FieldValue::F64(f64::from_bits(bits)))]);
        let bytes = encode_table(&t);
        let back = FieldTable::decode(&bytes).unwrap();
        match back.get("d") {
            Some(FieldValue::F64(x)) => assert_eq!(x.to_bits(), bits),
            other => panic!("{other:?}"),
        }
        assert_eq!(encode_table(&back), bytes);
    }
}

#[test]
fn tables_and_arrays_nested_several_levels_deep() {
    // Table → array → table → … twenty times, each level also holding siblings.
    let mut v = FieldValue::LongString(b(b"bottom"));
    for level in 0..20 {
        v = if level % 2 == 0 {
            FieldValue::Array(vec![FieldValue::I16(level), v, FieldValue::Table(FieldTable::new())])
        } else {
            FieldValue::Table(table(vec![("before", FieldValue::Void), ("next", v), ("after", FieldValue::Array(vec![]))]))
        };
    }
    let t = table(vec![("root", v)]);
    assert_round_trip(&t);
    // Walk down again through the helpers.
    let mut cur = t.get("root").unwrap();
    for level in (0..20).rev() {
        cur = if level % 2 == 0 { &cur.as_array().unwrap()[1] } else { cur.as_table().unwrap().get("next").unwrap() };
    }
    assert_eq!(cur.as_str(), Some("bottom"));
}

#[test]
fn nesting_is_accepted_up_to_max_depth_and_refused_beyond_by_decoder_and_validator_alike() {
    assert_eq!(MAX_DEPTH, c::MAX_FIELD_NESTING, "the two limits must not drift apart");
    for letter in [b'F', b'A'] {
        for depth in 0..=MAX_DEPTH + 3 {
            let wire = nested_wire(letter, depth);
            let decoded = FieldTable::decode(&wire);
            let validated = validate_table(&wire);
            if depth <= MAX_DEPTH {
                let t = decoded.unwrap_or_else(|e| panic!("{} depth {depth}: {e}", letter as char));
                assert_eq!(encode_table(&t)[..], wire[..], "{} depth {depth}", letter as char);
                assert!(validated.is_ok(), "{} depth {depth}", letter as char);
            } else {
                let e = decoded.expect_err("too deep");
                assert!(matches!(e, FrameError::Syntax { .. }), "{e:?}");
                assert!(validated.is_err(), "{} depth {depth}", letter as char);
            }
        }
    }
}

#[test]
fn lying_lengths_are_refused() {
    let good = encode_table(&args());
    // Table length one more or much more than what is there.
    for extra in [1u32, 1000, u32::MAX - good.len() as u32] {
        let mut bad = good.to_vec();
        let len = u32::from_be_bytes(bad[..4].try_into().unwrap()).wrapping_add(extra);
        bad[..4].copy_from_slice(&len.to_be_bytes());
        let e = FieldTable::decode(&bad).expect_err("longer than the input");
        assert!(matches!(e, FrameError::Truncated { .. }), "{e:?}");
        assert!(validate_table(&bad).is_err());
    }
    // A long string claiming more bytes than its table holds.
    let bad = b"\x00\x00\x00\x08\x01kS\x00\x00\x00\x05a";
    assert!(matches!(FieldTable::decode(bad), Err(FrameError::Truncated { .. })));
    assert!(validate_table(bad).is_err());
    // A table shorter than its first entry.
    let bad = b"\x00\x00\x00\x02\x01kV";
    assert!(FieldTable::decode(bad).is_err());
    assert!(validate_table(bad).is_err());
    // Validation refuses bytes after the table; decoding ignores them.
    let mut trailing = good.to_vec();
    trailing.push(0);
    assert!(validate_table(&trailing).is_err());
    assert_eq!(FieldTable::decode(&trailing).unwrap(), args());
}

#[test]
fn non_utf8_keys_are_syntax_errors() {
    let bad = b"\x00\x00\x00\x03\x01\xffV";
    let e = FieldTable::decode(bad).expect_err("bad key");
    assert!(matches!(e, FrameError::Syntax { .. }), "{e:?}");
    assert_eq!(e.reply_code(), c::SYNTAX_ERROR);
}

#[test]
fn helpers() {
    let mut t = FieldTable::new();
    t.insert(s("a"), FieldValue::I8(-1));
    t.insert(s("b"), FieldValue::LongString(b(b"\xff")));
    t.insert(s("a"), FieldValue::U64(u64::MAX)); // replaces in place
    assert_eq!(t.len(), 2);
    assert_eq!(t.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(t.get("a").and_then(FieldValue::as_i64), None); // does not fit an i64
    assert_eq!(FieldValue::U64(5).as_i64(), Some(5));
    assert_eq!(FieldValue::U32(u32::MAX).as_i64(), Some(u32::MAX as i64));
    assert_eq!(FieldValue::I16(-3).as_i64(), Some(-3));
    assert_eq!(FieldValue::F64(1.0).as_i64(), None);
    assert_eq!(t.get("b").and_then(FieldValue::as_str), None); // not UTF-8
    assert_eq!(FieldValue::LongString(b(b"ok")).as_str(), Some("ok"));
    assert_eq!(FieldValue::ByteArray(b(b"ok")).as_str(), None);
    assert_eq!(FieldValue::Bool(true).as_bool(), Some(true));
    assert_eq!(FieldValue::U8(1).as_bool(), None);
    assert_eq!(t.remove("a"), Some(FieldValue::U64(u64::MAX)));
    assert_eq!(t.remove("a"), None);
    assert_eq!(t.len(), 1);
    assert!(!t.is_empty());
}

/// A random value of any type; containers only while `depth` lasts. Floats are finite (NaN ≠ NaN).
fn random_value(rng: &mut StdRng, depth: usize) -> FieldValue {
    let kinds = if depth == 0 { 16 } else { 18 };
    match rng.gen_range(0..kinds) {
        0 => FieldValue::Bool(rng.gen()),
        1 => FieldValue::I8(rng.gen()),
        2 => FieldValue::U8(rng.gen()),
        3 => FieldValue::I16(rng.gen()),
        4 => FieldValue::U16(rng.gen()),
        5 => FieldValue::I32(rng.gen()),
        6 => FieldValue::U32(rng.gen()),
        7 => FieldValue::I64(rng.gen()),
        8 => FieldValue::U64(rng.gen()),
        9 => FieldValue::F32(rng.gen_range(-1e30f32..1e30)),
        10 => FieldValue::F64(rng.gen_range(-1e300f64..1e300)),
        11 => FieldValue::Decimal(Decimal { scale: rng.gen(), value: rng.gen() }),
        12 => FieldValue::LongString(random_bytes(rng)),
        13 => FieldValue::ByteArray(random_bytes(rng)),
        14 => FieldValue::Timestamp(rng.gen()),
        15 => FieldValue::Void,
        16 => FieldValue::Array((0..rng.gen_range(0..5)).map(|_| random_value(rng, depth - 1)).collect()),
        _ => FieldValue::Table(random_table(rng, depth - 1)),
    }
}

fn random_bytes(rng: &mut StdRng) -> Bytes {
    let len = rng.gen_range(0..40);
    (0..len).map(|_| rng.gen::<u8>()).collect::<Vec<u8>>().into()
}

fn random_key(rng: &mut StdRng) -> String {
    let len = rng.gen_range(0..12);
    (0..len).map(|_| if rng.gen_bool(0.9) { rng.gen_range('a'..='z') } else { 'é' }).collect()
}

fn random_table(rng: &mut StdRng, depth: usize) -> FieldTable {
    FieldTable((0..rng.gen_range(0..6)).map(|_| (random_key(rng), random_value(rng, depth))).collect())
}

#[test]
fn random_tables_round_trip() {
    let mut rng = StdRng::seed_from_u64(0x7ab1e);
    for _ in 0..2_000 {
        let t = random_table(&mut rng, 4);
        assert_round_trip(&t);
    }
}
