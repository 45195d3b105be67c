//! The byte-level pieces of the quorum queue's encodings (commands, replies, snapshots): LEB128
//! varints, fixed-width integers and a bounds-checked reader. Decoding never panics: every read
//! checks what is left and reports [`DecodeError`]; counts read from the input never size an
//! allocation beyond what the remaining bytes could hold.

use bytes::{BufMut, BytesMut};
use std::fmt;

/// Input that is not a valid encoding (truncated, unknown version or tag, out-of-range value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quorum queue decode error: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

pub(crate) fn err<T>(what: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(what.into()))
}

pub(crate) fn put_var(out: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

pub(crate) fn put_zigzag(out: &mut BytesMut, v: i64) {
    put_var(out, ((v << 1) ^ (v >> 63)) as u64);
}

/// An optional value as a varint: 0 = none, n + 1 = Some(n) (n below u64::MAX).
pub(crate) fn put_opt(out: &mut BytesMut, v: Option<u64>) {
    put_var(out, v.map_or(0, |n| n.saturating_add(1)));
}

pub(crate) fn put_bool(out: &mut BytesMut, v: bool) {
    out.put_u8(v as u8);
}

/// A cursor over input bytes; every read is checked.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        let Some(&b) = self.buf.get(self.pos) else { return err("truncated") };
        self.pos += 1;
        Ok(b)
    }

    pub fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => err(format!("bad boolean {b}")),
        }
    }

    pub fn u32_fixed(&mut self) -> Result<u32, DecodeError> {
        let bytes = self.bytes(4)?;
        Ok(u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    pub fn var(&mut self) -> Result<u64, DecodeError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            let part = (b & 0x7f) as u64;
            if shift == 63 && part > 1 {
                return err("varint overflows 64 bits");
            }
            v |= part << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        err("varint longer than 10 bytes")
    }

    pub fn var_u32(&mut self) -> Result<u32, DecodeError> {
        let v = self.var()?;
        u32::try_from(v).or_else(|_| err(format!("value {v} exceeds 32 bits")))
    }

    pub fn zigzag(&mut self) -> Result<i64, DecodeError> {
        let v = self.var()?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    pub fn opt(&mut self) -> Result<Option<u64>, DecodeError> {
        Ok(self.var()?.checked_sub(1))
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.remaining() {
            return err("truncated");
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// A count of items each taking at least `min_item_bytes` bytes: refused when the input is too
    /// short to hold them, so garbage never asks for a huge allocation.
    pub fn count(&mut self, min_item_bytes: usize) -> Result<usize, DecodeError> {
        let n = self.var()?;
        self.check_count(n, min_item_bytes)
    }

    pub fn check_count(&self, n: u64, min_item_bytes: usize) -> Result<usize, DecodeError> {
        let max = self.remaining() / min_item_bytes.max(1);
        if n > max as u64 {
            return err(format!("count {n} exceeds what {} remaining bytes can hold", self.remaining()));
        }
        Ok(n as usize)
    }

    pub fn end(&self) -> Result<(), DecodeError> {
        if self.remaining() != 0 {
            return err(format!("{} trailing bytes", self.remaining()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_reject_overlong() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX - 1, u64::MAX] {
            let mut b = BytesMut::new();
            put_var(&mut b, v);
            let mut r = Reader::new(&b);
            assert_eq!(r.var().unwrap(), v);
            assert_eq!(r.remaining(), 0);
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            let mut b = BytesMut::new();
            put_zigzag(&mut b, v);
            assert_eq!(Reader::new(&b).zigzag().unwrap(), v);
        }
        assert!(Reader::new(&[0xff; 11]).var().is_err());
        assert!(Reader::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02]).var().is_err());
        assert!(Reader::new(&[0x80]).var().is_err());
    }
}
