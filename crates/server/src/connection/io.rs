//! Reading frames off the socket.
//!
//! The read buffer grows as frames need it and is freed while the connection is idle (nothing
//! half-read and nothing to read for a second): ten thousand idle connections hold no read buffers.

use super::error::ConnError;
use bytes::BytesMut;
use tokio::io::AsyncReadExt;
use super::stream::ReadHalf;
use warren_protocol::frame::{parse_frame, Frame};

pub struct FrameReader {
    socket: ReadHalf,
    buf: BytesMut,
}

impl FrameReader {
    pub fn new(socket: ReadHalf, leftover: BytesMut) -> Self {
        FrameReader { socket, buf: leftover }
    }

    /// Parses a frame already in the buffer, without reading.
    pub fn try_next(&mut self, frame_max: u32) -> Result<Option<Frame>, ConnError> {
        Ok(parse_frame(&mut self.buf, frame_max)?)
    }

    /// Reads more bytes from the socket; `Gone` on EOF or error.
    pub async fn fill(&mut self) -> Result<(), ConnError> {
        if self.buf.is_empty() && self.socket.is_tls() {
            return self.fill_tls().await;
        }
        if self.buf.is_empty() {
            if self.buf.capacity() > 0
                && tokio::time::timeout(super::RELEASE_BUFFERS_AFTER, self.socket.readable()).await.is_err()
            {
                self.buf = BytesMut::new();
            }
            if self.buf.capacity() == 0 {
                // Idle: wait for data before allocating a buffer for it.
                self.socket.readable().await.map_err(|_| ConnError::Gone)?;
            }
        }
        self.read_more().await
    }

    async fn read_more(&mut self) -> Result<(), ConnError> {
        if self.buf.capacity() - self.buf.len() < 16 * 1024 {
            self.buf.reserve(64 * 1024);
        }
        match self.socket.read_buf(&mut self.buf).await {
            Ok(0) | Err(_) => Err(ConnError::Gone),
            Ok(_) => Ok(()),
        }
    }

    /// `fill` with nothing buffered, over TLS: there is no `readable()` to wait on (rustls may
    /// already hold decrypted bytes), so the read itself is what waits. A read cut off by the
    /// timeout takes nothing, and the idle connection then waits with a small buffer on its stack.
    async fn fill_tls(&mut self) -> Result<(), ConnError> {
        if self.buf.capacity() > 0 {
            if let Ok(read) = tokio::time::timeout(super::RELEASE_BUFFERS_AFTER, self.read_more()).await {
                return read;
            }
            self.buf = BytesMut::new();
        }
        let mut first = [0u8; 1024];
        match self.socket.read(&mut first).await {
            Ok(0) | Err(_) => Err(ConnError::Gone),
            Ok(n) => {
                self.buf.reserve(64 * 1024);
                self.buf.extend_from_slice(first.get(..n).unwrap_or_default());
                Ok(())
            }
        }
    }

    /// The next frame, reading as needed.
    pub async fn next(&mut self, frame_max: u32) -> Result<Frame, ConnError> {
        loop {
            if let Some(frame) = self.try_next(frame_max)? {
                return Ok(frame);
            }
            self.fill().await?;
        }
    }
}
