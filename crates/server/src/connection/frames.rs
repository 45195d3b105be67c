//! What the connection's writer sends at one wake-up: frames built in a buffer, with the bodies of
//! large deliveries sent from where they already are (one `writev`) rather than copied in.
//!
//! Copying each 1 KB body into the buffer was the largest single cost of a draining consumer's
//! node: 8.5% of a quorum queue leader's samples in Q2 (`bench/cluster.py`), in `write_content`'s
//! memcpy. The kernel copies the bytes into the socket either way; the copy in between is gone.

use bytes::{BufMut, BytesMut};
use std::io::IoSlice;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use super::stream::WriteHalf;
use warren_broker::MessageRef;
use warren_protocol::constants::FRAME_END;

/// Bodies at least this long are sent from the message; shorter ones are copied (an iovec costs
/// more than copying a few hundred bytes).
pub const SPLICE_MIN_BODY: usize = 512;

/// At most this many iovecs per `writev` (Linux's `UIO_MAXIOV`).
const MAX_IOVECS: usize = 1024;

/// Why writing stopped.
pub enum WriteFailed {
    Gone,
    TimedOut,
}

/// Frames to write: `buf`, with each spliced body's bytes going in at its offset.
#[derive(Default)]
pub struct OutFrames {
    pub buf: BytesMut,
    /// (offset in `buf` the body goes at, the message whose body it is), in offset order.
    spliced: Vec<(usize, MessageRef)>,
}

impl OutFrames {
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty() && self.spliced.is_empty()
    }

    /// Appends `message`'s body here (sent from the message), then the body frame's end; the frame's
    /// header must be in `buf` already.
    pub fn splice_body(&mut self, message: MessageRef) {
        self.spliced.push((self.buf.len(), message));
        self.buf.put_u8(FRAME_END);
    }

    /// Empties it for the next wake-up; `buf` keeps its memory.
    pub fn clear(&mut self) {
        self.buf.clear();
        self.spliced.clear();
    }

    /// Gives back the memory (an idle connection).
    pub fn release(&mut self) {
        *self = OutFrames::default();
    }

    /// The bytes to send, in order.
    fn parts(&self) -> Vec<&[u8]> {
        let mut parts = Vec::with_capacity(2 * self.spliced.len() + 1);
        let mut from = 0;
        for (at, message) in &self.spliced {
            parts.push(self.buf.get(from..*at).unwrap_or_default());
            parts.push(&message.body[..]);
            from = *at;
        }
        parts.push(self.buf.get(from..).unwrap_or_default());
        parts.retain(|p| !p.is_empty());
        parts
    }

    /// Writes everything; fails if the peer is gone or a write makes no progress for `timeout`.
    pub async fn write_to(&self, socket: &mut WriteHalf, timeout: Duration) -> Result<(), WriteFailed> {
        if self.spliced.is_empty() {
            return write_all(socket, &self.buf, timeout).await;
        }
        let parts = self.parts();
        // Where the next write starts: a part and an offset in it.
        let (mut part, mut offset) = (0, 0);
        let mut slices = Vec::with_capacity(parts.len().min(MAX_IOVECS));
        while part < parts.len() {
            slices.clear();
            let first = parts.get(part).and_then(|p| p.get(offset..)).unwrap_or_default();
            slices.push(IoSlice::new(first));
            slices.extend(parts.iter().skip(part + 1).take(MAX_IOVECS - 1).map(|p| IoSlice::new(p)));
            let mut written = match tokio::time::timeout(timeout, socket.write_vectored(&slices)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Err(WriteFailed::Gone),
                Ok(Ok(n)) => n,
                Err(_) => return Err(WriteFailed::TimedOut),
            };
            while written > 0 && part < parts.len() {
                let left = parts.get(part).map_or(0, |p| p.len()) - offset;
                if written >= left {
                    written -= left;
                    (part, offset) = (part + 1, 0);
                } else {
                    offset += written;
                    written = 0;
                }
            }
        }
        flush(socket, timeout).await
    }
}

/// Writes all of `buf`; fails if the peer is gone or a write makes no progress for `timeout`.
async fn write_all(socket: &mut WriteHalf, buf: &[u8], timeout: Duration) -> Result<(), WriteFailed> {
    let mut pos = 0;
    while pos < buf.len() {
        match tokio::time::timeout(timeout, socket.write(&buf[pos..])).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Err(WriteFailed::Gone),
            Ok(Ok(n)) => pos += n,
            Err(_) => return Err(WriteFailed::TimedOut),
        }
    }
    flush(socket, timeout).await
}

/// Sends what the socket holds back: nothing for a plain socket; over TLS, the records rustls
/// made of the last write but could not send yet.
async fn flush(socket: &mut WriteHalf, timeout: Duration) -> Result<(), WriteFailed> {
    match tokio::time::timeout(timeout, socket.flush()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(WriteFailed::Gone),
        Err(_) => Err(WriteFailed::TimedOut),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::sync::Arc;
    use tokio::io::AsyncReadExt;
    use warren_broker::Message;

    /// Many spliced bodies (more parts than one `writev` takes), written to a peer that reads slowly
    /// in small pieces (so writes are partial), arrive whole and in order.
    #[tokio::test]
    async fn spliced_bodies_arrive_in_order_through_partial_writes() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move { tokio::net::TcpStream::connect(addr).await.unwrap() });
        let (server, _) = listener.accept().await.unwrap();
        let mut client = client.await.unwrap();
        let (_read, mut write) = super::super::stream::split_plain(server);

        let mut out = OutFrames::default();
        let mut expected = Vec::new();
        for i in 0..4000u32 {
            let head = format!("head {i};");
            out.buf.extend_from_slice(head.as_bytes());
            expected.extend_from_slice(head.as_bytes());
            let body: Vec<u8> = (0..600 + i % 1500).map(|b| (b as u32 + i) as u8).collect();
            expected.extend_from_slice(&body);
            expected.push(FRAME_END);
            let message = Message { exchange: String::new(), routing_key: String::new(), properties: Bytes::new(), body: body.into(), persistent: false, expiration_ms: None };
            out.splice_body(Arc::new(message));
        }
        out.buf.extend_from_slice(b"tail");
        expected.extend_from_slice(b"tail");
        assert!(expected.len() > 4 << 20, "more than the socket buffers hold");

        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut chunk = [0u8; 7919];
            for reads in 0u64.. {
                let n = client.read(&mut chunk).await.unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&chunk[..n]);
                if reads % 64 == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            got
        });
        assert!(out.write_to(&mut write, Duration::from_secs(10)).await.is_ok());
        drop(write);
        let got = reader.await.unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the bytes differ");
    }
}
