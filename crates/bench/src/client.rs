//! A minimal AMQP 0-9-1 client connection for the load generator: handshake, then raw frames.
//! Built on the workspace codec, so a message costs a few hundred nanoseconds of client CPU.

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use warren_protocol::field::{FieldTable, FieldValue};
use warren_protocol::frame::{self, Frame};
use warren_protocol::method::*;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// What `--uri` says.
#[derive(Debug, Clone)]
pub struct Uri {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub pass: String,
    pub vhost: String,
}

impl Uri {
    pub fn parse(uri: &str) -> Result<Uri, Error> {
        let rest = uri.strip_prefix("amqp://").ok_or("the URI must start with amqp://")?;
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((a, r)) => (Some(a), r),
            None => (None, rest),
        };
        let (user, pass) = match auth {
            Some(a) => a.split_once(':').map(|(u, p)| (decode(u), decode(p))).unwrap_or((decode(a), String::new())),
            None => ("guest".into(), "guest".into()),
        };
        let (hostport, vhost) = match rest.split_once('/') {
            Some((h, v)) if !v.is_empty() => (h, decode(v)),
            Some((h, _)) => (h, "/".to_string()),
            None => (rest, "/".to_string()),
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), p.parse().map_err(|_| format!("bad port in {uri}"))?),
            None => (hostport.to_string(), 5672),
        };
        Ok(Uri { host, port, user, pass, vhost })
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

/// The reading half: frames in, parsed in place from one buffer.
pub struct Reader {
    sock: OwnedReadHalf,
    buf: BytesMut,
    pub frame_max: u32,
}

impl Reader {
    pub async fn next(&mut self) -> Result<Frame, Error> {
        loop {
            if let Some(f) = frame::parse_frame(&mut self.buf, 0)? {
                match &f {
                    Frame::Method { method: Method::ConnectionClose(c), .. } => {
                        return Err(format!("the broker closed the connection: {} {}", c.reply_code, c.reply_text).into())
                    }
                    Frame::Method { method: Method::ChannelClose(c), .. } => {
                        return Err(format!("the broker closed the channel: {} {}", c.reply_code, c.reply_text).into())
                    }
                    _ => return Ok(f),
                }
            }
            if self.buf.capacity() - self.buf.len() < 64 << 10 {
                self.buf.reserve(256 << 10);
            }
            if self.sock.read_buf(&mut self.buf).await? == 0 {
                return Err("the broker closed the socket".into());
            }
        }
    }

    /// The next method frame (heartbeats are skipped).
    pub async fn method(&mut self) -> Result<Method, Error> {
        loop {
            match self.next().await? {
                Frame::Method { method, .. } => return Ok(method),
                Frame::Heartbeat { .. } => continue,
                other => return Err(format!("unexpected frame {other:?}").into()),
            }
        }
    }
}

pub struct Writer {
    sock: OwnedWriteHalf,
    pub buf: BytesMut,
}

impl Writer {
    pub fn method(&mut self, channel: u16, m: &Method) {
        frame::write_method(&mut self.buf, channel, m);
    }

    pub async fn flush(&mut self) -> Result<(), Error> {
        if !self.buf.is_empty() {
            self.sock.write_all(&self.buf).await?;
            self.buf.clear();
        }
        Ok(())
    }
}

/// Opens a connection and channel 1 (heartbeats off: the load generator is never idle).
pub async fn connect(uri: &Uri, name: &str) -> Result<(Reader, Writer), Error> {
    let stream = TcpStream::connect((uri.host.as_str(), uri.port)).await?;
    stream.set_nodelay(true)?;
    let (r, w) = stream.into_split();
    let mut reader = Reader { sock: r, buf: BytesMut::with_capacity(256 << 10), frame_max: 131_072 };
    let mut writer = Writer { sock: w, buf: BytesMut::with_capacity(256 << 10) };
    writer.sock.write_all(b"AMQP\x00\x00\x09\x01").await?;
    let Method::ConnectionStart(_) = reader.method().await? else { return Err("expected connection.start".into()) };
    let mut caps = FieldTable::new();
    for c in ["publisher_confirms", "consumer_cancel_notify", "basic.nack", "connection.blocked", "authentication_failure_close"] {
        caps.insert(c.into(), FieldValue::Bool(true));
    }
    let mut props = FieldTable::new();
    props.insert("product".into(), FieldValue::LongString("warren bench".into()));
    props.insert("connection_name".into(), FieldValue::LongString(name.to_string().into()));
    props.insert("capabilities".into(), FieldValue::Table(caps));
    let response = format!("\0{}\0{}", uri.user, uri.pass);
    writer.method(0, &Method::ConnectionStartOk(ConnectionStartOk { client_properties: props, mechanism: "PLAIN".into(), response: response.into(), locale: "en_US".into() }));
    writer.flush().await?;
    let tune = match reader.method().await? {
        Method::ConnectionTune(t) => t,
        other => return Err(format!("expected connection.tune, got {}", other.name()).into()),
    };
    let frame_max = if tune.frame_max == 0 { 131_072 } else { tune.frame_max.min(131_072) };
    reader.frame_max = frame_max;
    writer.method(0, &Method::ConnectionTuneOk(ConnectionTuneOk { channel_max: tune.channel_max, frame_max, heartbeat: 0 }));
    writer.method(0, &Method::ConnectionOpen(ConnectionOpen { virtual_host: uri.vhost.clone(), reserved_1: String::new(), reserved_2: false }));
    writer.flush().await?;
    let Method::ConnectionOpenOk(_) = reader.method().await? else { return Err("expected connection.open-ok".into()) };
    writer.method(1, &Method::ChannelOpen(ChannelOpen::default()));
    writer.flush().await?;
    let Method::ChannelOpenOk(_) = reader.method().await? else { return Err("expected channel.open-ok".into()) };
    Ok((reader, writer))
}

/// Sends a synchronous method and waits for its reply (setup only).
pub async fn call(reader: &mut Reader, writer: &mut Writer, m: Method) -> Result<Method, Error> {
    writer.method(1, &m);
    writer.flush().await?;
    reader.method().await
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
    }
}
