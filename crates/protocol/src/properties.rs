//! The 14 basic properties of a content header. Brokers mostly pass them through: the raw
//! bytes are kept as received (`ContentHeader::properties`), `PropertiesView` reads the few a
//! broker needs without allocating, and `BasicProperties` is the full decode/encode.

use crate::codec::{Reader, Writer};
use crate::error::FrameError;
use crate::field::FieldTable;
use bytes::{BufMut, BytesMut};

// Flag bits in the first flag word, highest first, in property-list order.
const CONTENT_TYPE: u16 = 1 << 15;
const CONTENT_ENCODING: u16 = 1 << 14;
const HEADERS: u16 = 1 << 13;
const DELIVERY_MODE: u16 = 1 << 12;
const PRIORITY: u16 = 1 << 11;
const CORRELATION_ID: u16 = 1 << 10;
const REPLY_TO: u16 = 1 << 9;
const EXPIRATION: u16 = 1 << 8;
const MESSAGE_ID: u16 = 1 << 7;
const TIMESTAMP: u16 = 1 << 6;
const TYPE: u16 = 1 << 5;
const USER_ID: u16 = 1 << 4;
const APP_ID: u16 = 1 << 3;
const CLUSTER_ID: u16 = 1 << 2;
const CONTINUATION: u16 = 1;

#[derive(Debug, Clone, PartialEq, Default)]
pub struct BasicProperties {
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub headers: Option<FieldTable>,
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<String>,
    pub reply_to: Option<String>,
    pub expiration: Option<String>,
    pub message_id: Option<String>,
    pub timestamp: Option<u64>,
    /// The `type` property.
    pub kind: Option<String>,
    pub user_id: Option<String>,
    pub app_id: Option<String>,
    pub cluster_id: Option<String>,
}

/// Reads the flag words; more than the first only matter for the continuation bit.
fn read_flags(r: &mut Reader) -> Result<u16, FrameError> {
    let first = r.u16()?;
    let mut word = first;
    while word & CONTINUATION != 0 {
        word = r.u16()?;
    }
    Ok(first)
}

impl BasicProperties {
    pub fn decode(raw: &[u8]) -> Result<Self, FrameError> {
        let mut r = Reader::new(raw);
        let f = read_flags(&mut r)?;
        let mut p = BasicProperties::default();
        let has = |bit: u16| f & bit != 0;
        if has(CONTENT_TYPE) {
            p.content_type = Some(r.short_str()?);
        }
        if has(CONTENT_ENCODING) {
            p.content_encoding = Some(r.short_str()?);
        }
        if has(HEADERS) {
            p.headers = Some(r.table()?);
        }
        if has(DELIVERY_MODE) {
            p.delivery_mode = Some(r.u8()?);
        }
        if has(PRIORITY) {
            p.priority = Some(r.u8()?);
        }
        if has(CORRELATION_ID) {
            p.correlation_id = Some(r.short_str()?);
        }
        if has(REPLY_TO) {
            p.reply_to = Some(r.short_str()?);
        }
        if has(EXPIRATION) {
            p.expiration = Some(r.short_str()?);
        }
        if has(MESSAGE_ID) {
            p.message_id = Some(r.short_str()?);
        }
        if has(TIMESTAMP) {
            p.timestamp = Some(r.u64()?);
        }
        if has(TYPE) {
            p.kind = Some(r.short_str()?);
        }
        if has(USER_ID) {
            p.user_id = Some(r.short_str()?);
        }
        if has(APP_ID) {
            p.app_id = Some(r.short_str()?);
        }
        if has(CLUSTER_ID) {
            p.cluster_id = Some(r.short_str()?);
        }
        Ok(p)
    }

    /// Writes flag word and property list (the raw form kept in `ContentHeader::properties`).
    pub fn encode(&self, out: &mut BytesMut) {
        let mut flags = 0u16;
        let mut set = |present: bool, bit: u16| {
            if present {
                flags |= bit
            }
        };
        set(self.content_type.is_some(), CONTENT_TYPE);
        set(self.content_encoding.is_some(), CONTENT_ENCODING);
        set(self.headers.is_some(), HEADERS);
        set(self.delivery_mode.is_some(), DELIVERY_MODE);
        set(self.priority.is_some(), PRIORITY);
        set(self.correlation_id.is_some(), CORRELATION_ID);
        set(self.reply_to.is_some(), REPLY_TO);
        set(self.expiration.is_some(), EXPIRATION);
        set(self.message_id.is_some(), MESSAGE_ID);
        set(self.timestamp.is_some(), TIMESTAMP);
        set(self.kind.is_some(), TYPE);
        set(self.user_id.is_some(), USER_ID);
        set(self.app_id.is_some(), APP_ID);
        set(self.cluster_id.is_some(), CLUSTER_ID);
        out.put_u16(flags);
        let mut w = Writer::new(out);
        let s = |w: &mut Writer, v: &Option<String>| {
            if let Some(v) = v {
                w.short_str(v)
            }
        };
        s(&mut w, &self.content_type);
        s(&mut w, &self.content_encoding);
        if let Some(h) = &self.headers {
            w.table(h);
        }
        if let Some(v) = self.delivery_mode {
            w.u8(v);
        }
        if let Some(v) = self.priority {
            w.u8(v);
        }
        s(&mut w, &self.correlation_id);
        s(&mut w, &self.reply_to);
        s(&mut w, &self.expiration);
        s(&mut w, &self.message_id);
        if let Some(v) = self.timestamp {
            w.u64(v);
        }
        s(&mut w, &self.kind);
        s(&mut w, &self.user_id);
        s(&mut w, &self.app_id);
        s(&mut w, &self.cluster_id);
    }
}

/// An allocation-free view of raw property bytes. `new` walks (and so validates the framing of)
/// every present property and remembers where the ones a broker acts on are.
#[derive(Debug, Clone, Default)]
pub struct PropertiesView<'a> {
    delivery_mode: Option<u8>,
    priority: Option<u8>,
    expiration: Option<&'a str>,
    user_id: Option<&'a [u8]>,
    timestamp: Option<u64>,
    /// The headers table in wire form (length prefix included).
    headers: Option<&'a [u8]>,
    /// The reply-to short string and the offset of its length byte.
    reply_to: Option<(&'a [u8], usize)>,
}

impl<'a> PropertiesView<'a> {
    pub fn new(raw: &'a [u8]) -> Result<Self, FrameError> {
        let mut r = Reader::new(raw);
        let f = read_flags(&mut r)?;
        let has = |bit: u16| f & bit != 0;
        let mut v = PropertiesView::default();
        if has(CONTENT_TYPE) {
            r.short_bytes()?;
        }
        if has(CONTENT_ENCODING) {
            r.short_bytes()?;
        }
        if has(HEADERS) {
            let start = r.position();
            let len = r.u32()? as usize;
            r.take(len, "headers table")?;
            v.headers = raw.get(start..r.position());
            if let Some(table) = v.headers {
                crate::field::validate_table(table)?;
            }
        }
        if has(DELIVERY_MODE) {
            v.delivery_mode = Some(r.u8()?);
        }
        if has(PRIORITY) {
            v.priority = Some(r.u8()?);
        }
        if has(CORRELATION_ID) {
            r.short_bytes()?;
        }
        if has(REPLY_TO) {
            let at = r.position();
            v.reply_to = Some((r.short_bytes()?, at));
        }
        if has(EXPIRATION) {
            let offset = r.position();
            let bytes = r.short_bytes()?;
            v.expiration = Some(std::str::from_utf8(bytes).map_err(|_| FrameError::Syntax {
                what: "expiration property",
                offset,
                detail: "not valid UTF-8".to_string(),
            })?);
        }
        if has(MESSAGE_ID) {
            r.short_bytes()?;
        }
        if has(TIMESTAMP) {
            v.timestamp = Some(r.u64()?);
        }
        if has(TYPE) {
            r.short_bytes()?;
        }
        if has(USER_ID) {
            v.user_id = Some(r.short_bytes()?);
        }
        if has(APP_ID) {
            r.short_bytes()?;
        }
        if has(CLUSTER_ID) {
            r.short_bytes()?;
        }
        Ok(v)
    }
    pub fn delivery_mode(&self) -> Option<u8> {
        self.delivery_mode
    }
    pub fn priority(&self) -> Option<u8> {
        self.priority
    }
    pub fn expiration(&self) -> Option<&'a str> {
        self.expiration
    }
    pub fn user_id(&self) -> Option<&'a [u8]> {
        self.user_id
    }
    pub fn timestamp(&self) -> Option<u64> {
        self.timestamp
    }
    pub fn reply_to(&self) -> Option<&'a [u8]> {
        self.reply_to.map(|(b, _)| b)
    }

    /// The raw properties `raw` (which this view was made from) with the reply-to property replaced by
    /// `new` (at most 255 bytes); None if there is no reply-to or `new` is too long.
    pub fn with_reply_to(&self, raw: &[u8], new: &str) -> Option<Vec<u8>> {
        let (old, at) = self.reply_to?;
        let len = u8::try_from(new.len()).ok()?;
        let end = at + 1 + old.len();
        let mut out = Vec::with_capacity(raw.len() - old.len() + new.len());
        out.extend_from_slice(raw.get(..at)?);
        out.push(len);
        out.extend_from_slice(new.as_bytes());
        out.extend_from_slice(raw.get(end..)?);
        Some(out)
    }

    /// Decodes the headers table on demand.
    pub fn headers(&self) -> Option<Result<FieldTable, FrameError>> {
        self.headers.map(FieldTable::decode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_reply_to_replaces_only_that_property() {
        let props = BasicProperties {
            content_type: Some("text/plain".into()),
            correlation_id: Some("c1".into()),
            reply_to: Some("amq.rabbitmq.reply-to".into()),
            expiration: Some("5000".into()),
            app_id: Some("app".into()),
            ..Default::default()
        };
        let mut raw = BytesMut::new();
        props.encode(&mut raw);
        let view = PropertiesView::new(&raw).expect("view");
        assert_eq!(view.reply_to(), Some(&b"amq.rabbitmq.reply-to"[..]));
        let new = view.with_reply_to(&raw, "amq.rabbitmq.reply-to.abcdef").expect("rewritten");
        let decoded = BasicProperties::decode(&new).expect("decodes");
        assert_eq!(decoded, BasicProperties { reply_to: Some("amq.rabbitmq.reply-to.abcdef".into()), ..props });
        assert!(view.with_reply_to(&raw, &"x".repeat(256)).is_none());
        let mut none = BytesMut::new();
        BasicProperties::default().encode(&mut none);
        assert!(PropertiesView::new(&none).expect("view").with_reply_to(&none, "a").is_none());
    }
}
