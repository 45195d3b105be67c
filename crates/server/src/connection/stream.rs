//! A connection's socket, plain or TLS, split into the half the reader reads and the half the
//! writer task writes.
//!
//! An enum, not a boxed trait object or `tokio::io::split` for both: the plain halves stay
//! `TcpStream`'s own (no lock per read and write, `readable()` for the idle reader). A TLS stream
//! has no halves of its own, so it goes through `tokio::io::split`, whose lock each half takes.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

pub enum ReadHalf {
    Plain(OwnedReadHalf),
    Tls(tokio::io::ReadHalf<TlsStream<TcpStream>>),
}

pub enum WriteHalf {
    Plain(OwnedWriteHalf),
    Tls(tokio::io::WriteHalf<TlsStream<TcpStream>>),
}

pub fn split_plain(stream: TcpStream) -> (ReadHalf, WriteHalf) {
    let (read, write) = stream.into_split();
    (ReadHalf::Plain(read), WriteHalf::Plain(write))
}

pub fn split_tls(stream: TlsStream<TcpStream>) -> (ReadHalf, WriteHalf) {
    let (read, write) = tokio::io::split(stream);
    (ReadHalf::Tls(read), WriteHalf::Tls(write))
}

impl ReadHalf {
    /// Waits until the socket may have bytes, without taking them (plain sockets only: rustls may
    /// hold decrypted bytes while its socket is quiet, so a TLS half answers at once and the reader
    /// reads, see `FrameReader::fill`).
    pub async fn readable(&self) -> std::io::Result<()> {
        match self {
            ReadHalf::Plain(socket) => socket.readable().await,
            ReadHalf::Tls(_) => Ok(()),
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, ReadHalf::Tls(_))
    }
}

impl AsyncRead for ReadHalf {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ReadHalf::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WriteHalf {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Plain(s) => Pin::new(s).poll_write(cx, buf),
            WriteHalf::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            WriteHalf::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            WriteHalf::Plain(s) => s.is_write_vectored(),
            WriteHalf::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Plain(s) => Pin::new(s).poll_flush(cx),
            WriteHalf::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Plain(s) => Pin::new(s).poll_shutdown(cx),
            WriteHalf::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
