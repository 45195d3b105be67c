//! A minimal AMQP 0-9-1 client connection for the load generator: the handshake and synchronous
//! setup calls through the workspace codec, then raw frames read in place from one reusable buffer.
//! The producer and consumer loops use [`next_frame`] on [`ReadBuf`] directly, so a message costs no
//! allocation on either side.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use warren_protocol::constants::{FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, FRAME_OVERHEAD, PROTOCOL_HEADER};
use warren_protocol::field::{FieldTable, FieldValue};
use warren_protocol::frame;
use warren_protocol::method::*;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// The largest frame this client asks for (the broker may offer less).
pub const CLIENT_FRAME_MAX: u32 = 131_072;

/// What `--uri` says: `amqp://user:pass@host:port/vhost` (user, password and vhost percent-encoded).
#[derive(Debug, Clone, PartialEq)]
pub struct Uri {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub pass: String,
    pub vhost: String,
    /// `amqps://`: TLS (see `tls`).
    pub tls: bool,
}

impl Uri {
    pub fn parse(uri: &str) -> Result<Uri, Error> {
        let (rest, tls) = match uri.split_once("://") {
            Some(("amqp", rest)) => (rest, false),
            Some(("amqps", rest)) => (rest, true),
            Some((scheme, _)) => return Err(format!("--uri: scheme {scheme}:// is not supported (amqp:// or amqps://)").into()),
            None => return Err(format!("--uri: expected amqp://user:pass@host:port/vhost, got {uri}").into()),
        };
        // Query parameters (heartbeat=..., etc.) are accepted and ignored.
        let rest = rest.split_once('?').map_or(rest, |(r, _)| r);
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((a, r)) => (Some(a), r),
            None => (None, rest),
        };
        let (user, pass) = match auth {
            Some(a) => match a.split_once(':') {
                Some((u, p)) => (decode(u), decode(p)),
                None => (decode(a), String::new()),
            },
            None => ("guest".into(), "guest".into()),
        };
        // No path, or an empty one: vhost "/" (as pika and PerfTest do); "/%2F": "/" too.
        let (hostport, vhost) = match rest.split_once('/') {
            Some((h, v)) if !v.is_empty() => (h, decode(v)),
            Some((h, _)) => (h, "/".to_string()),
            None => (rest, "/".to_string()),
        };
        let default_port = if tls { 5671 } else { 5672 };
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (h, after) = v6.split_once(']').ok_or_else(|| format!("--uri: bad IPv6 address in {uri}"))?;
            match after.strip_prefix(':') {
                Some(p) => (h.to_string(), p.parse().map_err(|_| format!("--uri: bad port in {uri}"))?),
                None => (h.to_string(), default_port),
            }
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), p.parse().map_err(|_| format!("--uri: bad port in {uri}"))?),
                None => (hostport.to_string(), default_port),
            }
        };
        let host = if host.is_empty() { "localhost".to_string() } else { host };
        Ok(Uri { host, port, user, pass, vhost, tls })
    }
}

/// Percent-decoding (`%2F` -> `/`).
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Some(v) = s.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The read buffer: bytes from the socket, frames parsed in place from its front. Allocated once
/// (grown only for a frame larger than it); consumed space is reclaimed by moving the unparsed tail
/// to the front, which is at most one partial frame.
pub struct ReadBuf {
    data: Vec<u8>,
    start: usize,
    end: usize,
}

impl ReadBuf {
    pub fn new(capacity: usize) -> ReadBuf {
        ReadBuf { data: vec![0; capacity], start: 0, end: 0 }
    }

    /// The bytes not parsed yet.
    pub fn filled(&self) -> &[u8] {
        &self.data[self.start..self.end]
    }

    pub fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Room to read into, at least `want` bytes (the rest of a partial frame) and at least 64 KiB when
    /// the buffer allows.
    pub fn spare(&mut self, want: usize) -> &mut [u8] {
        let free = self.data.len() - self.end;
        if free < want.max(64 << 10) && self.start > 0 {
            self.data.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.data.len() - self.end < want {
            self.data.resize(self.end + want, 0);
        }
        &mut self.data[self.end..]
    }

    pub fn filled_by(&mut self, n: usize) {
        self.end += n;
    }
}

/// One frame, borrowed from the read buffer.
pub struct RawFrame<'a> {
    pub kind: u8,
    /// Only channels 0 and 1 are ever open, and the broker uses 0 only for connection methods.
    #[allow(dead_code)]
    pub channel: u16,
    pub payload: &'a [u8],
}

/// What the front of the buffer holds: a whole frame and its length, or how many bytes in total the
/// next frame needs (at least 8: its envelope).
pub enum Next<'a> {
    Frame(RawFrame<'a>, usize),
    Need(usize),
}

/// Parses the frame envelope at the front of `buf` in place (no copy, no allocation); the payload is
/// decoded by the caller, with the codec (`Method::decode`) or, on the hot path, by hand.
pub fn next_frame(buf: &[u8], frame_max: u32) -> Result<Next<'_>, Error> {
    if buf.len() < 7 {
        return Ok(Next::Need(FRAME_OVERHEAD as usize));
    }
    let kind = buf[0];
    let channel = u16::from_be_bytes([buf[1], buf[2]]);
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    if !matches!(kind, FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT) {
        return Err(format!("the broker sent a frame of unknown type {kind}").into());
    }
    let total = size + FRAME_OVERHEAD as usize;
    if frame_max != 0 && total > frame_max as usize {
        return Err(format!("the broker sent a {total}-byte frame, larger than the negotiated frame_max {frame_max}").into());
    }
    if buf.len() < total {
        return Ok(Next::Need(total));
    }
    if buf[total - 1] != FRAME_END {
        return Err(format!("the broker sent a frame ending in {:#04x}, not 0xCE", buf[total - 1]).into());
    }
    Ok(Next::Frame(RawFrame { kind, channel, payload: &buf[7..7 + size] }, total))
}

/// Class and method id of a method frame's payload.
pub fn method_ids(payload: &[u8]) -> (u16, u16) {
    match payload {
        [a, b, c, d, ..] => (u16::from_be_bytes([*a, *b]), u16::from_be_bytes([*c, *d])),
        _ => (0, 0),
    }
}

/// The error for a connection.close or channel.close from the broker.
pub fn closed_by_broker(m: &Method) -> Option<String> {
    match m {
        Method::ConnectionClose(c) => Some(format!(
            "the broker closed the connection: {} {}{}",
            c.reply_code,
            c.reply_text,
            about(c.class_id, c.method_id)
        )),
        Method::ChannelClose(c) => {
            Some(format!("the broker closed the channel: {} {}{}", c.reply_code, c.reply_text, about(c.class_id, c.method_id)))
        }
        _ => None,
    }
}

fn about(class_id: u16, method_id: u16) -> String {
    if class_id == 0 {
        String::new()
    } else {
        format!(" (in reply to class {class_id} method {method_id})")
    }
}

/// A connection with channel 1 open.
pub struct Conn {
    pub stream: crate::tls::Stream,
    pub rb: ReadBuf,
    /// Write buffer for setup calls; the hot loops keep their own.
    pub wb: BytesMut,
    /// The negotiated frame_max (whole frame, envelope included).
    pub frame_max: u32,
}

const TIMEOUT: Duration = Duration::from_secs(30);

impl Conn {
    /// Opens a connection and channel 1. Heartbeats are off: a load generator is never idle for long,
    /// and a stalled run is better seen in the progress line than as a heartbeat timeout.
    pub async fn open(uri: &Uri, name: &str) -> Result<Conn, Error> {
        let addr = format!("{}:{}", uri.host, uri.port);
        let stream = match tokio::time::timeout(Duration::from_secs(10), TcpStream::connect((uri.host.as_str(), uri.port))).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("cannot connect to {addr}: {e}").into()),
            Err(_) => return Err(format!("cannot connect to {addr}: timed out").into()),
        };
        stream.set_nodelay(true)?;
        let stream = match uri.tls {
            false => crate::tls::Stream::Plain(stream),
            true => match tokio::time::timeout(TIMEOUT, crate::tls::connect(stream, &uri.host)).await {
                Ok(r) => r.map_err(|e| format!("{addr}: {e}"))?,
                Err(_) => return Err(format!("{addr}: the TLS handshake timed out").into()),
            },
        };
        let mut c = Conn { stream, rb: ReadBuf::new(512 << 10), wb: BytesMut::with_capacity(4096), frame_max: CLIENT_FRAME_MAX };
        match tokio::time::timeout(TIMEOUT, c.handshake(uri, name)).await {
            Ok(r) => r.map_err(|e| format!("{addr}: {e}").into()).map(|()| c),
            Err(_) => Err(format!("{addr}: the AMQP handshake timed out").into()),
        }
    }

    async fn handshake(&mut self, uri: &Uri, name: &str) -> Result<(), Error> {
        self.stream.write_all(&PROTOCOL_HEADER).await?;
        let start = match self.recv_method().await {
            Ok(Method::ConnectionStart(s)) => s,
            Ok(other) => return Err(format!("expected connection.start, got {}", other.name()).into()),
            Err(e) => return Err(format!("no connection.start: {e} (is this an AMQP 0-9-1 port?)").into()),
        };
        if !start.mechanisms.split(|b| *b == b' ').any(|m| m == b"PLAIN") {
            return Err(format!("the broker does not offer PLAIN authentication (offers {})", String::from_utf8_lossy(&start.mechanisms)).into());
        }
        let mut caps = FieldTable::new();
        for c in ["publisher_confirms", "consumer_cancel_notify", "basic.nack", "connection.blocked", "authentication_failure_close"] {
            caps.insert(c.into(), FieldValue::Bool(true));
        }
        let mut props = FieldTable::new();
        props.insert("product".into(), FieldValue::LongString("warren bench".into()));
        props.insert("version".into(), FieldValue::LongString(env!("CARGO_PKG_VERSION").into()));
        props.insert("connection_name".into(), FieldValue::LongString(name.to_string().into()));
        props.insert("capabilities".into(), FieldValue::Table(caps));
        let response = format!("\0{}\0{}", uri.user, uri.pass);
        self.send(
            0,
            &Method::ConnectionStartOk(ConnectionStartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: response.into_bytes().into(),
                locale: "en_US".into(),
            }),
        )
        .await?;
        let tune = match self.recv_method().await {
            Ok(Method::ConnectionTune(t)) => t,
            Ok(other) => return Err(format!("expected connection.tune, got {}", other.name()).into()),
            Err(e) => return Err(format!("login as {:?} refused: {e}", uri.user).into()),
        };
        let frame_max = if tune.frame_max == 0 { CLIENT_FRAME_MAX } else { tune.frame_max.min(CLIENT_FRAME_MAX) };
        self.frame_max = frame_max;
        frame::write_method(&mut self.wb, 0, &Method::ConnectionTuneOk(ConnectionTuneOk { channel_max: tune.channel_max, frame_max, heartbeat: 0 }));
        let open = ConnectionOpen { virtual_host: uri.vhost.clone(), reserved_1: String::new(), reserved_2: false };
        self.send(0, &Method::ConnectionOpen(open)).await?;
        match self.recv_method().await {
            Ok(Method::ConnectionOpenOk(_)) => {}
            Ok(other) => return Err(format!("expected connection.open-ok, got {}", other.name()).into()),
            Err(e) => return Err(format!("cannot open vhost {:?}: {e}", uri.vhost).into()),
        }
        match self.call(Method::ChannelOpen(ChannelOpen::default())).await? {
            Method::ChannelOpenOk(_) => Ok(()),
            other => Err(format!("expected channel.open-ok, got {}", other.name()).into()),
        }
    }

    /// Writes one method frame (plus anything already in the write buffer).
    pub async fn send(&mut self, channel: u16, m: &Method) -> Result<(), Error> {
        frame::write_method(&mut self.wb, channel, m);
        self.stream.write_all(&self.wb).await?;
        self.wb.clear();
        Ok(())
    }

    /// The next method frame; heartbeats and content frames are skipped, and a connection.close or
    /// channel.close from the broker is an error carrying its reply code and text.
    pub async fn recv_method(&mut self) -> Result<Method, Error> {
        loop {
            let need = match next_frame(self.rb.filled(), self.frame_max)? {
                Next::Frame(f, len) => {
                    let m = if f.kind == FRAME_METHOD { Some(Method::decode(f.payload)?) } else { None };
                    self.rb.consume(len);
                    match m {
                        Some(m) => {
                            if let Some(why) = closed_by_broker(&m) {
                                // Be polite: confirm the close, so the broker logs a clean shutdown.
                                let ok = if matches!(m, Method::ConnectionClose(_)) {
                                    (0, Method::ConnectionCloseOk(ConnectionCloseOk {}))
                                } else {
                                    (1, Method::ChannelCloseOk(ChannelCloseOk {}))
                                };
                                let _ = self.send(ok.0, &ok.1).await;
                                return Err(why.into());
                            }
                            return Ok(m);
                        }
                        None => continue,
                    }
                }
                Next::Need(n) => n - self.rb.filled().len(),
            };
            let n = self.stream.read(self.rb.spare(need)).await?;
            if n == 0 {
                return Err("the broker closed the socket".into());
            }
            self.rb.filled_by(n);
        }
    }

    /// Sends a synchronous method on channel 1 and waits for its reply (setup only).
    pub async fn call(&mut self, m: Method) -> Result<Method, Error> {
        let name = m.name();
        self.send(1, &m).await?;
        match tokio::time::timeout(TIMEOUT, self.recv_method()).await {
            Ok(r) => r.map_err(|e| format!("{name}: {e}").into()),
            Err(_) => Err(format!("{name}: no reply within {} s", TIMEOUT.as_secs()).into()),
        }
    }

    /// connection.close, then waits (briefly) for close-ok, discarding whatever else arrives.
    pub async fn close(mut self) {
        let close = ConnectionClose { reply_code: 200, reply_text: "bye".into(), class_id: 0, method_id: 0 };
        if self.send(0, &Method::ConnectionClose(close)).await.is_err() {
            return;
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match self.recv_method().await {
                    Ok(Method::ConnectionCloseOk(_)) | Err(_) => return,
                    Ok(_) => continue,
                }
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        let u = Uri::parse("amqp://guest:guest@127.0.0.1:5699/%2F").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.user.as_str(), u.vhost.as_str()), ("127.0.0.1", 5699, "guest", "/"));
        let u = Uri::parse("amqp://a:b@h/v1").unwrap();
        assert_eq!((u.port, u.vhost.as_str(), u.pass.as_str()), (5672, "v1", "b"));
        let u = Uri::parse("amqp://h").unwrap();
        assert_eq!((u.user.as_str(), u.pass.as_str(), u.vhost.as_str()), ("guest", "guest", "/"));
        let u = Uri::parse("amqp://u%40x:p%3Aw@[::1]:5673/a%2Fb?heartbeat=10").unwrap();
        assert_eq!(
            u,
            Uri { host: "::1".into(), port: 5673, user: "u@x".into(), pass: "p:w".into(), vhost: "a/b".into(), tls: false }
        );
        let u = Uri::parse("amqps://h").unwrap();
        assert_eq!((u.port, u.tls), (5671, true));
        assert!(Uri::parse("http://h").is_err());
        assert!(Uri::parse("h:5672").is_err());
        assert!(Uri::parse("amqp://h:port/").is_err());
        assert_eq!(decode("%2"), "%2");
        assert_eq!(decode("a%"), "a%");
        assert_eq!(decode("%2f"), "/");
    }

    #[test]
    fn frames_in_place_and_partial() {
        let mut out = BytesMut::new();
        frame::write_basic_ack(&mut out, 1, 42, true);
        frame::write_heartbeat(&mut out);
        let all = out.to_vec();
        // Every cut of the first frame asks for more.
        for cut in 0..all.len() - 8 {
            match next_frame(&all[..cut], 0).unwrap() {
                Next::Need(n) => assert!(n > cut, "cut {cut}"),
                Next::Frame(..) => panic!("a whole frame from {cut} bytes"),
            }
        }
        let Next::Frame(f, len) = next_frame(&all, 0).unwrap() else { panic!() };
        assert_eq!((f.kind, f.channel), (FRAME_METHOD, 1));
        assert_eq!(Method::decode(f.payload).unwrap(), Method::BasicAck(BasicAck { delivery_tag: 42, multiple: true }));
        let Next::Frame(f, _) = next_frame(&all[len..], 0).unwrap() else { panic!() };
        assert_eq!(f.kind, FRAME_HEARTBEAT);
        let mut bad = all.clone();
        bad[len - 1] = 0;
        assert!(next_frame(&bad, 0).is_err());
        assert!(next_frame(&all, 10).is_err());
    }

    #[test]
    fn read_buffer_compacts_and_grows() {
        let mut rb = ReadBuf::new(100 << 10);
        let s = rb.spare(10);
        s[..10].copy_from_slice(b"0123456789");
        rb.filled_by(10);
        rb.consume(4);
        assert_eq!(rb.filled(), b"456789");
        let s = rb.spare(200 << 10);
        assert!(s.len() >= 200 << 10);
        assert_eq!(rb.filled(), b"456789");
        rb.consume(6);
        assert!(rb.filled().is_empty());
    }
}
