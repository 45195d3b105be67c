//! Bounds-checked primitive readers and writers shared by the method, field-table and
//! property codecs. Every read checks what is left; nothing indexes a slice directly.

use crate::error::FrameError;
use crate::field::FieldTable;
use bytes::{BufMut, Bytes, BytesMut};

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Bit-packing state: consecutive `bit` fields share one octet.
    bits: u8,
    bit_pos: u8,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0, bits: 0, bit_pos: 8 }
    }
    pub fn position(&self) -> usize {
        self.pos
    }
    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }
    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], FrameError> {
        self.bit_pos = 8;
        let end = self.pos.checked_add(n).filter(|e| *e <= self.buf.len()).ok_or(FrameError::Truncated {
            what,
            offset: self.pos,
            need: n,
            have: self.remaining(),
        })?;
        let out = self.buf.get(self.pos..end).ok_or(FrameError::Truncated { what, offset: self.pos, need: n, have: 0 })?;
        self.pos = end;
        Ok(out)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FrameError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(u8::from_be_bytes(self.array("octet")?))
    }
    pub fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_be_bytes(self.array("short")?))
    }
    pub fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_be_bytes(self.array("long")?))
    }
    pub fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_be_bytes(self.array("long long")?))
    }
    pub fn bit(&mut self) -> Result<bool, FrameError> {
        if self.bit_pos >= 8 {
            self.bits = self.u8()?;
            self.bit_pos = 0;
        }
        let v = (self.bits >> self.bit_pos) & 1 == 1;
        self.bit_pos += 1;
        Ok(v)
    }
    pub fn short_str(&mut self) -> Result<String, FrameError> {
        let offset = self.pos;
        let len = self.u8()? as usize;
        let raw = self.take(len, "short string")?;
        String::from_utf8(raw.to_vec()).map_err(|_| FrameError::Syntax {
            what: "short string",
            offset,
            detail: "not valid UTF-8".to_string(),
        })
    }
    /// A short string as raw bytes (no UTF-8 check), for allocation-free scans.
    pub fn short_bytes(&mut self) -> Result<&'a [u8], FrameError> {
        let len = self.u8()? as usize;
        self.take(len, "short string")
    }
    pub fn long_bytes(&mut self) -> Result<&'a [u8], FrameError> {
        let len = self.u32()? as usize;
        self.take(len, "long string")
    }
    pub fn long_str(&mut self) -> Result<Bytes, FrameError> {
        Ok(Bytes::copy_from_slice(self.long_bytes()?))
    }
    pub fn table(&mut self) -> Result<FieldTable, FrameError> {
        self.bit_pos = 8;
        FieldTable::read(self, 0)
    }
}

/// Writes method arguments with the same bit-packing rule.
pub struct Writer<'a> {
    pub out: &'a mut BytesMut,
    bits: u8,
    nbits: u8,
}

impl<'a> Writer<'a> {
    pub fn new(out: &'a mut BytesMut) -> Self {
        Writer { out, bits: 0, nbits: 0 }
    }
    pub fn flush_bits(&mut self) {
        if self.nbits > 0 {
            self.out.put_u8(self.bits);
            self.bits = 0;
            self.nbits = 0;
        }
    }
    pub fn u8(&mut self, v: u8) {
        self.flush_bits();
        self.out.put_u8(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.flush_bits();
        self.out.put_u16(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.flush_bits();
        self.out.put_u32(v);
    }
    pub fn u64(&mut self, v: u64) {
        self.flush_bits();
        self.out.put_u64(v);
    }
    pub fn bit(&mut self, v: bool) {
        if self.nbits == 8 {
            self.flush_bits();
        }
        if v {
            self.bits |= 1 << self.nbits;
        }
        self.nbits += 1;
    }
    pub fn short_str(&mut self, s: &str) {
        self.flush_bits();
        put_short_str(self.out, s);
    }
    pub fn long_str(&mut self, b: &[u8]) {
        self.flush_bits();
        self.out.put_u32(b.len() as u32);
        self.out.put_slice(b);
    }
    pub fn table(&mut self, t: &FieldTable) {
        self.flush_bits();
        t.write(self.out);
    }
}

/// Short strings are at most 255 bytes; longer input is cut at a character boundary rather
/// than producing a corrupt frame.
pub fn put_short_str(out: &mut BytesMut, s: &str) {
    let mut len = s.len().min(255);
    while !s.is_char_boundary(len) {
        len -= 1;
    }
    out.put_u8(len as u8);
    out.put_slice(s.as_bytes().get(..len).unwrap_or_default());
}
