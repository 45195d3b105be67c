//! Configuration of `warren server`.
//!
//! Four sources, each overriding the one before it, key by key:
//!
//! 1. built-in defaults ([`Config::default`], written out in `config/warren.toml`);
//! 2. a TOML file, named by `--config FILE` or else `WARREN_CONFIG`;
//! 3. environment variables: every key `some-key` can be set by `WARREN_SOME_KEY`;
//! 4. command-line flags (`--amqp-port`, `--http-port`, `--bind`, `--data-dir`).
//!
//! How it works: the defaults are serialized into a TOML table; the file's keys and the environment's
//! values (converted using the type of the key's default) are checked one key at a time and laid over
//! it; the merged table is deserialized once; flags are applied to the result; then [`Config::validate`]
//! checks the values together. Every error names the key, where the value came from (file path,
//! variable name or flag) and what would be accepted.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
pub use warren_store::RecoveryMode;

/// The flags of `warren server`. Each has an environment variable of the same name (`WARREN_*`),
/// which it overrides; both override the configuration file.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServerArgs {
    /// Port for AMQP 0-9-1 connections; 0 picks a free one [env: WARREN_AMQP_PORT] [default: 5672]
    #[arg(long, value_name = "N")]
    pub amqp_port: Option<u16>,

    /// Port of the HTTP management API (RabbitMQ's); 0 picks a free one [env: WARREN_HTTP_PORT] [default: 15672]
    #[arg(long, value_name = "N")]
    pub http_port: Option<u16>,

    /// Port of the Prometheus metrics (rabbitmq_prometheus's); 0 picks a free one [env: WARREN_PROMETHEUS_PORT]
    /// [default: 15692]
    #[arg(long, value_name = "N")]
    pub prometheus_port: Option<u16>,

    /// IP address to listen on; 0.0.0.0 or :: for all interfaces [env: WARREN_BIND] [default: 127.0.0.1]
    #[arg(long, value_name = "ADDR")]
    pub bind: Option<IpAddr>,

    /// Directory holding the message store and definitions [env: WARREN_DATA_DIR] [default: ./warren-data]
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,

    /// Delivery acknowledgement timeout in ms: a channel with a delivery unacked longer is closed (406)
    /// and its unacked messages requeued; 0 disables [env: WARREN_CONSUMER_TIMEOUT] [default: 1800000]
    #[arg(long, value_name = "MS")]
    pub consumer_timeout: Option<u64>,

    /// What startup does with damaged store files: tolerate-tail-corruption (a torn tail is cut, other
    /// damage refuses to start), absolute-consistency (any damage refuses) or tolerate-any-corruption
    /// (damaged bytes are skipped and kept in <data-dir>/store/damaged) [env: WARREN_RECOVERY_MODE]
    /// [default: tolerate-tail-corruption]
    #[arg(long, value_name = "MODE")]
    pub recovery_mode: Option<RecoveryMode>,

    /// TOML configuration file; every key is listed in config/warren.toml [env: WARREN_CONFIG]
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Most client connections at once, 0 for no limit [env: WARREN_MAX_CONNECTIONS] [default: 0]
    #[arg(long, value_name = "N")]
    pub max_connections: Option<u32>,

    /// Highest channel number a connection may open [env: WARREN_CHANNEL_MAX] [default: 2047]
    #[arg(long, value_name = "N")]
    pub channel_max: Option<u16>,

    /// Largest message body in bytes accepted from a publisher [env: WARREN_MAX_MESSAGE_SIZE] [default: 134217728]
    #[arg(long, value_name = "BYTES")]
    pub max_message_size: Option<u32>,

    /// This node's id in the cluster (1 or more; used with --peers) [env: WARREN_NODE_ID]
    #[arg(long, value_name = "N")]
    pub node_id: Option<u64>,

    /// Address the cluster port listens on, HOST:PORT [env: WARREN_CLUSTER_ADDR] [default: this node's
    /// address in --peers]
    #[arg(long, value_name = "HOST:PORT")]
    pub cluster_addr: Option<String>,

    /// Every node of the cluster, this one included: ID=HOST:PORT,ID=HOST:PORT,...; without it the
    /// node runs standalone [env: WARREN_PEERS]
    #[arg(long, value_name = "ID=HOST:PORT,...", value_delimiter = ',')]
    pub peers: Option<Vec<String>>,

    /// Shared secret every node of the cluster (and `warren ctl`) must know [env: WARREN_CLUSTER_SECRET]
    #[arg(long, value_name = "TEXT")]
    pub cluster_secret: Option<String>,

    /// The server's TLS certificate chain (PEM); with --tls-key, opens the AMQPS, HTTPS and
    /// metrics-over-TLS ports [env: WARREN_TLS_CERT]
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<String>,

    /// The private key of --tls-cert (PEM: PKCS#8, RSA or SEC1) [env: WARREN_TLS_KEY]
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<String>,

    /// CA certificates (PEM) client certificates are verified against; without it none is asked
    /// for. For `warren ctl`: the CA an https:// --url's certificate chains to [env: WARREN_TLS_CA]
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<String>,

    /// With --tls-ca, refuse TLS clients that present no certificate [env: WARREN_TLS_FAIL_IF_NO_PEER_CERT]
    #[arg(long)]
    pub tls_fail_if_no_peer_cert: bool,

    /// The user name of an EXTERNAL login: the client certificate's subject or its CN
    /// [env: WARREN_TLS_CERT_LOGIN_FROM] [default: distinguished_name]
    #[arg(long, value_name = "FROM")]
    pub tls_cert_login_from: Option<crate::tls::CertLoginFrom>,

    /// Port for AMQP 0-9-1 over TLS (with --tls-cert) [env: WARREN_AMQPS_PORT] [default: 5671]
    #[arg(long, value_name = "N")]
    pub amqps_port: Option<u16>,

    /// Port of the management and CMQ APIs over TLS (with --tls-cert) [env: WARREN_HTTPS_PORT] [default: 15671]
    #[arg(long, value_name = "N")]
    pub https_port: Option<u16>,

    /// Port of the Prometheus metrics over TLS (with --tls-cert) [env: WARREN_PROMETHEUS_TLS_PORT] [default: 15691]
    #[arg(long, value_name = "N")]
    pub prometheus_tls_port: Option<u16>,
}

/// When the store fsyncs, and so how long a publisher confirm can take.
///
/// In TOML and in `WARREN_SYNC` it is a string: `"every-batch"` or `"every-<N>ms"`, e.g. `"every-100ms"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// `fdatasync` after every group of appended batches (group commit). Confirms are sent as soon as
    /// the messages are on disk.
    #[default]
    EveryBatch,
    /// `fdatasync` at most every N milliseconds. Confirms still wait for the fsync, so they are up to
    /// N ms later; fewer fsyncs are done under load.
    IntervalMs(u64),
}

impl SyncMode {
    /// The fsync interval in milliseconds, 0 for [`SyncMode::EveryBatch`].
    pub fn interval_ms(self) -> u64 {
        match self {
            SyncMode::EveryBatch => 0,
            SyncMode::IntervalMs(ms) => ms,
        }
    }
}

impl fmt::Display for SyncMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyncMode::EveryBatch => f.write_str("every-batch"),
            SyncMode::IntervalMs(ms) => write!(f, "every-{ms}ms"),
        }
    }
}

impl FromStr for SyncMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "every-batch" {
            return Ok(SyncMode::EveryBatch);
        }
        s.strip_prefix("every-")
            .and_then(|rest| rest.strip_suffix("ms"))
            .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|digits| digits.parse::<u64>().ok())
            .map(SyncMode::IntervalMs)
            .ok_or_else(|| format!("expected {SYNC_EXPECTED}, found {s:?}"))
    }
}

impl Serialize for SyncMode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SyncMode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The configuration of a broker node. Keys are the field names in kebab-case (`amqp-port`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct Config {
    /// Address the listeners bind to.
    pub bind: IpAddr,
    /// AMQP 0-9-1 port; 0 lets the OS pick one.
    pub amqp_port: u16,
    /// HTTP management API port; 0 lets the OS pick one.
    pub http_port: u16,
    /// Prometheus metrics port; 0 lets the OS pick one.
    pub prometheus_port: u16,
    /// Directory for the message store and the durable definitions.
    pub data_dir: PathBuf,
    /// The user that may log in (applied at every start).
    pub default_user: String,
    /// Its password.
    pub default_pass: String,
    /// Users who may connect only from a loopback address, as in RabbitMQ.
    pub loopback_users: Vec<String>,
    /// The virtual host that always exists (created at start if missing).
    pub default_vhost: String,
    /// Heartbeat interval (seconds) proposed in connection.tune; 0 disables heartbeats.
    pub heartbeat: u16,
    /// Largest frame (bytes) proposed in connection.tune.
    pub frame_max: u32,
    /// Highest channel number proposed in connection.tune.
    pub channel_max: u16,
    /// Largest message body (bytes) accepted from a publisher.
    pub max_message_size: u32,
    /// Most client connections at once; 0 = no limit.
    pub max_connections: u32,
    /// Seconds a client has to complete the handshake (protocol header to connection.open).
    pub handshake_timeout: u32,
    /// Most AMQP connections in their handshake at once (`login_guard::HandshakeSlots`).
    pub max_handshakes: u32,
    /// Most of them from one address (an IPv6 /64).
    pub max_handshakes_per_source: u32,
    /// Failed logins a (source address, user) may have in a minute before its attempts wait
    /// (`login_guard::LoginGuard`); 0 never delays.
    pub login_failures_before_delay: u32,
    /// The longest a throttled login attempt waits for its turn (ms).
    pub login_delay_max_ms: u64,
    /// Seconds a write to a client may make no progress before the connection is closed.
    pub write_timeout: u32,
    /// When the store fsyncs.
    pub sync: SyncMode,
    /// Size (bytes) at which the store starts a new segment file.
    pub segment_size: u64,
    /// What startup does with damaged store files.
    #[serde(with = "recovery_mode_text")]
    pub recovery_mode: RecoveryMode,
    /// Memory alarm threshold: a fraction of the machine's RAM ("0.4") or a size ("2GiB").
    pub memory_high_watermark: String,
    /// Disk alarm threshold: free space (a size, "1GiB") below which publishers are blocked.
    pub disk_free_limit: String,
    /// Delivery acknowledgement timeout (ms), RabbitMQ's `consumer_timeout`; 0 disables.
    pub consumer_timeout: u64,
    /// Log filter (tracing `EnvFilter` directives), e.g. `info` or `warn,warren_broker=debug`.
    pub log: String,
    /// This node's id in the cluster; 0 (with no peers) runs standalone.
    pub node_id: u64,
    /// Where the cluster port listens; empty means this node's address in `peers`.
    pub cluster_addr: String,
    /// Every node of the cluster as "ID=HOST:PORT"; empty runs standalone, without Raft.
    pub peers: Vec<String>,
    /// The secret nodes prove to each other (and `warren ctl` to a node) when they connect.
    pub cluster_secret: String,
    /// The server's certificate chain (PEM); empty: no TLS listener.
    pub tls_cert: String,
    /// Its private key (PEM).
    pub tls_key: String,
    /// CA certificates client certificates are verified against; empty: none is asked for.
    pub tls_ca: String,
    /// With `tls-ca`, a client without a certificate is refused.
    pub tls_fail_if_no_peer_cert: bool,
    /// What names the user of an EXTERNAL login.
    pub tls_cert_login_from: crate::tls::CertLoginFrom,
    /// AMQP 0-9-1 over TLS.
    pub amqps_port: u16,
    /// The HTTP APIs over TLS.
    pub https_port: u16,
    /// Prometheus metrics over TLS.
    pub prometheus_tls_port: u16,
}

/// The cluster part of the configuration, when the node is a cluster member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSettings {
    pub node_id: u64,
    /// Where to listen for the other nodes.
    pub listen: SocketAddr,
    /// Every node (this one included): id and cluster address.
    pub peers: Vec<(u64, String)>,
    pub secret: String,
}

/// Parses one `peers` entry, "ID=HOST:PORT".
pub fn parse_peer(entry: &str) -> Option<(u64, String)> {
    let (id, addr) = entry.trim().split_once('=')?;
    let id: u64 = id.trim().parse().ok().filter(|id| *id > 0)?;
    let addr = addr.trim();
    let (host, port) = addr.rsplit_once(':')?;
    if host.is_empty() || port.parse::<u16>().ok().filter(|p| *p > 0).is_none() {
        return None;
    }
    Some((id, addr.to_owned()))
}

/// Shortest accepted cluster secret.
const CLUSTER_SECRET_MIN: usize = 8;

impl Default for Config {
    fn default() -> Self {
        Config {
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            amqp_port: 5672,
            http_port: 15672,
            prometheus_port: 15692,
            data_dir: PathBuf::from("./warren-data"),
            default_user: "guest".to_owned(),
            default_pass: "guest".to_owned(),
            loopback_users: vec!["guest".to_owned()],
            default_vhost: "/".to_owned(),
            heartbeat: 60,
            frame_max: 131_072,
            channel_max: 2047,
            max_message_size: 128 << 20,
            max_connections: 0,
            handshake_timeout: 10,
            max_handshakes: 1024,
            max_handshakes_per_source: 64,
            login_failures_before_delay: 5,
            login_delay_max_ms: 5000,
            write_timeout: 30,
            sync: SyncMode::EveryBatch,
            segment_size: 32 << 20,
            recovery_mode: RecoveryMode::TolerateTailCorruption,
            memory_high_watermark: "0.4".to_owned(),
            disk_free_limit: "1GiB".to_owned(),
            consumer_timeout: 1_800_000,
            log: "info".to_owned(),
            node_id: 0,
            cluster_addr: String::new(),
            peers: Vec::new(),
            cluster_secret: String::new(),
            tls_cert: String::new(),
            tls_key: String::new(),
            tls_ca: String::new(),
            tls_fail_if_no_peer_cert: false,
            tls_cert_login_from: crate::tls::CertLoginFrom::DistinguishedName,
            amqps_port: 5671,
            https_port: 15671,
            prometheus_tls_port: 15691,
        }
    }
}

/// A memory threshold: relative to RAM, or absolute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Watermark {
    Fraction(f64),
    Bytes(u64),
}

/// "0.4" (a fraction in (0, 1]) or a size ("2GiB", "512MB", "1000000").
pub fn parse_watermark(s: &str) -> Option<Watermark> {
    let t = s.trim();
    if t.contains('.') || t == "1" || t == "0" {
        let f: f64 = t.parse().ok()?;
        return (f > 0.0 && f <= 1.0).then_some(Watermark::Fraction(f));
    }
    parse_size(t).filter(|b| *b > 0).map(Watermark::Bytes)
}

/// A size: a number of bytes with an optional unit (kB, MB, GB, TB: powers of 1000; KiB, MiB, GiB,
/// TiB: powers of 1024), as RabbitMQ accepts for `disk_free_limit.absolute`.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// The AMQP minimum for frame-max (spec section 4.2.3, `frame-min-size`).
const FRAME_MIN_SIZE: u32 = 4096;
/// RabbitMQ's upper limit for `max_message_size` (512 MiB).
const MAX_MESSAGE_SIZE_LIMIT: u32 = 512 << 20;
/// Smallest accepted segment size.
const SEGMENT_SIZE_MIN: u64 = 4096;
/// Longest accepted handshake and write timeout, in seconds.
const TIMEOUT_MAX_S: u32 = 3600;
/// Longest accepted fsync interval: confirms wait this long at worst.
const SYNC_INTERVAL_MAX_MS: u64 = 60_000;

const SYNC_EXPECTED: &str = "\"every-batch\" or \"every-<N>ms\" (e.g. \"every-100ms\")";

/// What each key accepts, for error messages. The tests check it lists exactly the keys of [`Config`].
const KEYS: &[(&str, &str)] = &[
    ("bind", "an IP address such as 127.0.0.1, 0.0.0.0 or ::"),
    ("amqp-port", "a port number (0-65535)"),
    ("http-port", "a port number (0-65535)"),
    ("prometheus-port", "a port number (0-65535)"),
    ("data-dir", "a directory path"),
    ("default-user", "a user name"),
    ("default-pass", "a password"),
    ("loopback-users", "a list of user names (in the environment: comma-separated)"),
    ("default-vhost", "a virtual host name"),
    ("heartbeat", "a number of seconds (0-65535, 0 disables heartbeats)"),
    ("frame-max", "a frame size in bytes (4096-4294967295)"),
    ("channel-max", "a number of channels (1-65535)"),
    ("max-message-size", "a size in bytes (1-536870912)"),
    ("max-connections", "a number of connections (0 for no limit)"),
    ("handshake-timeout", "a number of seconds (1-3600)"),
    ("max-handshakes", "a number of connections (1 or more)"),
    ("max-handshakes-per-source", "a number of connections (1 or more)"),
    ("login-failures-before-delay", "a number of failed logins (0: never delay)"),
    ("login-delay-max-ms", "a number of milliseconds (1-60000)"),
    ("write-timeout", "a number of seconds (1-3600)"),
    ("sync", SYNC_EXPECTED),
    ("segment-size", "a size in bytes (at least 4096)"),
    ("recovery-mode", "\"tolerate-tail-corruption\", \"absolute-consistency\" or \"tolerate-any-corruption\""),
    ("memory-high-watermark", "a fraction of RAM such as \"0.4\", or a size such as \"2GiB\""),
    ("disk-free-limit", "a size such as \"1GiB\", \"500MB\" or a number of bytes"),
    ("consumer-timeout", "a number of milliseconds (0 disables the timeout)"),
    ("log", "a tracing filter such as \"info\" or \"warn,warren_broker=debug\""),
    ("node-id", "a node id (1 or more; 0 with no peers runs standalone)"),
    ("cluster-addr", "HOST:PORT to listen on for the other nodes (empty: this node's address in peers)"),
    ("peers", "a list of \"ID=HOST:PORT\" (in the environment: comma-separated)"),
    ("cluster-secret", "a shared secret of at least 8 characters"),
    ("tls-cert", "the path of a PEM certificate chain (empty: no TLS)"),
    ("tls-key", "the path of a PEM private key"),
    ("tls-ca", "the path of PEM CA certificates (empty: client certificates are not asked for)"),
    ("tls-fail-if-no-peer-cert", "true or false"),
    ("tls-cert-login-from", "\"distinguished_name\" or \"common_name\""),
    ("amqps-port", "a port number (0-65535)"),
    ("https-port", "a port number (0-65535)"),
    ("prometheus-tls-port", "a port number (0-65535)"),
];

fn expected(key: &str) -> &'static str {
    KEYS.iter().find(|(k, _)| *k == key).map_or("a value of the key's type", |(_, e)| e)
}

/// The environment variable for a key: `amqp-port` -> `WARREN_AMQP_PORT`.
pub fn env_var_name(key: &str) -> String {
    format!("WARREN_{}", key.to_ascii_uppercase().replace('-', "_"))
}

/// A value as shown in an error message; the password never is.
fn shown(key: &str, value: &str) -> String {
    if key == "default-pass" || key == "cluster-secret" {
        "<redacted>".to_owned()
    } else {
        value.to_owned()
    }
}

/// Why the configuration could not be loaded. Each message says which key, where its value came from
/// and what would be accepted.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {} (from {from}): {source}", path.display())]
    ReadFile {
        path: PathBuf,
        /// `--config` or `WARREN_CONFIG`.
        from: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error("config file {} is not valid TOML: {message}", path.display())]
    Syntax { path: PathBuf, message: String },

    #[error("config file {}: unknown key `{key}`{}", path.display(), unknown_key_hint(key))]
    UnknownKey { path: PathBuf, key: String },

    #[error("config file {}: {key} = {value}: expected {expected}", path.display())]
    FileValue { path: PathBuf, key: String, value: String, expected: &'static str },

    #[error("{var}={value}: expected {expected}")]
    EnvValue { var: String, value: String, expected: &'static str },

    #[error("WARREN_CONFIG is set but empty: set it to the path of a TOML file, or unset it")]
    EmptyConfigVar,

    /// A value of the right type that is out of range or inconsistent with another.
    #[error("invalid {key}{}: {problem}", origin.as_deref().map(|o| format!(" (from {o})")).unwrap_or_default())]
    Invalid { key: &'static str, problem: String, origin: Option<String> },

    /// Cannot happen: the defaults failed to round-trip through TOML.
    #[error("internal error in the configuration defaults: {0}")]
    Internal(String),
}

fn unknown_key_hint(key: &str) -> String {
    let dashed = key.replace('_', "-");
    if dashed != key && KEYS.iter().any(|(k, _)| *k == dashed) {
        return format!(" (did you mean `{dashed}`? keys are written with dashes)");
    }
    let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
    format!("; the keys are: {}", known.join(", "))
}

/// Where a key's value came from, for error messages.
#[derive(Debug, Clone)]
enum Origin {
    Default,
    File(PathBuf),
    Env(String),
    Flag(&'static str),
}

impl Origin {
    fn describe(&self) -> Option<String> {
        match self {
            Origin::Default => None,
            Origin::File(path) => Some(format!("config file {}", path.display())),
            Origin::Env(var) => Some(var.clone()),
            Origin::Flag(flag) => Some(flag.to_string()),
        }
    }
}

/// Converts an environment variable's text to a TOML value of the same type as the key's default.
/// Lists are comma-separated (all list keys hold strings); an empty variable is an empty list.
fn env_to_value(default: &toml::Value, raw: &str) -> Option<toml::Value> {
    use toml::Value;
    match default {
        Value::String(_) => Some(Value::String(raw.to_owned())),
        Value::Integer(_) => raw.trim().parse::<i64>().ok().map(Value::Integer),
        Value::Float(_) => raw.trim().parse::<f64>().ok().map(Value::Float),
        Value::Boolean(_) => match raw.trim().to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" | "1" => Some(Value::Boolean(true)),
            "false" | "no" | "off" | "0" => Some(Value::Boolean(false)),
            _ => None,
        },
        Value::Array(_) => Some(Value::Array(
            raw.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| Value::String(s.to_owned()))
                .collect(),
        )),
        Value::Datetime(_) | Value::Table(_) => None,
    }
}

/// Whether `value` is acceptable for `key` on its own (type and representable range).
fn value_fits(key: &str, value: &toml::Value) -> bool {
    let mut single = toml::Table::new();
    single.insert(key.to_owned(), value.clone());
    single.try_into::<Config>().is_ok()
}

impl Config {
    /// Loads the configuration: defaults <- file (`args.config` or `WARREN_CONFIG`) <- `WARREN_*`
    /// environment variables <- flags, then validates it.
    pub fn load(args: &ServerArgs) -> Result<Config, ConfigError> {
        Self::load_from(args, &|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`Config::load`] with the environment given explicitly (for tests).
    pub fn load_from(args: &ServerArgs, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let defaults = toml::Table::try_from(Config::default()).map_err(|e| ConfigError::Internal(e.to_string()))?;
        let mut merged = defaults.clone();
        let mut origins: BTreeMap<String, Origin> = defaults.keys().map(|k| (k.clone(), Origin::Default)).collect();

        // The file.
        let file = match &args.config {
            Some(path) => Some((path.clone(), "--config")),
            None => match env("WARREN_CONFIG") {
                Some(s) if s.is_empty() => return Err(ConfigError::EmptyConfigVar),
                Some(s) => Some((PathBuf::from(s), "WARREN_CONFIG")),
                None => None,
            },
        };
        if let Some((path, from)) = file {
            for (key, value) in read_file(&path, from)? {
                if !defaults.contains_key(&key) {
                    return Err(ConfigError::UnknownKey { path, key });
                }
                if !value_fits(&key, &value) {
                    return Err(ConfigError::FileValue {
                        value: shown(&key, &value.to_string()),
                        expected: expected(&key),
                        path,
                        key,
                    });
                }
                origins.insert(key.clone(), Origin::File(path.clone()));
                merged.insert(key, value);
            }
        }

        // The environment.
        for (key, default) in &defaults {
            let var = env_var_name(key);
            let Some(raw) = env(&var) else { continue };
            match env_to_value(default, &raw) {
                Some(value) if value_fits(key, &value) => {
                    merged.insert(key.clone(), value);
                    origins.insert(key.clone(), Origin::Env(var));
                }
                _ => {
                    return Err(ConfigError::EnvValue { value: shown(key, &raw), expected: expected(key), var });
                }
            }
        }

        let mut config: Config = merged.try_into().map_err(|e: toml::de::Error| ConfigError::Internal(e.to_string()))?;

        // The flags.
        let mut flag = |key: &str, name: &'static str| {
            origins.insert(key.to_owned(), Origin::Flag(name));
        };
        if let Some(port) = args.amqp_port {
            config.amqp_port = port;
            flag("amqp-port", "--amqp-port");
        }
        if let Some(port) = args.http_port {
            config.http_port = port;
            flag("http-port", "--http-port");
        }
        if let Some(port) = args.prometheus_port {
            config.prometheus_port = port;
            flag("prometheus-port", "--prometheus-port");
        }
        if let Some(port) = args.amqps_port {
            config.amqps_port = port;
            flag("amqps-port", "--amqps-port");
        }
        if let Some(port) = args.https_port {
            config.https_port = port;
            flag("https-port", "--https-port");
        }
        if let Some(port) = args.prometheus_tls_port {
            config.prometheus_tls_port = port;
            flag("prometheus-tls-port", "--prometheus-tls-port");
        }
        if let Some(path) = &args.tls_cert {
            config.tls_cert = path.clone();
            flag("tls-cert", "--tls-cert");
        }
        if let Some(path) = &args.tls_key {
            config.tls_key = path.clone();
            flag("tls-key", "--tls-key");
        }
        if let Some(path) = &args.tls_ca {
            config.tls_ca = path.clone();
            flag("tls-ca", "--tls-ca");
        }
        if args.tls_fail_if_no_peer_cert {
            config.tls_fail_if_no_peer_cert = true;
            flag("tls-fail-if-no-peer-cert", "--tls-fail-if-no-peer-cert");
        }
        if let Some(from) = args.tls_cert_login_from {
            config.tls_cert_login_from = from;
            flag("tls-cert-login-from", "--tls-cert-login-from");
        }
        if let Some(bind) = args.bind {
            config.bind = bind;
            flag("bind", "--bind");
        }
        if let Some(dir) = &args.data_dir {
            config.data_dir = dir.clone();
            flag("data-dir", "--data-dir");
        }
        if let Some(ms) = args.consumer_timeout {
            config.consumer_timeout = ms;
            flag("consumer-timeout", "--consumer-timeout");
        }
        if let Some(n) = args.max_connections {
            config.max_connections = n;
            flag("max-connections", "--max-connections");
        }
        if let Some(n) = args.channel_max {
            config.channel_max = n;
            flag("channel-max", "--channel-max");
        }
        if let Some(n) = args.max_message_size {
            config.max_message_size = n;
            flag("max-message-size", "--max-message-size");
        }
        if let Some(mode) = args.recovery_mode {
            config.recovery_mode = mode;
            flag("recovery-mode", "--recovery-mode");
        }
        if let Some(id) = args.node_id {
            config.node_id = id;
            flag("node-id", "--node-id");
        }
        if let Some(addr) = &args.cluster_addr {
            config.cluster_addr = addr.clone();
            flag("cluster-addr", "--cluster-addr");
        }
        if let Some(peers) = &args.peers {
            config.peers = peers.iter().map(|p| p.trim().to_owned()).filter(|p| !p.is_empty()).collect();
            flag("peers", "--peers");
        }
        if let Some(secret) = &args.cluster_secret {
            config.cluster_secret = secret.clone();
            flag("cluster-secret", "--cluster-secret");
        }

        config.check().map_err(|(key, problem)| ConfigError::Invalid {
            key,
            problem,
            origin: origins.get(key).and_then(Origin::describe),
        })?;
        Ok(config)
    }

    /// Checks ranges and consistency: frame-max >= 4096, channel-max >= 1, distinct ports, and so on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check().map_err(|(key, problem)| ConfigError::Invalid { key, problem, origin: None })
    }

    /// The memory alarm threshold in bytes, for a machine with `total_ram` bytes.
    pub fn memory_limit_bytes(&self, total_ram: u64) -> u64 {
        match parse_watermark(&self.memory_high_watermark) {
            Some(Watermark::Fraction(f)) => (total_ram as f64 * f) as u64,
            Some(Watermark::Bytes(b)) => b,
            None => (total_ram as f64 * 0.4) as u64,
        }
    }

    /// The disk alarm threshold in bytes of free space.
    pub fn disk_free_limit_bytes(&self) -> u64 {
        parse_size(&self.disk_free_limit).unwrap_or(1 << 30)
    }

    /// The first problem found, as (key, what is wrong).
    fn check(&self) -> Result<(), (&'static str, String)> {
        if parse_watermark(&self.memory_high_watermark).is_none() {
            return Err((
                "memory-high-watermark",
                format!("\"{}\" is neither a fraction of RAM in (0, 1] nor a size such as \"2GiB\"", self.memory_high_watermark),
            ));
        }
        if parse_size(&self.disk_free_limit).is_none() {
            return Err((
                "disk-free-limit",
                format!("\"{}\" is not a size such as \"1GiB\", \"500MB\" or a number of bytes", self.disk_free_limit),
            ));
        }
        if self.amqp_port != 0 && self.amqp_port == self.http_port {
            return Err((
                "http-port",
                format!("{} is also the amqp-port; the two listeners need different ports", self.http_port),
            ));
        }
        if self.prometheus_port != 0 && (self.prometheus_port == self.amqp_port || self.prometheus_port == self.http_port) {
            return Err((
                "prometheus-port",
                format!("{} is also the amqp-port or the http-port; each listener needs its own port", self.prometheus_port),
            ));
        }
        if self.tls_cert.is_empty() != self.tls_key.is_empty() {
            let (key, other) = if self.tls_cert.is_empty() { ("tls-cert", "tls-key") } else { ("tls-key", "tls-cert") };
            return Err((key, format!("must be set together with {other} (the certificate and its private key)")));
        }
        if self.tls_cert.is_empty() && (!self.tls_ca.is_empty() || self.tls_fail_if_no_peer_cert) {
            return Err(("tls-ca", "needs tls-cert and tls-key (client certificates are asked for over TLS only)".to_owned()));
        }
        if self.tls_fail_if_no_peer_cert && self.tls_ca.is_empty() {
            return Err(("tls-fail-if-no-peer-cert", "needs tls-ca, the CA client certificates are verified against".to_owned()));
        }
        if self.tls().is_some() {
            let ports = [
                ("amqp-port", self.amqp_port),
                ("http-port", self.http_port),
                ("prometheus-port", self.prometheus_port),
                ("amqps-port", self.amqps_port),
                ("https-port", self.https_port),
                ("prometheus-tls-port", self.prometheus_tls_port),
            ];
            for (i, (key, port)) in ports.iter().enumerate().skip(3) {
                if let Some((other, _)) = ports.iter().take(i).find(|(_, p)| *port != 0 && p == port) {
                    return Err((key, format!("{port} is also the {other}; each listener needs its own port")));
                }
            }
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(("data-dir", "must not be empty".to_owned()));
        }
        if self.default_user.is_empty() {
            return Err(("default-user", "must not be empty".to_owned()));
        }
        if self.default_pass.is_empty() {
            return Err(("default-pass", "must not be empty: nobody could log in with it".to_owned()));
        }
        if let Some(i) = self.loopback_users.iter().position(|u| u.is_empty()) {
            return Err(("loopback-users", format!("entry {} is an empty user name", i + 1)));
        }
        if self.default_vhost.is_empty() {
            return Err(("default-vhost", "must not be empty (RabbitMQ's default is \"/\")".to_owned()));
        }
        if self.frame_max < FRAME_MIN_SIZE {
            return Err((
                "frame-max",
                format!("{} is below {FRAME_MIN_SIZE}, the smallest frame-max AMQP 0-9-1 allows", self.frame_max),
            ));
        }
        if self.channel_max == 0 {
            return Err(("channel-max", "0 would allow no channel at all; use 1-65535".to_owned()));
        }
        if self.max_message_size == 0 || self.max_message_size > MAX_MESSAGE_SIZE_LIMIT {
            return Err((
                "max-message-size",
                format!("{} is outside 1-{MAX_MESSAGE_SIZE_LIMIT} (512 MiB, RabbitMQ's limit)", self.max_message_size),
            ));
        }
        for (key, secs) in [("handshake-timeout", self.handshake_timeout), ("write-timeout", self.write_timeout)] {
            if secs == 0 || secs > TIMEOUT_MAX_S {
                return Err((key, format!("{secs} is outside 1-{TIMEOUT_MAX_S} seconds")));
            }
        }
        for (key, n) in [("max-handshakes", self.max_handshakes), ("max-handshakes-per-source", self.max_handshakes_per_source)] {
            if n == 0 {
                return Err((key, "0 would refuse every connection; use 1 or more".to_owned()));
            }
        }
        if self.login_delay_max_ms == 0 || self.login_delay_max_ms > 60_000 {
            return Err(("login-delay-max-ms", format!("{} is outside 1-60000 ms", self.login_delay_max_ms)));
        }
        if let SyncMode::IntervalMs(ms) = self.sync {
            if ms == 0 || ms > SYNC_INTERVAL_MAX_MS {
                return Err((
                    "sync",
                    format!(
                        "\"{}\": the interval must be 1-{SYNC_INTERVAL_MAX_MS} ms; use \"every-batch\" to fsync every batch",
                        self.sync
                    ),
                ));
            }
        }
        if self.segment_size < SEGMENT_SIZE_MIN {
            return Err((
                "segment-size",
                format!("{} is below the minimum of {SEGMENT_SIZE_MIN} bytes", self.segment_size),
            ));
        }
        if self.log.trim().is_empty() {
            return Err(("log", "must not be empty; use e.g. \"info\" or \"warn\"".to_owned()));
        }
        self.check_cluster().map(|_| ())
    }

    /// The cluster settings: `None` when the node runs standalone (no `peers`).
    pub fn cluster(&self) -> Option<ClusterSettings> {
        self.check_cluster().ok().flatten()
    }

    fn check_cluster(&self) -> Result<Option<ClusterSettings>, (&'static str, String)> {
        if self.peers.is_empty() {
            if self.node_id != 0 || !self.cluster_addr.is_empty() {
                return Err((
                    if self.node_id != 0 { "node-id" } else { "cluster-addr" },
                    "set without peers: list every node of the cluster in peers (ID=HOST:PORT), or unset it to run standalone".to_owned(),
                ));
            }
            return Ok(None);
        }
        let mut peers: Vec<(u64, String)> = Vec::with_capacity(self.peers.len());
        for entry in &self.peers {
            let Some((id, addr)) = parse_peer(entry) else {
                return Err(("peers", format!("\"{entry}\" is not ID=HOST:PORT with an id of 1 or more")));
            };
            if peers.iter().any(|(other, _)| *other == id) {
                return Err(("peers", format!("node id {id} is listed twice")));
            }
            peers.push((id, addr));
        }
        peers.sort_unstable();
        if self.node_id == 0 {
            return Err(("node-id", "must be set (1 or more) when peers is set".to_owned()));
        }
        let Some((_, own)) = peers.iter().find(|(id, _)| *id == self.node_id) else {
            return Err(("node-id", format!("{} is not one of the ids in peers", self.node_id)));
        };
        let listen_text = if self.cluster_addr.is_empty() { own.as_str() } else { self.cluster_addr.as_str() };
        let listen = std::net::ToSocketAddrs::to_socket_addrs(listen_text)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or(("cluster-addr", format!("\"{listen_text}\" is not an address to listen on (HOST:PORT)")))?;
        if listen.port() != 0 && (listen.port() == self.amqp_port || listen.port() == self.http_port || listen.port() == self.prometheus_port) {
            return Err(("cluster-addr", format!("port {} is also the AMQP, HTTP or Prometheus port", listen.port())));
        }
        if self.cluster_secret.chars().count() < CLUSTER_SECRET_MIN {
            return Err((
                "cluster-secret",
                format!("must be set to at least {CLUSTER_SECRET_MIN} characters, the same on every node, when peers is set"),
            ));
        }
        Ok(Some(ClusterSettings { node_id: self.node_id, listen, peers, secret: self.cluster_secret.clone() }))
    }

    /// The TLS files and options, when `tls-cert` and `tls-key` are set.
    pub fn tls(&self) -> Option<crate::tls::TlsSettings> {
        if self.tls_cert.is_empty() || self.tls_key.is_empty() {
            return None;
        }
        Some(crate::tls::TlsSettings {
            cert: PathBuf::from(&self.tls_cert),
            key: PathBuf::from(&self.tls_key),
            ca: (!self.tls_ca.is_empty()).then(|| PathBuf::from(&self.tls_ca)),
            fail_if_no_peer_cert: self.tls_fail_if_no_peer_cert,
            login_from: self.tls_cert_login_from,
        })
    }

    /// Where AMQP over TLS, the HTTP APIs over TLS and the metrics over TLS listen.
    pub fn amqps_addr(&self) -> SocketAddr {
        SocketAddr::new(self.bind, self.amqps_port)
    }

    pub fn https_addr(&self) -> SocketAddr {
        SocketAddr::new(self.bind, self.https_port)
    }

    pub fn prometheus_tls_addr(&self) -> SocketAddr {
        SocketAddr::new(self.bind, self.prometheus_tls_port)
    }

    /// Where the management API listens.
    pub fn http_addr(&self) -> SocketAddr {
        SocketAddr::new(self.bind, self.http_port)
    }

    /// Where the Prometheus metrics are served.
    pub fn prometheus_addr(&self) -> SocketAddr {
        SocketAddr::new(self.bind, self.prometheus_port)
    }

    /// Where to listen for AMQP connections.
    pub fn amqp_addr(&self) -> SocketAddr {
        SocketAddr::new(self.bind, self.amqp_port)
    }

    /// The store's fsync interval in milliseconds, 0 meaning every batch.
    pub fn sync_interval_ms(&self) -> u64 {
        self.sync.interval_ms()
    }

    /// A one-line summary for the startup log; the password is redacted.
    pub fn summary(&self) -> String {
        let loopback = if self.loopback_users.is_empty() { "none".to_owned() } else { self.loopback_users.join(",") };
        format!(
            "amqp={} http-port={} prometheus-port={} data-dir={} default-user={} default-pass=<redacted> \
             loopback-users={} default-vhost={} heartbeat={}s frame-max={} channel-max={} \
             max-message-size={} max-connections={} handshake-timeout={}s max-handshakes={} max-handshakes-per-source={} \
             login-failures-before-delay={} login-delay-max-ms={} write-timeout={}s sync={} segment-size={} recovery-mode={} \
             memory-high-watermark={} disk-free-limit={} consumer-timeout={}ms log={}{}{}",
            self.amqp_addr(),
            self.http_port,
            self.prometheus_port,
            self.data_dir.display(),
            self.default_user,
            loopback,
            self.default_vhost,
            self.heartbeat,
            self.frame_max,
            self.channel_max,
            self.max_message_size,
            self.max_connections,
            self.handshake_timeout,
            self.max_handshakes,
            self.max_handshakes_per_source,
            self.login_failures_before_delay,
            self.login_delay_max_ms,
            self.write_timeout,
            self.sync,
            self.segment_size,
            self.recovery_mode,
            self.memory_high_watermark,
            self.disk_free_limit,
            self.consumer_timeout,
            self.log,
            match self.tls() {
                None => String::new(),
                Some(t) => format!(
                    " amqps-port={} https-port={} prometheus-tls-port={} tls-cert={} tls-key={} tls-ca={} tls-fail-if-no-peer-cert={}",
                    self.amqps_port,
                    self.https_port,
                    self.prometheus_tls_port,
                    t.cert.display(),
                    t.key.display(),
                    t.ca.as_ref().map_or("none".to_owned(), |p| p.display().to_string()),
                    t.fail_if_no_peer_cert,
                ),
            },
            match self.cluster() {
                None => " cluster=standalone".to_owned(),
                Some(c) => format!(
                    " node-id={} cluster-addr={} peers={} cluster-secret=<redacted>",
                    c.node_id,
                    c.listen,
                    self.peers.join(",")
                ),
            },
        )
    }
}

/// `recovery-mode` in TOML: the mode's name.
mod recovery_mode_text {
    use super::RecoveryMode;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(mode: &RecoveryMode, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(mode.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<RecoveryMode, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

fn read_file(path: &Path, from: &'static str) -> Result<toml::Table, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile { path: path.to_owned(), from, source })?;
    text.parse::<toml::Table>().map_err(|e| ConfigError::Syntax { path: path.to_owned(), message: syntax_message(&text, &e) })
}

/// Where and what the syntax error is, without the line itself: toml's own message quotes the
/// source line, which may hold `default-pass` or `cluster-secret`.
fn syntax_message(text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("{} at line {line}, column {column}", e.message().trim_end())
        }
        None => e.message().trim_end().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::io::Write;

    const SHIPPED: &str = include_str!("../../../config/warren.toml");
    const DOCS: &str = include_str!("../../../docs/configuration.md");

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| map.get(name).cloned()
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn file_with(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(text.as_bytes()).expect("write temp file");
        f
    }

    fn args_with_file(f: &tempfile::NamedTempFile) -> ServerArgs {
        ServerArgs { config: Some(f.path().to_owned()), ..ServerArgs::default() }
    }

    #[test]
    fn defaults() {
        let c = Config::load_from(&ServerArgs::default(), &no_env).expect("defaults load");
        assert_eq!(c, Config::default());
        assert_eq!(c.amqp_addr(), "127.0.0.1:5672".parse::<SocketAddr>().expect("addr"));
        assert_eq!(c.http_port, 15672);
        assert_eq!(c.data_dir, PathBuf::from("./warren-data"));
        assert_eq!((c.default_user.as_str(), c.default_pass.as_str()), ("guest", "guest"));
        assert_eq!(c.loopback_users, vec!["guest".to_owned()]);
        assert_eq!(c.default_vhost, "/");
        assert_eq!((c.heartbeat, c.frame_max, c.channel_max), (60, 131_072, 2047));
        assert_eq!(c.max_message_size, 134_217_728);
        assert_eq!(c.sync, SyncMode::EveryBatch);
        assert_eq!(c.sync_interval_ms(), 0);
        assert_eq!(c.segment_size, 32 * 1024 * 1024);
        assert_eq!(c.recovery_mode, RecoveryMode::TolerateTailCorruption);
        assert_eq!(c.log, "info");
        c.validate().expect("defaults are valid");
    }

    #[test]
    fn shipped_file_is_exactly_the_defaults() {
        let parsed: Config = toml::from_str(SHIPPED).expect("config/warren.toml parses");
        assert_eq!(parsed, Config::default());
        // And it lists every key, so it documents all of them.
        let table: toml::Table = SHIPPED.parse().expect("config/warren.toml parses as a table");
        let defaults = toml::Table::try_from(Config::default()).expect("defaults serialize");
        let mut in_file: Vec<&String> = table.keys().collect();
        in_file.sort_unstable();
        let mut all: Vec<&String> = defaults.keys().collect();
        all.sort_unstable();
        assert_eq!(in_file, all, "config/warren.toml must list every key");
    }

    #[test]
    fn key_descriptions_and_docs_cover_every_key() {
        let defaults = toml::Table::try_from(Config::default()).expect("defaults serialize");
        let mut described: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
        described.sort_unstable();
        let mut keys: Vec<&str> = defaults.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(described, keys);
        for key in keys {
            assert!(DOCS.contains(&format!("`{key}`")), "docs/configuration.md does not describe `{key}`");
            assert!(DOCS.contains(&env_var_name(key)), "docs/configuration.md does not name {}", env_var_name(key));
        }
    }

    #[test]
    fn file_overrides_defaults() {
        let f = file_with(
            "amqp-port = 5673\nbind = \"0.0.0.0\"\nheartbeat = 0\nsync = \"every-50ms\"\n\
             loopback-users = []\nsegment-size = 1_048_576\ndefault-vhost = \"prod\"\n",
        );
        let c = Config::load_from(&args_with_file(&f), &no_env).expect("load");
        assert_eq!(c.amqp_port, 5673);
        assert_eq!(c.bind, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        assert_eq!(c.heartbeat, 0);
        assert_eq!(c.sync, SyncMode::IntervalMs(50));
        assert_eq!(c.sync_interval_ms(), 50);
        assert!(c.loopback_users.is_empty());
        assert_eq!(c.segment_size, 1 << 20);
        assert_eq!(c.default_vhost, "prod");
        // Keys the file leaves out keep their defaults.
        assert_eq!(c.http_port, 15672);
        assert_eq!(c.frame_max, 131_072);
    }

    #[test]
    fn warren_config_names_the_file_and_the_flag_wins_over_it() {
        let from_env = file_with("amqp-port = 1111\n");
        let from_flag = file_with("amqp-port = 2222\n");
        let path = from_env.path().to_string_lossy().into_owned();
        let env = env_of(&[("WARREN_CONFIG", &path)]);
        let c = Config::load_from(&ServerArgs::default(), &env).expect("load");
        assert_eq!(c.amqp_port, 1111);
        let c = Config::load_from(&args_with_file(&from_flag), &env).expect("load");
        assert_eq!(c.amqp_port, 2222);
    }

    #[test]
    fn env_overrides_file() {
        let f = file_with("amqp-port = 5673\nheartbeat = 10\nlog = \"debug\"\n");
        let env = env_of(&[
            ("WARREN_AMQP_PORT", "5674"),
            ("WARREN_HEARTBEAT", "30"),
            ("WARREN_LOOPBACK_USERS", "guest, monitor"),
            ("WARREN_SYNC", "every-200ms"),
            ("WARREN_BIND", "::1"),
            ("WARREN_DATA_DIR", "/var/lib/warren"),
        ]);
        let c = Config::load_from(&args_with_file(&f), &env).expect("load");
        assert_eq!(c.amqp_port, 5674);
        assert_eq!(c.heartbeat, 30);
        assert_eq!(c.loopback_users, vec!["guest".to_owned(), "monitor".to_owned()]);
        assert_eq!(c.sync, SyncMode::IntervalMs(200));
        assert_eq!(c.bind, "::1".parse::<IpAddr>().expect("ip"));
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/warren"));
        assert_eq!(c.log, "debug", "the file's value stays where the environment says nothing");
        assert_eq!(c.amqp_addr().to_string(), "[::1]:5674");
    }

    #[test]
    fn recovery_mode_from_file_env_and_flag() {
        let f = file_with("recovery-mode = \"absolute-consistency\"\n");
        let c = Config::load_from(&args_with_file(&f), &no_env).expect("load");
        assert_eq!(c.recovery_mode, RecoveryMode::AbsoluteConsistency);
        let env = env_of(&[("WARREN_RECOVERY_MODE", "tolerate-any-corruption")]);
        let c = Config::load_from(&args_with_file(&f), &env).expect("load");
        assert_eq!(c.recovery_mode, RecoveryMode::TolerateAnyCorruption);
        let args = ServerArgs { recovery_mode: Some(RecoveryMode::TolerateTailCorruption), ..args_with_file(&f) };
        let c = Config::load_from(&args, &env).expect("load");
        assert_eq!(c.recovery_mode, RecoveryMode::TolerateTailCorruption);
        let err = Config::load_from(&ServerArgs::default(), &env_of(&[("WARREN_RECOVERY_MODE", "skip")]))
            .expect_err("an unknown mode is refused")
            .to_string();
        assert!(err.contains("WARREN_RECOVERY_MODE=skip") && err.contains("tolerate-any-corruption"), "{err}");
    }

    #[test]
    fn empty_loopback_users_variable_means_no_loopback_restriction() {
        let c = Config::load_from(&ServerArgs::default(), &env_of(&[("WARREN_LOOPBACK_USERS", "")])).expect("load");
        assert!(c.loopback_users.is_empty());
    }

    #[test]
    fn flags_override_env() {
        let f = file_with("amqp-port = 5673\nhttp-port = 15673\n");
        let env = env_of(&[
            ("WARREN_AMQP_PORT", "5674"),
            ("WARREN_HTTP_PORT", "15674"),
            ("WARREN_BIND", "10.0.0.1"),
            ("WARREN_DATA_DIR", "/from/env"),
        ]);
        let args = ServerArgs {
            amqp_port: Some(5675),
            http_port: Some(15675),
            bind: Some(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
            data_dir: Some(PathBuf::from("/from/flag")),
            consumer_timeout: Some(5000),
            config: Some(f.path().to_owned()),
            max_connections: Some(7),
            channel_max: Some(8),
            max_message_size: Some(9),
            ..ServerArgs::default()
        };
        let env = |name: &str| match name {
            "WARREN_MAX_CONNECTIONS" | "WARREN_CHANNEL_MAX" | "WARREN_MAX_MESSAGE_SIZE" => Some("100".to_owned()),
            other => env(other),
        };
        let c = Config::load_from(&args, &env).expect("load");
        assert_eq!(c.consumer_timeout, 5000);
        assert_eq!(c.amqp_addr().to_string(), "0.0.0.0:5675");
        assert_eq!(c.http_port, 15675);
        assert_eq!(c.data_dir, PathBuf::from("/from/flag"));
        assert_eq!((c.max_connections, c.channel_max, c.max_message_size), (7, 8, 9));
    }

    #[test]
    fn flags_parse_with_clap() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ServerArgs,
        }
        let cli = Cli::try_parse_from([
            "warren", "--amqp-port", "1", "--http-port", "2", "--bind", "::", "--data-dir", "d", "--config", "c.toml",
            "--consumer-timeout", "60000",
            "--recovery-mode", "tolerate-any-corruption",
        ])
        .expect("flags parse");
        assert_eq!(cli.args.amqp_port, Some(1));
        assert_eq!(cli.args.http_port, Some(2));
        assert_eq!(cli.args.bind, Some("::".parse().expect("ip")));
        assert_eq!(cli.args.data_dir, Some(PathBuf::from("d")));
        assert_eq!(cli.args.config, Some(PathBuf::from("c.toml")));
        assert_eq!(cli.args.consumer_timeout, Some(60000));
        assert_eq!(cli.args.recovery_mode, Some(RecoveryMode::TolerateAnyCorruption));
        assert!(Cli::try_parse_from(["warren", "--recovery-mode", "skip"]).is_err());
        let none = Cli::try_parse_from(["warren"]).expect("no flags parse");
        assert!(none.args.amqp_port.is_none() && none.args.config.is_none());
        assert!(Cli::try_parse_from(["warren", "--amqp-port", "70000"]).is_err());
    }

    #[test]
    fn bad_env_values_say_which_variable_and_what_is_expected() {
        let err = |var: &str, value: &str| {
            Config::load_from(&ServerArgs::default(), &env_of(&[(var, value)]))
                .expect_err("should be rejected")
                .to_string()
        };
        assert_eq!(err("WARREN_AMQP_PORT", "abc"), "WARREN_AMQP_PORT=abc: expected a port number (0-65535)");
        assert_eq!(err("WARREN_AMQP_PORT", "70000"), "WARREN_AMQP_PORT=70000: expected a port number (0-65535)");
        assert_eq!(err("WARREN_HTTP_PORT", "-1"), "WARREN_HTTP_PORT=-1: expected a port number (0-65535)");
        assert_eq!(
            err("WARREN_BIND", "localhost"),
            "WARREN_BIND=localhost: expected an IP address such as 127.0.0.1, 0.0.0.0 or ::"
        );
        assert_eq!(
            err("WARREN_HEARTBEAT", "30s"),
            "WARREN_HEARTBEAT=30s: expected a number of seconds (0-65535, 0 disables heartbeats)"
        );
        assert_eq!(
            err("WARREN_SYNC", "sometimes"),
            "WARREN_SYNC=sometimes: expected \"every-batch\" or \"every-<N>ms\" (e.g. \"every-100ms\")"
        );
        assert_eq!(
            err("WARREN_CONFIG", ""),
            "WARREN_CONFIG is set but empty: set it to the path of a TOML file, or unset it"
        );
    }

    #[test]
    fn unknown_file_key_is_named() {
        let f = file_with("amqp-port = 5673\nheartbeet = 30\n");
        let msg = Config::load_from(&args_with_file(&f), &no_env).expect_err("unknown key").to_string();
        assert!(msg.contains(&f.path().display().to_string()), "{msg}");
        assert!(msg.contains("unknown key `heartbeet`"), "{msg}");
        assert!(msg.contains("heartbeat"), "lists the known keys: {msg}");

        let f = file_with("amqp_port = 5673\n");
        let msg = Config::load_from(&args_with_file(&f), &no_env).expect_err("unknown key").to_string();
        assert!(msg.contains("unknown key `amqp_port` (did you mean `amqp-port`?"), "{msg}");

        let f = file_with("[server]\namqp-port = 5673\n");
        let msg = Config::load_from(&args_with_file(&f), &no_env).expect_err("unknown key").to_string();
        assert!(msg.contains("unknown key `server`"), "{msg}");
    }

    #[test]
    fn bad_file_values_and_files() {
        let f = file_with("amqp-port = \"5673\"\n");
        let msg = Config::load_from(&args_with_file(&f), &no_env).expect_err("wrong type").to_string();
        assert_eq!(
            msg,
            format!("config file {}: amqp-port = \"5673\": expected a port number (0-65535)", f.path().display())
        );

        let f = file_with("default-pass = 1234\n");
        let msg = Config::load_from(&args_with_file(&f), &no_env).expect_err("wrong type").to_string();
        assert!(msg.contains("default-pass = <redacted>: expected a password"), "{msg}");
        assert!(!msg.contains("1234"), "{msg}");

        let f = file_with("amqp-port = \n");
        let msg = Config::load_from(&args_with_file(&f), &no_env).expect_err("bad syntax").to_string();
        assert!(msg.starts_with(&format!("config file {} is not valid TOML:", f.path().display())), "{msg}");
        assert!(msg.contains("line 1"), "{msg}");

        let args = ServerArgs { config: Some(PathBuf::from("/nonexistent/warren.toml")), ..ServerArgs::default() };
        let msg = Config::load_from(&args, &no_env).expect_err("missing file").to_string();
        assert!(msg.starts_with("cannot read config file /nonexistent/warren.toml (from --config): "), "{msg}");
        let msg = Config::load_from(&ServerArgs::default(), &env_of(&[("WARREN_CONFIG", "/nonexistent/w.toml")]))
            .expect_err("missing file")
            .to_string();
        assert!(msg.starts_with("cannot read config file /nonexistent/w.toml (from WARREN_CONFIG): "), "{msg}");
    }

    #[test]
    fn validate_errors() {
        let invalid = |change: fn(&mut Config)| {
            let mut c = Config::default();
            change(&mut c);
            c.validate().expect_err("should be invalid").to_string()
        };
        assert_eq!(
            invalid(|c| c.frame_max = 1024),
            "invalid frame-max: 1024 is below 4096, the smallest frame-max AMQP 0-9-1 allows"
        );
        assert_eq!(invalid(|c| c.channel_max = 0), "invalid channel-max: 0 would allow no channel at all; use 1-65535");
        assert_eq!(
            invalid(|c| c.http_port = 5672),
            "invalid http-port: 5672 is also the amqp-port; the two listeners need different ports"
        );
        assert!(invalid(|c| c.max_message_size = 0).starts_with("invalid max-message-size: 0 is outside"));
        assert!(invalid(|c| c.max_message_size = 600 << 20).starts_with("invalid max-message-size:"));
        assert!(invalid(|c| c.sync = SyncMode::IntervalMs(0)).starts_with("invalid sync: \"every-0ms\""));
        assert!(invalid(|c| c.sync = SyncMode::IntervalMs(600_000)).starts_with("invalid sync:"));
        assert!(invalid(|c| c.segment_size = 100).starts_with("invalid segment-size:"));
        assert_eq!(invalid(|c| c.write_timeout = 0), "invalid write-timeout: 0 is outside 1-3600 seconds");
        assert!(invalid(|c| c.handshake_timeout = 7200).starts_with("invalid handshake-timeout:"));
        assert!(invalid(|c| c.default_user.clear()).starts_with("invalid default-user:"));
        assert!(invalid(|c| c.default_pass.clear()).starts_with("invalid default-pass:"));
        assert!(invalid(|c| c.default_vhost.clear()).starts_with("invalid default-vhost:"));
        assert!(invalid(|c| c.loopback_users.push(String::new())).starts_with("invalid loopback-users:"));
        assert!(invalid(|c| c.data_dir = PathBuf::new()).starts_with("invalid data-dir:"));
        assert!(invalid(|c| c.log = " ".to_owned()).starts_with("invalid log:"));

        // Port 0 (pick a free port) twice is not a clash.
        let c = Config { amqp_port: 0, http_port: 0, ..Config::default() };
        c.validate().expect("two ephemeral ports are fine");
    }

    #[test]
    fn load_validates_and_names_the_source() {
        let err = |args: &ServerArgs, env: &[(&str, &str)]| {
            Config::load_from(args, &env_of(env)).expect_err("should be invalid").to_string()
        };
        assert_eq!(
            err(&ServerArgs::default(), &[("WARREN_FRAME_MAX", "1024")]),
            "invalid frame-max (from WARREN_FRAME_MAX): 1024 is below 4096, the smallest frame-max AMQP 0-9-1 allows"
        );
        let f = file_with("channel-max = 0\n");
        assert_eq!(
            err(&args_with_file(&f), &[]),
            format!(
                "invalid channel-max (from config file {}): 0 would allow no channel at all; use 1-65535",
                f.path().display()
            )
        );
        let args = ServerArgs { http_port: Some(5672), ..ServerArgs::default() };
        assert_eq!(
            err(&args, &[]),
            "invalid http-port (from --http-port): 5672 is also the amqp-port; the two listeners need different ports"
        );
    }

    #[test]
    fn sync_mode_text_form() {
        assert_eq!("every-batch".parse::<SyncMode>(), Ok(SyncMode::EveryBatch));
        assert_eq!("every-100ms".parse::<SyncMode>(), Ok(SyncMode::IntervalMs(100)));
        for bad in ["", "every", "every-ms", "every-+5ms", "every-5s", "every-5", "100", "Every-Batch", "every--5ms"] {
            assert!(bad.parse::<SyncMode>().is_err(), "{bad:?} should not parse");
        }
        assert_eq!(SyncMode::IntervalMs(25).to_string(), "every-25ms");
        assert_eq!(SyncMode::EveryBatch.to_string(), "every-batch");
    }

    #[test]
    fn sizes_and_watermarks() {
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("500MB"), Some(500_000_000));
        assert_eq!(parse_size(" 123 "), Some(123));
        assert_eq!(parse_size("12 kib"), Some(12 << 10));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("1XB"), None);
        assert_eq!(parse_watermark("0.4"), Some(Watermark::Fraction(0.4)));
        assert_eq!(parse_watermark("2GiB"), Some(Watermark::Bytes(2 << 30)));
        assert_eq!(parse_watermark("1.5"), None);
        assert_eq!(parse_watermark("0"), None);
        let c = Config::default();
        assert_eq!(c.memory_limit_bytes(1000), 400);
        assert_eq!(c.disk_free_limit_bytes(), 1 << 30);
        let bad = Config { memory_high_watermark: "most".into(), ..Config::default() };
        assert!(bad.validate().expect_err("invalid").to_string().starts_with("invalid memory-high-watermark"));
    }

    #[test]
    fn summary_redacts_the_password() {
        let c = Config { default_pass: "s3cret-value".to_owned(), ..Config::default() };
        let s = c.summary();
        assert!(!s.contains("s3cret-value"), "{s}");
        assert!(s.contains("default-pass=<redacted>"), "{s}");
        assert!(s.contains("amqp=127.0.0.1:5672"), "{s}");
        assert!(s.contains("sync=every-batch"), "{s}");
        assert!(!s.contains('\n'), "one line: {s}");
    }

    #[test]
    fn standalone_unless_peers_are_set() {
        let c = Config::default();
        assert_eq!(c.cluster(), None);
        assert!(c.summary().contains("cluster=standalone"));
    }

    #[test]
    fn cluster_keys_from_file_env_and_flags() {
        let f = file_with(
            "node-id = 2\npeers = [\"1=127.0.0.1:25672\", \"2=127.0.0.1:25673\", \"3=node3.example:25674\"]\n\
             cluster-secret = \"file-secret\"\n",
        );
        let c = Config::load_from(&args_with_file(&f), &no_env).expect("load");
        let cluster = c.cluster().expect("clustered");
        assert_eq!(cluster.node_id, 2);
        assert_eq!(cluster.listen, "127.0.0.1:25673".parse::<SocketAddr>().expect("addr"), "own entry in peers");
        assert_eq!(
            cluster.peers,
            vec![(1, "127.0.0.1:25672".into()), (2, "127.0.0.1:25673".into()), (3, "node3.example:25674".into())]
        );
        assert_eq!(cluster.secret, "file-secret");
        let s = c.summary();
        assert!(s.contains("node-id=2") && s.contains("cluster-secret=<redacted>") && !s.contains("file-secret"), "{s}");

        let env = env_of(&[
            ("WARREN_NODE_ID", "1"),
            ("WARREN_PEERS", "1=127.0.0.1:35672, 2=127.0.0.1:35673"),
            ("WARREN_CLUSTER_SECRET", "env-secret"),
            ("WARREN_CLUSTER_ADDR", "0.0.0.0:35672"),
        ]);
        let c = Config::load_from(&args_with_file(&f), &env).expect("load");
        let cluster = c.cluster().expect("clustered");
        assert_eq!((cluster.node_id, cluster.peers.len(), cluster.secret.as_str()), (1, 2, "env-secret"));
        assert_eq!(cluster.listen, "0.0.0.0:35672".parse::<SocketAddr>().expect("addr"));

        let args = ServerArgs {
            node_id: Some(3),
            peers: Some(vec!["3=127.0.0.1:45674".into(), "4=127.0.0.1:45675".into()]),
            cluster_secret: Some("flag-secret".into()),
            cluster_addr: Some("127.0.0.1:45674".into()),
            ..args_with_file(&f)
        };
        let cluster = Config::load_from(&args, &env).expect("load").cluster().expect("clustered");
        assert_eq!((cluster.node_id, cluster.secret.as_str()), (3, "flag-secret"));
        assert_eq!(cluster.peers, vec![(3, "127.0.0.1:45674".into()), (4, "127.0.0.1:45675".into())]);
    }

    #[test]
    fn cluster_flags_parse_with_clap() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ServerArgs,
        }
        let cli = Cli::try_parse_from([
            "warren", "--node-id", "2", "--cluster-addr", "127.0.0.1:2", "--peers", "1=h:1,2=127.0.0.1:2",
            "--cluster-secret", "xyzxyzxyz",
        ])
        .expect("flags parse");
        assert_eq!(cli.args.node_id, Some(2));
        assert_eq!(cli.args.peers, Some(vec!["1=h:1".to_owned(), "2=127.0.0.1:2".to_owned()]));
        assert_eq!(cli.args.cluster_addr.as_deref(), Some("127.0.0.1:2"));
        assert_eq!(cli.args.cluster_secret.as_deref(), Some("xyzxyzxyz"));
    }

    #[test]
    fn cluster_settings_are_checked() {
        let invalid = |change: fn(&mut Config)| {
            let mut c = Config {
                node_id: 1,
                peers: vec!["1=127.0.0.1:25672".into(), "2=127.0.0.1:25673".into()],
                cluster_secret: "long-enough".into(),
                ..Config::default()
            };
            c.validate().expect("the base is valid");
            change(&mut c);
            c.validate().expect_err("should be invalid").to_string()
        };
        assert!(invalid(|c| c.node_id = 0).starts_with("invalid node-id: must be set"));
        assert!(invalid(|c| c.node_id = 5).starts_with("invalid node-id: 5 is not one of the ids in peers"));
        assert!(invalid(|c| c.peers.push("2=127.0.0.1:1".into())).contains("node id 2 is listed twice"));
        for bad in ["x=127.0.0.1:1", "0=127.0.0.1:1", "3=127.0.0.1", "3=:5", "3=h:0", "3"] {
            let c = Config {
                node_id: 1,
                peers: vec!["1=127.0.0.1:25672".into(), bad.into()],
                cluster_secret: "long-enough".into(),
                ..Config::default()
            };
            let msg = c.validate().expect_err(bad).to_string();
            assert!(msg.starts_with("invalid peers:") && msg.contains(bad), "{msg}");
        }
        assert!(invalid(|c| c.cluster_secret = "short".into()).starts_with("invalid cluster-secret:"));
        assert!(invalid(|c| c.cluster_addr = "nowhere".into()).starts_with("invalid cluster-addr:"));
        assert!(invalid(|c| c.cluster_addr = "127.0.0.1:5672".into()).contains("also the AMQP"));
        let msg = Config { node_id: 1, ..Config::default() }.validate().expect_err("no peers").to_string();
        assert!(msg.starts_with("invalid node-id: set without peers"), "{msg}");
        let err = Config::load_from(&ServerArgs::default(), &env_of(&[("WARREN_PEERS", "1=127.0.0.1:25672"), ("WARREN_NODE_ID", "1"), ("WARREN_CLUSTER_SECRET", "tiny")]))
            .expect_err("short secret")
            .to_string();
        assert!(err.starts_with("invalid cluster-secret (from WARREN_CLUSTER_SECRET):") && !err.contains("tiny"), "{err}");
    }

    #[test]
    fn env_var_names() {
        assert_eq!(env_var_name("amqp-port"), "WARREN_AMQP_PORT");
        assert_eq!(env_var_name("max-message-size"), "WARREN_MAX_MESSAGE_SIZE");
        assert_eq!(env_var_name("log"), "WARREN_LOG");
    }
}
