//! Field tables and arrays with RabbitMQ's type letters. Order and duplicate keys are kept,
//! so a table decodes and re-encodes to the same bytes.

use crate::codec::Reader;
use crate::error::FrameError;
use bytes::{BufMut, Bytes, BytesMut};

/// Tables nested deeper than this are refused, so hostile input cannot exhaust the stack.
pub const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Decimal {
    pub scale: u8,
    pub value: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum FieldValue {
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    Decimal(Decimal),
    LongString(Bytes),
    Array(Vec<FieldValue>),
    Timestamp(u64),
    Table(FieldTable),
    Void,
    ByteArray(Bytes),
}

impl FieldValue {
    pub fn as_i64(&self) -> Option<i64> {
        Some(match self {
            FieldValue::I8(n) => *n as i64,
            FieldValue::U8(n) => *n as i64,
            FieldValue::I16(n) => *n as i64,
            FieldValue::U16(n) => *n as i64,
            FieldValue::I32(n) => *n as i64,
            FieldValue::U32(n) => *n as i64,
            FieldValue::I64(n) => *n,
            FieldValue::U64(n) => i64::try_from(*n).ok()?,
            _ => return None,
        })
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            FieldValue::LongString(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            FieldValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
    pub fn as_table(&self) -> Option<&FieldTable> {
        match self {
            FieldValue::Table(t) => Some(t),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[FieldValue]> {
        match self {
            FieldValue::Array(a) => Some(a),
            _ => None,
        }
    }

    fn read(r: &mut Reader, depth: usize) -> Result<FieldValue, FrameError> {
        let offset = r.position();
        let tag = r.u8()?;
        Ok(match tag {
            b't' => FieldValue::Bool(r.u8()? != 0),
            b'b' => FieldValue::I8(r.u8()? as i8),
            b'B' => FieldValue::U8(r.u8()?),
            b's' => FieldValue::I16(r.u16()? as i16),
            b'u' => FieldValue::U16(r.u16()?),
            b'I' => FieldValue::I32(r.u32()? as i32),
            b'i' => FieldValue::U32(r.u32()?),
            b'l' => FieldValue::I64(r.u64()? as i64),
            b'L' => FieldValue::U64(r.u64()?),
            b'f' => FieldValue::F32(f32::from_bits(r.u32()?)),
            b'd' => FieldValue::F64(f64::from_bits(r.u64()?)),
            b'D' => FieldValue::Decimal(Decimal { scale: r.u8()?, value: r.u32()? }),
            b'S' => FieldValue::LongString(r.long_str()?),
            b'x' => FieldValue::ByteArray(r.long_str()?),
            b'T' => FieldValue::Timestamp(r.u64()?),
            b'V' => FieldValue::Void,
            b'F' => FieldValue::Table(FieldTable::read(r, depth + 1)?),
            b'A' => {
                if depth >= MAX_DEPTH {
                    return Err(too_deep(offset));
                }
                let bytes = r.long_bytes()?;
                let mut inner = Reader::new(bytes);
                let mut items = Vec::new();
                while inner.remaining() > 0 {
                    items.push(FieldValue::read(&mut inner, depth + 1)?);
                }
                FieldValue::Array(items)
            }
            other => {
                return Err(FrameError::Syntax {
                    what: "field value",
                    offset,
                    detail: format!("unknown field type '{}' ({other:#04x})", other.escape_ascii()),
                })
            }
        })
    }

    fn write(&self, out: &mut BytesMut) {
        match self {
            FieldValue::Bool(b) => {
                out.put_u8(b't');
                out.put_u8(*b as u8)
            }
            FieldValue::I8(n) => {
                out.put_u8(b'b');
                out.put_i8(*n)
            }
            FieldValue::U8(n) => {
                out.put_u8(b'B');
                out.put_u8(*n)
            }
            FieldValue::I16(n) => {
                out.put_u8(b's');
                out.put_i16(*n)
            }
            FieldValue::U16(n) => {
                out.put_u8(b'u');
                out.put_u16(*n)
            }
            FieldValue::I32(n) => {
                out.put_u8(b'I');
                out.put_i32(*n)
            }
            FieldValue::U32(n) => {
                out.put_u8(b'i');
                out.put_u32(*n)
            }
            FieldValue::I64(n) => {
                out.put_u8(b'l');
                out.put_i64(*n)
            }
            FieldValue::U64(n) => {
                out.put_u8(b'L');
                out.put_u64(*n)
            }
            FieldValue::F32(n) => {
                out.put_u8(b'f');
                out.put_u32(n.to_bits())
            }
            FieldValue::F64(n) => {
                out.put_u8(b'd');
                out.put_u64(n.to_bits())
            }
            FieldValue::Decimal(d) => {
                out.put_u8(b'D');
                out.put_u8(d.scale);
                out.put_u32(d.value)
            }
            FieldValue::LongString(b) => {
                out.put_u8(b'S');
                out.put_u32(b.len() as u32);
                out.put_slice(b)
            }
            FieldValue::ByteArray(b) => {
                out.put_u8(b'x');
                out.put_u32(b.len() as u32);
                out.put_slice(b)
            }
            FieldValue::Timestamp(n) => {
                out.put_u8(b'T');
                out.put_u64(*n)
            }
            FieldValue::Void => out.put_u8(b'V'),
            FieldValue::Table(t) => {
                out.put_u8(b'F');
                t.write(out)
            }
            FieldValue::Array(items) => {
                out.put_u8(b'A');
                let len_at = out.len();
                out.put_u32(0);
                for item in items {
                    item.write(out);
                }
                patch_len(out, len_at);
            }
        }
    }
}

fn too_deep(offset: usize) -> FrameError {
    FrameError::Syntax { what: "field table", offset, detail: format!("nested deeper than {MAX_DEPTH} levels") }
}

/// Writes the byte length of what follows the 4-byte placeholder at `len_at`.
fn patch_len(out: &mut BytesMut, len_at: usize) {
    let len = (out.len() - len_at - 4) as u32;
    if let Some(slot) = out.get_mut(len_at..len_at + 4) {
        slot.copy_from_slice(&len.to_be_bytes());
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct FieldTable(pub Vec<(String, FieldValue)>);

impl FieldTable {
    pub fn new() -> Self {
        FieldTable(Vec::new())
    }
    pub fn get(&self, key: &str) -> Option<&FieldValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    /// Replaces the first value under `key`, or appends it.
    pub fn insert(&mut self, key: String, value: FieldValue) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v = value,
            None => self.0.push((key, value)),
        }
    }
    pub fn remove(&mut self, key: &str) -> Option<FieldValue> {
        let i = self.0.iter().position(|(k, _)| k == key)?;
        Some(self.0.remove(i).1)
    }
    pub fn iter(&self) -> impl Iterator<Item = (&String, &FieldValue)> {
        self.0.iter().map(|(k, v)| (k, v))
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Decodes a table from its wire form (4-byte length, then key/value pairs).
    pub fn decode(bytes: &[u8]) -> Result<FieldTable, FrameError> {
        FieldTable::read(&mut Reader::new(bytes), 0)
    }

    /// Encodes the table in its wire form (4-byte length, then key/value pairs).
    pub fn encode(&self, out: &mut BytesMut) {
        self.write(out)
    }

    pub(crate) fn read(r: &mut Reader, depth: usize) -> Result<FieldTable, FrameError> {
        let offset = r.position();
        if depth > MAX_DEPTH {
            return Err(too_deep(offset));
        }
        let bytes = r.long_bytes()?;
        let mut inner = Reader::new(bytes);
        let mut pairs = Vec::new();
        while inner.remaining() > 0 {
            let key = inner.short_str()?;
            let value = FieldValue::read(&mut inner, depth)?;
            pairs.push((key, value));
        }
        Ok(FieldTable(pairs))
    }

    pub(crate) fn write(&self, out: &mut BytesMut) {
        let len_at = out.len();
        out.put_u32(0);
        for (k, v) in &self.0 {
            crate::codec::put_short_str(out, k);
            v.write(out);
        }
        patch_len(out, len_at);
    }
}

/// Checks that `bytes`, a field table in wire form (length prefix included), is well formed:
/// every length in bounds, every type known, nesting at most `MAX_DEPTH`. Allocates nothing, so
/// the publish path can refuse a malformed `headers` table without decoding it.
pub fn validate_table(bytes: &[u8]) -> Result<(), FrameError> {
    let mut r = Reader::new(bytes);
    skip_table(&mut r, 0)?;
    if r.remaining() != 0 {
        return Err(FrameError::Syntax {
            what: "field table",
            offset: r.position(),
            detail: format!("{} bytes after the end of the table", r.remaining()),
        });
    }
    Ok(())
}

fn skip_table(r: &mut Reader, depth: usize) -> Result<(), FrameError> {
    if depth > MAX_DEPTH {
        return Err(too_deep(r.position()));
    }
    let mut inner = Reader::new(r.long_bytes()?);
    while inner.remaining() > 0 {
        inner.short_bytes()?;
        skip_value(&mut inner, depth)?;
    }
    Ok(())
}

fn skip_value(r: &mut Reader, depth: usize) -> Result<(), FrameError> {
    let offset = r.position();
    let fixed = match r.u8()? {
        b'V' => 0,
        b't' | b'b' | b'B' => 1,
        b's' | b'u' => 2,
        b'I' | b'i' | b'f' => 4,
        b'D' => 5,
        b'l' | b'L' | b'd' | b'T' => 8,
        b'S' | b'x' => {
            r.long_bytes()?;
            return Ok(());
        }
        b'F' => return skip_table(r, depth + 1),
        b'A' => {
            if depth >= MAX_DEPTH {
                return Err(too_deep(offset));
            }
            let mut inner = Reader::new(r.long_bytes()?);
            while inner.remaining() > 0 {
                skip_value(&mut inner, depth + 1)?;
            }
            return Ok(());
        }
        other => {
            return Err(FrameError::Syntax {
                what: "field value",
                offset,
                detail: format!("unknown field type '{}' ({other:#04x})", other.escape_ascii()),
            })
        }
    };
    r.take(fixed, "field value")?;
    Ok(())
}
