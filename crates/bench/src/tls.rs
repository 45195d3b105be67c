//! AMQPS for the load generator: the connection's stream, plain or TLS, and the TLS client
//! configuration (`--tls-ca`, or, like PerfTest with `amqps://`, any certificate when none is given).

use std::io::IoSlice;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

static CLIENT_CONFIG: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();

/// Sets how servers are verified for the whole run: against `ca` (PEM), or not at all.
pub fn configure(ca: Option<&std::path::Path>) -> Result<(), Error> {
    let _ = CLIENT_CONFIG.set(client_config(ca)?);
    Ok(())
}

/// A TLS client configuration (TLS 1.2/1.3, ring) trusting `ca` (PEM), or any certificate when
/// none is given; `warren ctl` uses it too, always with a CA.
pub fn client_config(ca: Option<&std::path::Path>) -> Result<Arc<rustls::ClientConfig>, Error> {
    #[allow(deprecated)] // ring, as the server (see crates/server/src/tls.rs)
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?;
    let config = match ca {
        Some(path) => {
            use rustls_pki_types::pem::PemObject;
            let mut roots = rustls::RootCertStore::empty();
            for cert in rustls_pki_types::CertificateDer::pem_file_iter(path).map_err(|e| format!("--tls-ca {}: {e}", path.display()))? {
                roots.add(cert.map_err(|e| format!("--tls-ca {}: {e}", path.display()))?)?;
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        None => builder.dangerous().with_custom_certificate_verifier(Arc::new(AnyCertificate(provider))).with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// Opens TLS over `tcp` for `host` (the name the certificate must carry, with `--tls-ca`).
pub async fn connect(tcp: TcpStream, host: &str) -> Result<Stream, Error> {
    if CLIENT_CONFIG.get().is_none() {
        configure(None)?;
    }
    let config = CLIENT_CONFIG.get().cloned().ok_or("no TLS configuration")?;
    let name = rustls_pki_types::ServerName::try_from(host.to_string()).map_err(|e| format!("{host}: {e}"))?;
    let tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await.map_err(|e| format!("TLS handshake with {host}: {e}"))?;
    Ok(Stream::Tls(WriteThrough::new(Box::new(tls))))
}

/// A connection's socket.
pub enum Stream {
    Plain(TcpStream),
    Tls(WriteThrough<Box<tokio_rustls::client::TlsStream<TcpStream>>>),
}

pub type ReadHalf<'a> = Box<dyn AsyncRead + Unpin + Send + 'a>;
pub type WriteHalf<'a> = Box<dyn AsyncWrite + Unpin + Send + 'a>;

impl Stream {
    /// The halves the hot loops read and write concurrently (a plain socket's own, lock-free halves).
    pub fn split(&mut self) -> (ReadHalf<'_>, WriteHalf<'_>) {
        match self {
            Stream::Plain(s) => {
                let (r, w) = s.split();
                (Box::new(r), Box::new(w))
            }
            Stream::Tls(s) => {
                let (r, w) = tokio::io::split(&mut s.inner);
                (Box::new(r), Box::new(WriteThrough::new(w)))
            }
        }
    }
}

/// A write is done only once its TLS records are on the socket. tokio-rustls's `poll_write` may
/// take bytes and keep their records until a flush, and the load loops do not flush: a producer
/// waiting for confirms would wait forever for messages still in the client. The bytes taken are
/// reported when the flush completes; the caller retries with the same buffer meanwhile (every
/// writer here does, as `write_all` does).
pub struct WriteThrough<S> {
    inner: S,
    /// Bytes of the caller's buffer already taken by `inner`, not yet flushed and reported.
    taken: usize,
}

impl<S> WriteThrough<S> {
    fn new(inner: S) -> Self {
        WriteThrough { inner, taken: 0 }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteThrough<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.taken == 0 {
            this.taken = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        }
        ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
        Poll::Ready(Ok(std::mem::take(&mut this.taken)))
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.taken == 0 {
            this.taken = ready!(Pin::new(&mut this.inner).poll_write_vectored(cx, bufs))?;
        }
        ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
        Poll::Ready(Ok(std::mem::take(&mut this.taken)))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(&mut s.inner).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Trusts any server certificate (a load generator's `amqps://` without `--tls-ca`), still
/// checking the handshake's signatures so the session is a real one.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls_pki_types::CertificateDer<'_>,
        _intermediates: &[rustls_pki_types::CertificateDer<'_>],
        _server_name: &rustls_pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
