//! Frames: the streaming parser and the writers, including allocation-free writers for the
//! hot path (deliveries, returns, confirms).
//!
//! Frame layout: `type u8 | channel u16 | size u32 | payload[size] | 0xCE`.

use crate::codec::{put_short_str, Reader};
use crate::constants::*;
use crate::error::FrameError;
use crate::method::Method;
use bytes::{Buf, BufMut, Bytes, BytesMut};

#[derive(Debug, Clone, PartialEq)]
pub struct ContentHeader {
    pub class_id: u16,
    pub body_size: u64,
    /// Raw flag words and property list, exactly as received.
    pub properties: Bytes,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    Method { channel: u16, method: Method },
    Header { channel: u16, header: ContentHeader },
    Body { channel: u16, payload: Bytes },
    Heartbeat { channel: u16 },
}

/// Parses one frame from the front of `buf`, consuming it; `Ok(None)` means more bytes are
/// needed (nothing consumed). The declared size is checked against `frame_max` (whole frame,
/// envelope included; 0 = no limit) before any payload is waited for.
pub fn parse_frame(buf: &mut BytesMut, frame_max: u32) -> Result<Option<Frame>, FrameError> {
    let Some(head) = buf.get(..7) else { return Ok(None) };
    let frame_type = head.first().copied().unwrap_or(0);
    let channel = u16::from_be_bytes([head.get(1).copied().unwrap_or(0), head.get(2).copied().unwrap_or(0)]);
    let mut size_bytes = [0u8; 4];
    size_bytes.copy_from_slice(head.get(3..7).unwrap_or(&[0; 4]));
    let size = u32::from_be_bytes(size_bytes);
    if !matches!(frame_type, FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT) {
        return Err(FrameError::UnknownFrameType { frame_type });
    }
    let total = (size as u64) + FRAME_OVERHEAD as u64;
    if frame_max != 0 && total > frame_max as u64 {
        return Err(FrameError::TooLarge { size: total.min(u32::MAX as u64) as u32, frame_max });
    }
    let total = total as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let end = buf.get(total - 1).copied().unwrap_or(0);
    if end != FRAME_END {
        return Err(FrameError::BadFrameEnd { found: end });
    }
    buf.advance(7);
    let payload = buf.split_to(size as usize).freeze();
    buf.advance(1);
    let frame = match frame_type {
        FRAME_METHOD => Frame::Method { channel, method: Method::decode(&payload)? },
        FRAME_HEADER => {
            let mut r = Reader::new(&payload);
            let class_id = r.u16()?;
            let _weight = r.u16()?;
            let body_size = r.u64()?;
            // Validate the properties now so nothing malformed is stored or passed on.
            crate::properties::PropertiesView::new(payload.get(12..).unwrap_or_default())?;
            Frame::Header { channel, header: ContentHeader { class_id, body_size, properties: payload.slice(12..) } }
        }
        FRAME_BODY => Frame::Body { channel, payload },
        _ => Frame::Heartbeat { channel },
    };
    Ok(Some(frame))
}

/// Starts a frame; returns where its size goes, for `end_frame`.
fn begin_frame(out: &mut BytesMut, frame_type: u8, channel: u16) -> usize {
    out.put_u8(frame_type);
    out.put_u16(channel);
    let at = out.len();
    out.put_u32(0);
    at
}

fn end_frame(out: &mut BytesMut, size_at: usize) {
    let size = (out.len() - size_at - 4) as u32;
    if let Some(slot) = out.get_mut(size_at..size_at + 4) {
        slot.copy_from_slice(&size.to_be_bytes());
    }
    out.put_u8(FRAME_END);
}

pub fn write_method(out: &mut BytesMut, channel: u16, method: &Method) {
    let at = begin_frame(out, FRAME_METHOD, channel);
    method.encode(out);
    end_frame(out, at);
}

pub fn write_heartbeat(out: &mut BytesMut) {
    out.put_slice(&[FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END]);
}

/// Content header + body frames, the body split so that no frame exceeds `frame_max`.
pub fn write_content(out: &mut BytesMut, channel: u16, class_id: u16, properties_raw: &[u8], body: &[u8], frame_max: u32) {
    out.reserve(body.len() + properties_raw.len() + 64);
    write_content_header(out, channel, class_id, properties_raw, body.len());
    for chunk in body.chunks(max_body_payload(frame_max)) {
        begin_body_frame(out, channel, chunk.len());
        out.put_slice(chunk);
        out.put_u8(FRAME_END);
    }
}

fn write_content_header(out: &mut BytesMut, channel: u16, class_id: u16, properties_raw: &[u8], body_len: usize) {
    let at = begin_frame(out, FRAME_HEADER, channel);
    out.put_u16(class_id);
    out.put_u16(0);
    out.put_u64(body_len as u64);
    out.put_slice(properties_raw);
    end_frame(out, at);
}

/// The most body bytes one frame carries under `frame_max` (0: no limit).
fn max_body_payload(frame_max: u32) -> usize {
    if frame_max == 0 {
        usize::MAX
    } else {
        (frame_max.saturating_sub(FRAME_OVERHEAD) as usize).max(1)
    }
}

/// Whether a body of `body_len` bytes goes in one body frame under `frame_max` (what
/// [`write_basic_deliver_head`] needs).
pub fn fits_one_body_frame(body_len: usize, frame_max: u32) -> bool {
    body_len > 0 && body_len <= max_body_payload(frame_max)
}

#[allow(clippy::too_many_arguments)]
pub fn write_basic_deliver(
    out: &mut BytesMut,
    channel: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    properties_raw: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    write_basic_deliver_method(out, channel, consumer_tag, delivery_tag, redelivered, exchange, routing_key);
    write_content(out, channel, CLASS_BASIC, properties_raw, body, frame_max);
}

/// [`write_basic_deliver`] up to the body's bytes: the method frame, the content header and the
/// body frame's header, for a body that goes in one frame ([`fits_one_body_frame`]). The caller
/// sends the `body_len` bytes of the body from where they are, then [`FRAME_END`] (a large body is
/// not copied into the output buffer: the connection writes it with `writev`).
#[allow(clippy::too_many_arguments)]
pub fn write_basic_deliver_head(
    out: &mut BytesMut,
    channel: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    properties_raw: &[u8],
    body_len: usize,
) {
    write_basic_deliver_method(out, channel, consumer_tag, delivery_tag, redelivered, exchange, routing_key);
    write_content_header(out, channel, CLASS_BASIC, properties_raw, body_len);
    begin_body_frame(out, channel, body_len);
}

/// A body frame's header; `len` bytes of the body and `FRAME_END` follow.
fn begin_body_frame(out: &mut BytesMut, channel: u16, len: usize) {
    out.put_u8(FRAME_BODY);
    out.put_u16(channel);
    out.put_u32(len as u32);
}

fn write_basic_deliver_method(out: &mut BytesMut, channel: u16, consumer_tag: &str, delivery_tag: u64, redelivered: bool, exchange: &str, routing_key: &str) {
    let at = begin_frame(out, FRAME_METHOD, channel);
    out.put_u16(CLASS_BASIC);
    out.put_u16(60);
    put_short_str(out, consumer_tag);
    out.put_u64(delivery_tag);
    out.put_u8(redelivered as u8);
    put_short_str(out, exchange);
    put_short_str(out, routing_key);
    end_frame(out, at);
}

#[allow(clippy::too_many_arguments)]
pub fn write_basic_get_ok(
    out: &mut BytesMut,
    channel: u16,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    message_count: u32,
    properties_raw: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    let at = begin_frame(out, FRAME_METHOD, channel);
    out.put_u16(CLASS_BASIC);
    out.put_u16(71);
    out.put_u64(delivery_tag);
    out.put_u8(redelivered as u8);
    put_short_str(out, exchange);
    put_short_str(out, routing_key);
    out.put_u32(message_count);
    end_frame(out, at);
    write_content(out, channel, CLASS_BASIC, properties_raw, body, frame_max);
}

#[allow(clippy::too_many_arguments)]
pub fn write_basic_return(
    out: &mut BytesMut,
    channel: u16,
    reply_code: u16,
    reply_text: &str,
    exchange: &str,
    routing_key: &str,
    properties_raw: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    let at = begin_frame(out, FRAME_METHOD, channel);
    out.put_u16(CLASS_BASIC);
    out.put_u16(50);
    out.put_u16(reply_code);
    put_short_str(out, reply_text);
    put_short_str(out, exchange);
    put_short_str(out, routing_key);
    end_frame(out, at);
    write_content(out, channel, CLASS_BASIC, properties_raw, body, frame_max);
}

/// A publisher confirm.
pub fn write_basic_ack(out: &mut BytesMut, channel: u16, delivery_tag: u64, multiple: bool) {
    let at = begin_frame(out, FRAME_METHOD, channel);
    out.put_u16(CLASS_BASIC);
    out.put_u16(80);
    out.put_u64(delivery_tag);
    out.put_u8(multiple as u8);
    end_frame(out, at);
}
