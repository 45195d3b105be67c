//! BasicProperties: every subset of the 14 properties round-trips (all, none and each alone
//! among them), flags sit at the spec's bits, and the allocation-free `PropertiesView` agrees
//! with the full decode.

mod common;

use common::*;
use warren_protocol::constants as c;
use warren_protocol::error::FrameError;
use warren_protocol::properties::{BasicProperties, PropertiesView};

/// Round trip, byte-exact re-encode, and the view reads the same values from the same bytes.
fn check(p: &BasicProperties, what: &str) {
    let raw = encode_props(p);
    let back = BasicProperties::decode(&raw).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(&back, p, "{what}");
    assert_eq!(encode_props(&back), raw, "{what}: re-encodes identically");
    assert_view_agrees(&raw, p, what);
}

fn assert_view_agrees(raw: &[u8], p: &BasicProperties, what: &str) {
    let view = PropertiesView::new(raw).unwrap_or_else(|e| panic!("{what}: view: {e}"));
    assert_eq!(view.delivery_mode(), p.delivery_mode, "{what}");
    assert_eq!(view.priority(), p.priority, "{what}");
    assert_eq!(view.expiration(), p.expiration.as_deref(), "{what}");
    assert_eq!(view.user_id(), p.user_id.as_deref().map(str::as_bytes), "{what}");
    assert_eq!(view.timestamp(), p.timestamp, "{what}");
    assert_eq!(view.headers().map(|h| h.expect("headers decode")), p.headers, "{what}");
}

#[test]
fn all_set() {
    let p = all_properties();
    check(&p, "all");
    assert_eq!(&encode_props(&p)[..2], &[0xff, 0xfc], "14 flags, continuation clear");
}

#[test]
fn none_set() {
    let p = BasicProperties::default();
    check(&p, "none");
    assert_eq!(&encode_props(&p)[..], &[0, 0]);
    assert_eq!(BasicProperties::decode(&[0, 0]).unwrap(), p);
}

#[test]
fn each_alone_at_its_spec_flag_bit() {
    let all = all_properties();
    for i in 0..PROPERTY_COUNT {
        let p = subset(&all, 1 << i);
        assert_ne!(p, BasicProperties::default());
        check(&p, &format!("property {i} alone"));
        // content-type is bit 15, cluster-id bit 2, in property-list order.
        let flags = u16::from_be_bytes(encode_props(&p)[..2].try_into().unwrap());
        assert_eq!(flags, 1 << (15 - i), "property {i}");
    }
}

#[test]
fn exact_layout_of_a_typical_header() {
    let p = BasicProperties { content_type: Some(s("text/plain")), delivery_mode: Some(2), timestamp: Some(0x0102030405060708), ..Default::default() };
    assert_eq!(&encode_props(&p)[..], b"\x90\x40\x0atext/plain\x02\x01\x02\x03\x04\x05\x06\x07\x08");
}

#[test]
fn every_subset_of_the_fourteen() {
    // A small headers table here: 16,384 cases.
    let all = BasicProperties { headers: Some(args()), ..all_properties() };
    for mask in 0..(1u16 << PROPERTY_COUNT) {
        check(&subset(&all, mask), &format!("subset {mask:#06x}"));
    }
}

#[test]
fn continuation_flag_words_are_skipped() {
    // Flag word with the continuation bit, then two more words, then the properties.
    let p = subset(&all_properties(), 0b1_0000_1000_1101); // content-type, headers, delivery-mode, expiration, app-id
    let raw = encode_props(&p);
    let mut with_more = vec![raw[0], raw[1] | 1, 0x00, 0x01, 0x00, 0x00];
    with_more.extend_from_slice(&raw[2..]);
    assert_eq!(BasicProperties::decode(&with_more).unwrap(), p);
    assert_view_agrees(&with_more, &p, "continuation");
    // A continuation bit with no word after it is truncated.
    for bad in [&[0x00, 0x01][..], &[0x00, 0x01, 0x00, 0x01, 0x00]] {
        assert!(matches!(BasicProperties::decode(bad), Err(FrameError::Truncated { .. })));
        assert!(PropertiesView::new(bad).is_err());
    }
}

#[test]
fn every_strict_prefix_is_refused_by_both_decoders() {
    let raw = encode_props(&all_properties());
    for cut in 0..raw.len() {
        let e = BasicProperties::decode(&raw[..cut]).expect_err(&format!("cut at {cut}"));
        assert_eq!(e.reply_code(), c::SYNTAX_ERROR);
        // The view only needs lengths, so it fails too: every property takes at least one byte.
        assert!(PropertiesView::new(&raw[..cut]).is_err(), "view accepts a cut at {cut}");
    }
}

#[test]
fn malformed_properties_are_refused() {
    // Expiration (bit 8) that is not UTF-8: both refuse.
    let bad = b"\x01\x00\x02\xff\xfe";
    assert!(matches!(BasicProperties::decode(bad), Err(FrameError::Syntax { .. })));
    assert!(matches!(PropertiesView::new(bad), Err(FrameError::Syntax { .. })));
    // Headers (bit 13) with an unknown field type: both refuse, the view without decoding.
    let bad = b"\x20\x00\x00\x00\x00\x03\x01kZ";
    assert!(BasicProperties::decode(bad).is_err());
    assert!(PropertiesView::new(bad).is_err());
    // Headers whose length runs past the end.
    let bad = b"\x20\x00\x00\x00\x01\x00";
    assert!(matches!(BasicProperties::decode(bad), Err(FrameError::Truncated { .. })));
    assert!(PropertiesView::new(bad).is_err());
}
