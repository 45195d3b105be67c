//! TLS for the AMQPS, HTTPS and metrics listeners: rustls on ring, TLS 1.2 and 1.3 only.
//!
//! The certificate, key and CA are read at start and again on SIGHUP ([`Tls::reload`]): a new
//! connection takes the configuration current at its accept, an open one keeps the one it began
//! with, and files that fail to load leave the current configuration in place.
//!
//! With `tls-ca`, client certificates are asked for and verified against it (refused in the
//! handshake when expired or issued by another CA); a client without one is accepted unless
//! `tls-fail-if-no-peer-cert`. A verified certificate names its user for AMQP's EXTERNAL mechanism
//! ([`PeerIdentity`]), as rabbitmq_auth_mechanism_ssl does.

use parking_lot::RwLock;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

/// Where the TLS files are and how client certificates are treated (from the configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: Option<PathBuf>,
    pub fail_if_no_peer_cert: bool,
    pub login_from: CertLoginFrom,
}

/// Which part of a client certificate's subject is the user name of an EXTERNAL login
/// (RabbitMQ's `ssl_cert_login_from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum CertLoginFrom {
    #[default]
    DistinguishedName,
    CommonName,
}

/// The configurations built from one reading of the files.
struct Loaded {
    amqp: TlsAcceptor,
    http: TlsAcceptor,
    /// The server certificate's notAfter, unix seconds.
    not_after: i64,
}

/// The node's TLS configuration, replaced whole on reload.
pub struct Tls {
    current: RwLock<Arc<Loaded>>,
    login_from: CertLoginFrom,
}

/// What a verified client certificate says of its holder.
#[derive(Debug, Clone)]
pub struct PeerIdentity {
    /// The user name an EXTERNAL login is for (subject DN or CN, by `tls-cert-login-from`).
    pub user: Option<String>,
    /// Subject and issuer as RabbitMQ shows them (`peer_cert_subject`, `peer_cert_issuer`).
    pub subject: String,
    pub issuer: String,
    /// notBefore - notAfter (`peer_cert_validity`).
    pub validity: String,
}

/// What an accepted TLS session is, for the management API's connection fields.
#[derive(Debug, Clone)]
pub struct Session {
    /// `tlsv1.3` or `tlsv1.2`, as RabbitMQ's `ssl_protocol`.
    pub protocol: &'static str,
    /// The cipher suite's IANA name.
    pub cipher: String,
    pub peer: Option<PeerIdentity>,
}

/// Certificates nearer their end than this are warned of at start and reload.
const EXPIRY_WARNING_SECS: i64 = 30 * 24 * 3600;

impl Tls {
    /// Reads the files; an error names the file and what is wrong with it.
    pub fn load(settings: &TlsSettings) -> Result<Arc<Tls>, String> {
        let loaded = load(settings)?;
        warn_if_expiring(loaded.not_after, &settings.cert);
        Ok(Arc::new(Tls { current: RwLock::new(Arc::new(loaded)), login_from: settings.login_from }))
    }

    /// Reads the files again; on an error the current configuration stays.
    pub fn reload(&self, settings: &TlsSettings) -> Result<(), String> {
        let loaded = load(settings)?;
        warn_if_expiring(loaded.not_after, &settings.cert);
        *self.current.write() = Arc::new(loaded);
        Ok(())
    }

    /// What a new AMQPS connection is accepted with.
    pub fn amqp_acceptor(&self) -> TlsAcceptor {
        self.current.read().amqp.clone()
    }

    /// What a new HTTPS connection is accepted with (ALPN `http/1.1`).
    pub fn http_acceptor(&self) -> TlsAcceptor {
        self.current.read().http.clone()
    }

    /// The current server certificate's notAfter, unix seconds (a metric).
    pub fn not_after(&self) -> i64 {
        self.current.read().not_after
    }

    /// What a handshake established: protocol, cipher and the client's certificate (rustls
    /// verified it against `tls-ca` during the handshake).
    pub fn session(&self, connection: &rustls::ServerConnection) -> Session {
        let protocol = match connection.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => "tlsv1.3",
            _ => "tlsv1.2",
        };
        let cipher = connection.negotiated_cipher_suite().map(|s| format!("{:?}", s.suite())).unwrap_or_default();
        Session { protocol, cipher, peer: self.peer_identity(connection.peer_certificates()) }
    }

    fn peer_identity(&self, certificates: Option<&[CertificateDer<'_>]>) -> Option<PeerIdentity> {
        let leaf = certificates?.first()?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
        let subject = distinguished_name(cert.subject());
        let user = match self.login_from {
            CertLoginFrom::DistinguishedName => Some(subject.clone()),
            CertLoginFrom::CommonName => cert.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok()).map(str::to_string),
        };
        let validity = cert.validity();
        let validity = format!("{} - {}", validity.not_before, validity.not_after);
        Some(PeerIdentity { user, subject, issuer: distinguished_name(cert.issuer()), validity })
    }
}

fn load(settings: &TlsSettings) -> Result<Loaded, String> {
    let certs = read_certificates(&settings.cert)?;
    // The parser's error quotes the bytes where it stopped, which may be the key itself: only its kind.
    let key = PrivateKeyDer::from_pem_file(&settings.key).map_err(|e| {
        let why = match e {
            rustls_pki_types::pem::Error::Io(e) => e.to_string(),
            rustls_pki_types::pem::Error::NoItemsFound => "no PEM private key in it".to_string(),
            _ => "not a well-formed PEM private key (PKCS#8, RSA or SEC1)".to_string(),
        };
        format!("cannot read a private key from tls-key {}: {why}", settings.key.display())
    })?;
    let not_after = certs
        .first()
        .and_then(|leaf| x509_parser::parse_x509_certificate(leaf.as_ref()).ok())
        .map(|(_, cert)| cert.validity().not_after.timestamp())
        .ok_or_else(|| format!("tls-cert {}: the first certificate cannot be parsed", settings.cert.display()))?;
    // ring, as the cluster transport (aws-lc-rs, the provider with post-quantum key exchange, is a
    // C and cmake build: DEPENDENCIES.md).
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match &settings.ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in read_certificates(ca)? {
                roots.add(cert).map_err(|e| format!("tls-ca {}: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = match settings.fail_if_no_peer_cert {
                true => verifier,
                false => verifier.allow_unauthenticated(),
            };
            builder.with_client_cert_verifier(verifier.build().map_err(|e| format!("tls-ca {}: {e}", ca.display()))?)
        }
    };
    let amqp = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("tls-cert {} with tls-key {}: {e}", settings.cert.display(), settings.key.display()))?;
    let mut http = amqp.clone();
    http.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Loaded { amqp: TlsAcceptor::from(Arc::new(amqp)), http: TlsAcceptor::from(Arc::new(http)), not_after })
}

fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read certificates from {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

fn warn_if_expiring(not_after: i64, path: &Path) {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    if not_after <= now {
        tracing::error!(certificate = %path.display(), not_after, "the TLS certificate has expired: clients will refuse it");
    } else if not_after - now < EXPIRY_WARNING_SECS {
        tracing::warn!(certificate = %path.display(), days_left = (not_after - now) / 86400, "the TLS certificate expires soon");
    }
}

/// A subject as rabbitmq_auth_mechanism_ssl names its user (checked against RabbitMQ 3.10.8 by
/// tests/python/test_tls.py): RFC 4514's string form, the last RDN first, `,` between RDNs and `+`
/// within one (in certificate order), attribute types by RabbitMQ's upper-case names or else the
/// dotted OID, values escaped by [`escape_dn_value`].
pub fn distinguished_name(name: &x509_parser::x509::X509Name<'_>) -> String {
    let rdns: Vec<String> = name
        .iter()
        .map(|rdn| {
            rdn.iter()
                .map(|attr| {
                    let oid = attr.attr_type().to_id_string();
                    let key = ATTRIBUTE_NAMES.iter().find(|(id, _)| *id == oid).map_or(oid.as_str(), |(_, name)| name).to_string();
                    let value = attr.as_str().map(escape_dn_value).unwrap_or_else(|_| {
                        // Not a string type: RFC 4514 gives the DER in hex after `#`.
                        let hex: String = attr.attr_value().data.iter().map(|b| format!("{b:02x}")).collect();
                        format!("#{hex}")
                    });
                    format!("{key}={value}")
                })
                .collect::<Vec<_>>()
                .join("+")
        })
        .collect();
    rdns.into_iter().rev().collect::<Vec<_>>().join(",")
}

/// The attribute types RabbitMQ names (its `rabbit_ssl` formatting); others are dotted OIDs.
const ATTRIBUTE_NAMES: &[(&str, &str)] = &[
    ("2.5.4.3", "CN"),
    ("2.5.4.6", "C"),
    ("2.5.4.7", "L"),
    ("2.5.4.8", "ST"),
    ("2.5.4.10", "O"),
    ("2.5.4.11", "OU"),
    ("0.9.2342.19200300.100.1.25", "DC"),
    ("0.9.2342.19200300.100.1.1", "UID"),
    ("2.5.4.4", "SN"),
    ("2.5.4.42", "GIVENNAME"),
    ("2.5.4.12", "TITLE"),
    ("2.5.4.5", "SERIALNUMBER"),
    ("1.2.840.113549.1.9.1", "EMAILADDRESS"),
    ("2.5.4.43", "INITIALS"),
    ("2.5.4.44", "GENERATIONQUALIFIER"),
    ("2.5.4.65", "PSEUDONYM"),
];

/// RFC 4514 section 2.4 as RabbitMQ applies it: `"+,;<>\` and a leading `#` or space, a trailing
/// space, after a backslash; control characters and each byte of a non-ASCII character as `\XX`
/// (upper-case hex of its UTF-8 bytes).
fn escape_dn_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let last = value.chars().count().saturating_sub(1);
    for (i, ch) in value.chars().enumerate() {
        if (ch as u32) < 0x20 || (ch as u32) >= 0x7f {
            let mut bytes = [0u8; 4];
            for b in ch.encode_utf8(&mut bytes).bytes() {
                out.push_str(&format!("\\{b:02X}"));
            }
            continue;
        }
        let special = matches!(ch, '"' | '+' | ',' | ';' | '<' | '>' | '\\')
            || (i == 0 && (ch == '#' || ch == ' '))
            || (i == last && ch == ' ');
        if special {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_as_rfc_4514() {
        assert_eq!(escape_dn_value("Warren, Tests"), "Warren\\, Tests");
        assert_eq!(escape_dn_value("#1 "), "\\#1\\ ");
        assert_eq!(escape_dn_value("a+b"), "a\\+b");
        assert_eq!(escape_dn_value("plain"), "plain");
        assert_eq!(escape_dn_value("tab\there"), "tab\\09here");
        assert_eq!(escape_dn_value("ümlaut"), "\\C3\\BCmlaut");
    }
}
