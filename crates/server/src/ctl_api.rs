//! `warren ctl` over the management HTTP API, as `rabbitmqadmin` works: list, declare, delete and
//! purge queues, exchanges and bindings, close connections, export and import definitions, publish
//! and get. Tables by default, the API's JSON with `--json`.
//!
//! The node is `--url` (default: this configuration's management port on its `bind` address, or
//! 127.0.0.1), the user `--user`/`--password` (`WARREN_CTL_USER`/`WARREN_CTL_PASSWORD`, default
//! guest/guest, which the node accepts from loopback only).

use std::time::Duration;

use bytes::Bytes;
use clap::{Args, Subcommand, ValueEnum};
use http_body_util::{BodyExt, Full};
use hyper::header;
use serde_json::{json, Value};

use crate::config::Config;

/// The commands that go through the management API.
#[derive(Subcommand, Debug)]
pub enum ApiCommand {
    /// The node's totals: messages, queues, connections, rates
    Overview,
    /// Lists objects of a kind, in the --vhost or (with --all-vhosts) every vhost
    List {
        what: Listed,
        /// Every vhost, not only --vhost
        #[arg(long)]
        all_vhosts: bool,
    },
    /// Declares a queue, an exchange or a binding
    #[command(subcommand)]
    Declare(Declare),
    /// Deletes a queue, an exchange or a binding
    #[command(subcommand)]
    Delete(Delete),
    /// Removes every ready message of a queue
    Purge {
        /// The queue
        queue: String,
    },
    /// Makes the consumed messages a queue keeps (x-retention-seconds) ready again from a point in time
    Rewind {
        /// The queue
        queue: String,
        /// Unix milliseconds, an RFC 3339 time (2026-11-29T10:00:00Z) or a time ago (-90m, -2h, -1d)
        #[arg(long, allow_hyphen_values = true)]
        to: String,
    },
    /// Closes a client connection (its client gets connection.close 320 with the reason)
    CloseConnection {
        /// The connection's name, as `list connections` shows it
        name: String,
        #[arg(long, default_value = "Closed by warren ctl")]
        reason: String,
    },
    /// Writes every definition (vhosts, users, queues, exchanges, bindings) as JSON, RabbitMQ's format
    Export {
        /// The file to write; - for standard output
        file: String,
    },
    /// Declares the definitions of a JSON file (RabbitMQ's format); checked whole before anything changes
    Import {
        /// The file to read; - for standard input
        file: String,
    },
    /// Publishes a message (persistent unless --transient) and says whether a queue took it
    Publish {
        /// The exchange ("" or amq.default: the default exchange, which routes by queue name)
        #[arg(long, default_value = "amq.default")]
        exchange: String,
        #[arg(long, default_value = "")]
        routing_key: String,
        /// The body; standard input without it
        #[arg(long)]
        payload: Option<String>,
        #[arg(long)]
        transient: bool,
    },
    /// Creates a user (rabbitmqctl add_user); its password is hashed by the node
    AddUser {
        name: String,
        /// Omitted: read from the first line of standard input, as rabbitmqctl (a password given
        /// here is visible to other users in `ps`). Not `password`: that is the global --password
        /// this command logs in with.
        #[arg(value_name = "PASSWORD")]
        new_password: Option<String>,
        /// Comma-separated: administrator, monitoring, policymaker, management
        #[arg(long, default_value = "")]
        tags: String,
    },
    /// Deletes a user; its connections are closed on every node
    DeleteUser { name: String },
    /// Sets a user's password, keeping its tags
    ChangePassword {
        name: String,
        /// Omitted: read from the first line of standard input, as rabbitmqctl
        #[arg(value_name = "PASSWORD")]
        new_password: Option<String>,
    },
    /// Sets a user's tags, keeping its password (none: no tags)
    SetUserTags { name: String, tags: Vec<String> },
    /// Creates a vhost; the --user running this gets every permission on it
    AddVhost {
        name: String,
        #[arg(long, default_value = "")]
        description: String,
    },
    /// Deletes a vhost with everything in it (queues and their messages); its connections are closed
    DeleteVhost { name: String },
    /// Sets a user's permissions on --vhost: configure, write and read regular expressions
    SetPermissions {
        /// (Not `user`: that is the global --user this command logs in as.)
        #[arg(value_name = "USER")]
        username: String,
        configure: String,
        write: String,
        read: String,
    },
    /// Clears a user's permissions on --vhost; its connections to that vhost are closed
    ClearPermissions {
        #[arg(value_name = "USER")]
        username: String,
    },
    /// Takes messages off a queue: look (requeued) by default, --ackmode ack_requeue_false to remove them
    Get {
        queue: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value = "ack_requeue_true", value_parser = ["ack_requeue_true", "ack_requeue_false", "reject_requeue_true", "reject_requeue_false"])]
        ackmode: String,
    },
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listed {
    Queues,
    Exchanges,
    Bindings,
    Connections,
    Channels,
    Consumers,
    Nodes,
    Vhosts,
    Users,
    Permissions,
}

#[derive(Subcommand, Debug)]
pub enum Declare {
    /// A queue
    Queue {
        name: String,
        /// classic or quorum
        #[arg(long = "type", default_value = "classic", value_parser = ["classic", "quorum"])]
        kind: String,
        /// Not durable (a classic queue only)
        #[arg(long)]
        transient: bool,
        #[arg(long)]
        auto_delete: bool,
        /// An argument, KEY=VALUE; VALUE is read as JSON when it parses (x-max-length=1000), else as a string
        #[arg(long = "arg", value_name = "KEY=VALUE")]
        arguments: Vec<String>,
    },
    /// An exchange
    Exchange {
        name: String,
        /// direct, fanout, topic or headers
        #[arg(long = "type", default_value = "direct", value_parser = ["direct", "fanout", "topic", "headers"])]
        kind: String,
        #[arg(long)]
        transient: bool,
        #[arg(long)]
        auto_delete: bool,
        #[arg(long)]
        internal: bool,
        #[arg(long = "arg", value_name = "KEY=VALUE")]
        arguments: Vec<String>,
    },
    /// A binding from an exchange to a queue (or, with --to-exchange, to an exchange)
    Binding(Binding),
}

/// A binding, as `declare binding` and `delete binding` name it.
#[derive(Args, Debug)]
pub struct Binding {
    source: String,
    destination: String,
    #[arg(long, default_value = "")]
    routing_key: String,
    #[arg(long)]
    to_exchange: bool,
    #[arg(long = "arg", value_name = "KEY=VALUE")]
    arguments: Vec<String>,
}

impl Binding {
    /// `/api/bindings/{vhost}/e/{source}/{q or e}/{destination}`.
    fn path(&self, vhost: &str) -> String {
        let kind = if self.to_exchange { "e" } else { "q" };
        format!("/api/bindings/{vhost}/e/{}/{kind}/{}", seg(&self.source), seg(&self.destination))
    }
}

#[derive(Subcommand, Debug)]
pub enum Delete {
    /// A queue and its messages
    Queue {
        name: String,
        /// Only if it has no consumers
        #[arg(long)]
        if_unused: bool,
        /// Only if it has no messages
        #[arg(long)]
        if_empty: bool,
    },
    /// An exchange and its bindings
    Exchange {
        name: String,
        /// Only if nothing is bound to or from it
        #[arg(long)]
        if_unused: bool,
    },
    /// The binding from SOURCE to DESTINATION with this routing key (and these arguments)
    Binding(Binding),
}

/// Where and as whom the API is asked.
pub struct Target {
    /// `http://HOST:PORT`, no trailing slash.
    pub url: String,
    pub user: String,
    pub password: String,
    pub vhost: String,
    pub timeout: Duration,
    /// CA certificates (PEM) an `https://` URL's certificate must chain to.
    pub tls_ca: Option<std::path::PathBuf>,
}

impl Target {
    /// From the command line, or the node's configuration: its management port on its address.
    pub fn new(url: Option<&str>, config: &Config, user: String, password: String, vhost: String, timeout: Duration) -> Target {
        let url = match url {
            Some(u) => u.trim_end_matches('/').to_owned(),
            None => {
                let host = if config.bind.is_unspecified() { "127.0.0.1".to_owned() } else { config.bind.to_string() };
                let host = if host.contains(':') { format!("[{host}]") } else { host };
                format!("http://{host}:{}", config.http_port)
            }
        };
        let tls_ca = (!config.tls_ca.is_empty()).then(|| std::path::PathBuf::from(&config.tls_ca));
        Target { url, user, password, vhost, timeout, tls_ca }
    }
}

/// Runs `command`; the text to print.
pub fn run(command: &ApiCommand, target: &Target, as_json: bool) -> Result<String, String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    runtime.block_on(async {
        match tokio::time::timeout(target.timeout, execute(command, target, as_json)).await {
            Ok(result) => result,
            Err(_) => Err(format!("{} did not answer within {} s", target.url, target.timeout.as_secs())),
        }
    })
}

fn seg(s: &str) -> String {
    // Path segments are percent-encoded whole: "/" (the default vhost) becomes %2F, as the API wants.
    form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>().replace('+', "%20")
}

async fn execute(command: &ApiCommand, t: &Target, as_json: bool) -> Result<String, String> {
    let vh = seg(&t.vhost);
    match command {
        ApiCommand::Overview => {
            let o = request(t, "GET", "/api/overview", None).await?;
            if as_json {
                return pretty(&o);
            }
            let totals = &o["queue_totals"];
            let objects = &o["object_totals"];
            let rate = |key: &str| o["message_stats"][format!("{key}_details")]["rate"].as_f64().unwrap_or(0.0);
            Ok(format!(
                "{} {} on {}\nmessages: {} ready, {} unacked\nqueues {}, exchanges {}, connections {}, channels {}, consumers {}\nrates: publish {:.1}/s, deliver/get {:.1}/s, ack {:.1}/s",
                text(&o["product_name"]), text(&o["product_version"]), text(&o["node"]),
                text(&totals["messages_ready"]), text(&totals["messages_unacknowledged"]),
                text(&objects["queues"]), text(&objects["exchanges"]), text(&objects["connections"]), text(&objects["channels"]), text(&objects["consumers"]),
                rate("publish"), rate("deliver_get"), rate("ack"),
            ))
        }
        ApiCommand::List { what, all_vhosts } => {
            let scoped = |kind: &str| if *all_vhosts { format!("/api/{kind}") } else { format!("/api/{kind}/{vh}") };
            let path = match what {
                Listed::Queues => scoped("queues"),
                Listed::Exchanges => scoped("exchanges"),
                Listed::Bindings => scoped("bindings"),
                Listed::Consumers => scoped("consumers"),
                Listed::Connections if !*all_vhosts => format!("/api/vhosts/{vh}/connections"),
                Listed::Channels if !*all_vhosts => format!("/api/vhosts/{vh}/channels"),
                Listed::Connections => "/api/connections".into(),
                Listed::Channels => "/api/channels".into(),
                Listed::Nodes => "/api/nodes".into(),
                Listed::Vhosts => "/api/vhosts".into(),
                Listed::Users => "/api/users".into(),
                Listed::Permissions if !*all_vhosts => format!("/api/vhosts/{vh}/permissions"),
                Listed::Permissions => "/api/permissions".into(),
            };
            let items = request(t, "GET", &path, None).await?;
            if as_json {
                return pretty(&items);
            }
            Ok(table(columns(*what), items.as_array().map(Vec::as_slice).unwrap_or(&[])))
        }
        ApiCommand::Declare(Declare::Queue { name, kind, transient, auto_delete, arguments }) => {
            let mut args = parse_arguments(arguments)?;
            args["x-queue-type"] = kind.as_str().into();
            let body = json!({"durable": !*transient || kind == "quorum", "auto_delete": auto_delete, "arguments": args});
            request(t, "PUT", &format!("/api/queues/{vh}/{}", seg(name)), Some(body)).await?;
            Ok(format!("queue declared: {name}"))
        }
        ApiCommand::Declare(Declare::Exchange { name, kind, transient, auto_delete, internal, arguments }) => {
            let body = json!({"type": kind, "durable": !*transient, "auto_delete": auto_delete, "internal": internal, "arguments": parse_arguments(arguments)?});
            request(t, "PUT", &format!("/api/exchanges/{vh}/{}", seg(name)), Some(body)).await?;
            Ok(format!("exchange declared: {name}"))
        }
        ApiCommand::Declare(Declare::Binding(b)) => {
            let body = json!({"routing_key": b.routing_key, "arguments": parse_arguments(&b.arguments)?});
            request(t, "POST", &b.path(&vh), Some(body)).await?;
            Ok(format!("binding declared: {} -> {} ({:?})", b.source, b.destination, b.routing_key))
        }
        ApiCommand::Delete(Delete::Queue { name, if_unused, if_empty }) => {
            let mut path = format!("/api/queues/{vh}/{}", seg(name));
            let conditions: Vec<&str> = [(*if_unused, "if-unused=true"), (*if_empty, "if-empty=true")].iter().filter(|c| c.0).map(|c| c.1).collect();
            if !conditions.is_empty() {
                path = format!("{path}?{}", conditions.join("&"));
            }
            request(t, "DELETE", &path, None).await?;
            Ok(format!("queue deleted: {name}"))
        }
        ApiCommand::Delete(Delete::Exchange { name, if_unused }) => {
            let path = format!("/api/exchanges/{vh}/{}{}", seg(name), if *if_unused { "?if-unused=true" } else { "" });
            request(t, "DELETE", &path, None).await?;
            Ok(format!("exchange deleted: {name}"))
        }
        ApiCommand::Delete(Delete::Binding(b)) => {
            // A binding's path ends with its properties_key: found among those between the two.
            let between = b.path(&vh);
            let wanted = parse_arguments(&b.arguments)?;
            let existing = request(t, "GET", &between, None).await?;
            let found = existing.as_array().and_then(|a| a.iter().find(|x| x["routing_key"] == b.routing_key.as_str() && x["arguments"] == wanted));
            let Some(key) = found.and_then(|x| x["properties_key"].as_str()) else {
                return Err(format!(
                    "no binding from '{}' to '{}' with routing key {:?} and these arguments in vhost '{}'",
                    b.source, b.destination, b.routing_key, t.vhost
                ));
            };
            request(t, "DELETE", &format!("{between}/{}", seg(key)), None).await?;
            Ok(format!("binding deleted: {} -> {} ({:?})", b.source, b.destination, b.routing_key))
        }
        ApiCommand::Purge { queue } => {
            request(t, "DELETE", &format!("/api/queues/{vh}/{}/contents", seg(queue)), None).await?;
            Ok(format!("queue purged: {queue}"))
        }
        ApiCommand::Rewind { queue, to } => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
            let to_ms = crate::time_point::parse(to, now)?;
            let answer = request(t, "POST", &format!("/api/queues/{vh}/{}/rewind", seg(queue)), Some(json!({"to": to_ms}))).await?;
            if as_json {
                return pretty(&answer);
            }
            let rewound = answer["rewound"].as_u64().unwrap_or(0);
            let messages = if rewound == 1 { "1 message".to_owned() } else { format!("{rewound} messages") };
            Ok(match answer["from"].as_u64() {
                Some(from) if answer["clamped"] == true => format!(
                    "queue rewound: {queue}, {messages} ready again from {} (the oldest it keeps; {} was asked)",
                    rfc3339(from),
                    rfc3339(to_ms)
                ),
                Some(from) => format!("queue rewound: {queue}, {messages} ready again from {}", rfc3339(from)),
                None => format!("queue rewound: {queue}, nothing kept from {} on", rfc3339(to_ms)),
            })
        }
        ApiCommand::CloseConnection { name, reason } => {
            request_with(t, "DELETE", &format!("/api/connections/{}", seg(name)), None, &[("x-reason", reason)]).await?;
            Ok(format!("connection closed: {name}"))
        }
        ApiCommand::Export { file } => {
            let definitions = request(t, "GET", "/api/definitions", None).await?;
            let text = serde_json::to_string_pretty(&definitions).map_err(|e| e.to_string())?;
            if file == "-" {
                return Ok(text);
            }
            std::fs::write(file, text + "\n").map_err(|e| format!("cannot write {file}: {e}"))?;
            Ok(format!("definitions exported to {file}"))
        }
        ApiCommand::Import { file } => {
            let text = if file == "-" {
                std::io::read_to_string(std::io::stdin()).map_err(|e| format!("cannot read standard input: {e}"))?
            } else {
                std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?
            };
            let definitions: Value = serde_json::from_str(&text).map_err(|e| format!("{file} is not JSON: {e}"))?;
            request(t, "POST", "/api/definitions", Some(definitions)).await?;
            Ok(format!("definitions imported from {file}"))
        }
        ApiCommand::Publish { exchange, routing_key, payload, transient } => {
            let payload = match payload {
                Some(p) => p.clone(),
                None => std::io::read_to_string(std::io::stdin()).map_err(|e| format!("cannot read standard input: {e}"))?,
            };
            let exchange = if exchange.is_empty() { "amq.default" } else { exchange };
            let body = json!({"routing_key": routing_key, "payload": payload, "payload_encoding": "string",
                              "properties": {"delivery_mode": if *transient { 1 } else { 2 }}});
            let answer = request(t, "POST", &format!("/api/exchanges/{vh}/{}/publish", seg(exchange)), Some(body)).await?;
            if as_json {
                return pretty(&answer);
            }
            Ok(if answer["routed"] == true { "message published".into() } else { "message published but not routed: no queue took it".into() })
        }
        ApiCommand::AddUser { name, new_password, tags } => {
            let password = password_or_stdin(new_password.as_deref())?;
            if get_optional(t, &format!("/api/users/{}", seg(name))).await?.is_some() {
                return Err(format!("user '{name}' already exists (change-password or set-user-tags change it)"));
            }
            request(t, "PUT", &format!("/api/users/{}", seg(name)), Some(json!({"password": password, "tags": tags}))).await?;
            Ok(format!("user added: {name}"))
        }
        ApiCommand::DeleteUser { name } => {
            request(t, "DELETE", &format!("/api/users/{}", seg(name)), None).await?;
            Ok(format!("user deleted: {name}"))
        }
        ApiCommand::ChangePassword { name, new_password } => {
            let password = password_or_stdin(new_password.as_deref())?;
            let user = request(t, "GET", &format!("/api/users/{}", seg(name)), None).await?;
            request(t, "PUT", &format!("/api/users/{}", seg(name)), Some(json!({"password": password, "tags": user["tags"]}))).await?;
            Ok(format!("password changed: {name}"))
        }
        ApiCommand::SetUserTags { name, tags } => {
            let user = request(t, "GET", &format!("/api/users/{}", seg(name)), None).await?;
            let body = json!({"password_hash": user["password_hash"], "hashing_algorithm": user["hashing_algorithm"], "tags": tags});
            request(t, "PUT", &format!("/api/users/{}", seg(name)), Some(body)).await?;
            Ok(format!("tags set: {name} [{}]", tags.join(", ")))
        }
        ApiCommand::AddVhost { name, description } => {
            if get_optional(t, &format!("/api/vhosts/{}", seg(name))).await?.is_some() {
                return Err(format!("vhost '{name}' already exists"));
            }
            request(t, "PUT", &format!("/api/vhosts/{}", seg(name)), Some(json!({"description": description}))).await?;
            Ok(format!("vhost added: {name}"))
        }
        ApiCommand::DeleteVhost { name } => {
            request(t, "DELETE", &format!("/api/vhosts/{}", seg(name)), None).await?;
            Ok(format!("vhost deleted: {name}"))
        }
        ApiCommand::SetPermissions { username: user, configure, write, read } => {
            let body = json!({"configure": configure, "write": write, "read": read});
            request(t, "PUT", &format!("/api/permissions/{vh}/{}", seg(user)), Some(body)).await?;
            Ok(format!("permissions set: {user} on vhost {}", t.vhost))
        }
        ApiCommand::ClearPermissions { username: user } => {
            request(t, "DELETE", &format!("/api/permissions/{vh}/{}", seg(user)), None).await?;
            Ok(format!("permissions cleared: {user} on vhost {}", t.vhost))
        }
        ApiCommand::Get { queue, count, ackmode } => {
            let body = json!({"count": count, "ackmode": ackmode, "encoding": "auto"});
            let messages = request(t, "POST", &format!("/api/queues/{vh}/{}/get", seg(queue)), Some(body)).await?;
            if as_json {
                return pretty(&messages);
            }
            Ok(table(
                &[("routing_key", "/routing_key"), ("exchange", "/exchange"), ("redelivered", "/redelivered"), ("message_count", "/message_count"), ("payload", "/payload"), ("payload_encoding", "/payload_encoding")],
                messages.as_array().map(Vec::as_slice).unwrap_or(&[]),
            ))
        }
    }
}

/// The columns of a list's table: title and JSON pointer.
fn columns(what: Listed) -> &'static [(&'static str, &'static str)] {
    match what {
        Listed::Queues => &[("vhost", "/vhost"), ("name", "/name"), ("type", "/type"), ("node", "/node"), ("messages_ready", "/messages_ready"), ("messages_unacknowledged", "/messages_unacknowledged"), ("consumers", "/consumers")],
        Listed::Exchanges => &[("vhost", "/vhost"), ("name", "/name"), ("type", "/type"), ("durable", "/durable"), ("internal", "/internal")],
        Listed::Bindings => &[("vhost", "/vhost"), ("source", "/source"), ("destination", "/destination"), ("destination_type", "/destination_type"), ("routing_key", "/routing_key")],
        Listed::Connections => &[("name", "/name"), ("user", "/user"), ("vhost", "/vhost"), ("peer_host", "/peer_host"), ("peer_port", "/peer_port"), ("channels", "/channels")],
        Listed::Channels => &[("name", "/name"), ("user", "/user"), ("vhost", "/vhost"), ("state", "/state")],
        Listed::Consumers => &[("queue", "/queue/name"), ("consumer_tag", "/consumer_tag"), ("connection", "/channel_details/connection_name"), ("ack_required", "/ack_required"), ("prefetch_count", "/prefetch_count")],
        Listed::Nodes => &[("name", "/name"), ("running", "/running"), ("mem_used", "/mem_used"), ("mem_alarm", "/mem_alarm"), ("disk_free", "/disk_free"), ("disk_free_alarm", "/disk_free_alarm")],
        Listed::Vhosts => &[("name", "/name"), ("messages", "/messages")],
        Listed::Users => &[("name", "/name"), ("tags", "/tags")],
        Listed::Permissions => &[("user", "/user"), ("vhost", "/vhost"), ("configure", "/configure"), ("write", "/write"), ("read", "/read")],
    }
}

/// A value as a table cell: strings bare, nothing as empty, anything else as JSON.
fn text(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(items) => items.iter().map(text).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

/// Rows under a header, columns padded to their widest cell (control characters shown escaped, so a
/// name cannot move the terminal's cursor).
fn table(columns: &[(&str, &str)], rows: &[Value]) -> String {
    if rows.is_empty() {
        return "(none)".into();
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| columns.iter().map(|(_, pointer)| text(row.pointer(pointer).unwrap_or(&Value::Null)).escape_default().to_string()).collect())
        .collect();
    let widths: Vec<usize> =
        columns.iter().enumerate().map(|(i, (title, _))| cells.iter().map(|r| r[i].chars().count()).max().unwrap_or(0).max(title.len())).collect();
    let line = |values: Vec<&str>| {
        values.iter().zip(&widths).map(|(v, w)| format!("{v:<w$}")).collect::<Vec<_>>().join("  ").trim_end().to_owned()
    };
    let mut out = vec![line(columns.iter().map(|c| c.0).collect())];
    out.extend(cells.iter().map(|r| line(r.iter().map(String::as_str).collect())));
    out.join("\n")
}

/// `KEY=VALUE` arguments as a JSON object: VALUE as JSON when it parses, else as a string.
fn parse_arguments(arguments: &[String]) -> Result<Value, String> {
    let mut out = serde_json::Map::new();
    for a in arguments {
        let (key, value) = a.split_once('=').ok_or_else(|| format!("argument '{a}' is not KEY=VALUE"))?;
        out.insert(key.to_owned(), serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned())));
    }
    Ok(Value::Object(out))
}

fn pretty(v: &Value) -> Result<String, String> {
    serde_json::to_string_pretty(v).map_err(|e| e.to_string())
}

/// A GET that may find nothing: None for a 404.
async fn get_optional(t: &Target, path: &str) -> Result<Option<Value>, String> {
    match request(t, "GET", path, None).await {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.contains("(HTTP 404 to GET") => Ok(None),
        Err(e) => Err(e),
    }
}

/// A password given on the command line, or the first line of standard input (without its line
/// end), as rabbitmqctl reads one it was not given.
fn password_or_stdin(given: Option<&str>) -> Result<String, String> {
    if let Some(p) = given {
        return Ok(p.to_owned());
    }
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| format!("cannot read the password from standard input: {e}"))?;
    let password = line.strip_suffix('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)).unwrap_or(&line);
    if password.is_empty() {
        return Err("no password: give it after the user name or on the first line of standard input".into());
    }
    Ok(password.to_owned())
}

async fn request(t: &Target, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
    request_with(t, method, path, body, &[]).await
}

/// One request to the API; its JSON answer (null for an empty one), or the API's `reason` as the error.
async fn request_with(t: &Target, method: &str, path: &str, body: Option<Value>, extra: &[(&str, &str)]) -> Result<Value, String> {
    let (tls, authority) = match (t.url.strip_prefix("http://"), t.url.strip_prefix("https://")) {
        (Some(rest), _) => (false, rest),
        (_, Some(rest)) => (true, rest),
        _ => return Err(format!("--url must start with http:// or https:// (not {})", t.url)),
    };
    let authority = authority.split('/').next().unwrap_or(authority);
    let credentials = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, format!("{}:{}", t.user, t.password));
    let mut builder = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, authority)
        .header(header::AUTHORIZATION, format!("Basic {credentials}"))
        .header(header::CONTENT_TYPE, "application/json");
    for (name, value) in extra {
        builder = builder.header(*name, *value);
    }
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let request = builder.body(Full::new(Bytes::from(body))).map_err(|e| format!("cannot build the request: {e}"))?;
    let stream = tokio::net::TcpStream::connect(authority).await.map_err(|e| format!("cannot connect to {}: {e}", t.url))?;
    let response = match tls {
        false => send(stream, request, t).await?,
        true => send(tls_connect(stream, authority, t).await?, request, t).await?,
    };
    let status = response.status();
    let bytes = response.into_body().collect().await.map_err(|e| format!("{}: {e}", t.url))?.to_bytes();
    let answer: Value = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned())) };
    if status.is_success() {
        return Ok(answer);
    }
    let reason = answer.get("reason").map(text).unwrap_or_else(|| text(&answer));
    Err(match status.as_u16() {
        401 => format!("{} refused user '{}': {reason} (give --user and --password)", t.url, t.user),
        code => format!("{reason} (HTTP {code} to {method} {path})"),
    })
}

/// Sends one request over `stream` (plain or TLS).
async fn send<S>(stream: S, request: hyper::Request<Full<Bytes>>, t: &Target) -> Result<hyper::Response<hyper::body::Incoming>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.map_err(|e| format!("{}: {e}", t.url))?;
    tokio::spawn(connection);
    sender.send_request(request).await.map_err(|e| format!("{}: {e}", t.url))
}

/// TLS to an `https://` URL, its certificate checked against `--tls-ca` for the URL's host.
async fn tls_connect(
    stream: tokio::net::TcpStream,
    authority: &str,
    t: &Target,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let ca = t.tls_ca.as_ref().ok_or_else(|| format!("{}: give --tls-ca, the CA certificates (PEM) its certificate chains to", t.url))?;
    let config = warren_bench::tls::client_config(Some(ca)).map_err(|e| e.to_string())?;
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name = rustls_pki_types::ServerName::try_from(host.to_string()).map_err(|e| format!("{}: {e}", t.url))?;
    tokio_rustls::TlsConnector::from(config).connect(name, stream).await.map_err(|e| format!("{}: TLS: {e}", t.url))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_json_when_they_parse() {
        let args = parse_arguments(&["x-max-length=10".into(), "x-dead-letter-exchange=dlx".into(), "flag=true".into(), "e=".into()]).unwrap();
        assert_eq!(args, json!({"x-max-length": 10, "x-dead-letter-exchange": "dlx", "flag": true, "e": ""}));
        assert!(parse_arguments(&["novalue".into()]).is_err());
    }

    #[test]
    fn tables_pad_columns_and_escape_control_characters() {
        let rows = vec![json!({"name": "a", "n": 1}), json!({"name": "long\u{1b}[2J", "n": null})];
        let out = table(&[("name", "/name"), ("n", "/n")], &rows);
        assert_eq!(out, "name           n\na              1\nlong\\u{1b}[2J");
        assert_eq!(table(&[("name", "/name")], &[]), "(none)");
    }

    #[test]
    fn the_default_vhost_is_one_path_segment() {
        assert_eq!(seg("/"), "%2F");
        assert_eq!(seg("a b/c"), "a%20b%2Fc");
    }
}

/// Unix ms as an RFC 3339 time (UTC, milliseconds).
fn rfc3339(ms: u64) -> String {
    i64::try_from(ms)
        .ok()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .map_or_else(|| ms.to_string(), |t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}
