//! `warren ctl`: asks a running node about its cluster, or to change it, over the node's cluster
//! port (authenticated with the cluster secret, as `rabbitmqctl` is with the Erlang cookie); and,
//! like `rabbitmqadmin`, lists and changes queues, exchanges, bindings, connections and definitions
//! over the management HTTP API (`ctl_api`).
//!
//! The node and the secret are found the way `warren server` finds its own settings (flags,
//! `WARREN_*` variables, `--config FILE`): `--node HOST:PORT` if given, else the node's
//! `cluster-addr` (or its entry in `peers`), and `cluster-secret`.

use std::time::Duration;

use clap::{Args, Subcommand};
use warren_cluster::node::{AdminRequest, ClusterStatus};
use warren_bench::output;
use warren_cluster::transport::{ctl_request, Rpc};

use crate::config::{Config, ServerArgs};

#[derive(Args, Debug)]
pub struct CtlArgs {
    /// The node to ask, HOST:PORT of its cluster port [default: this configuration's cluster address]
    #[arg(long, value_name = "HOST:PORT", global = true)]
    pub node: Option<String>,

    /// Print JSON instead of tables
    #[arg(long, global = true)]
    pub json: bool,

    /// Seconds to wait for the answer
    #[arg(long, value_name = "S", default_value_t = 15, global = true)]
    pub timeout: u64,

    /// The management API to ask, http://HOST:PORT or https://HOST:PORT (with --tls-ca, the CA its
    /// certificate chains to) [default: this configuration's http-port on its bind address]
    #[arg(long, value_name = "URL", global = true)]
    pub url: Option<String>,

    /// The management API's user
    #[arg(long, env = "WARREN_CTL_USER", default_value = "guest", global = true)]
    pub user: String,

    /// Its password
    #[arg(long, env = "WARREN_CTL_PASSWORD", default_value = "guest", hide_env_values = true, global = true)]
    pub password: String,

    /// The vhost the command is about
    #[arg(long, default_value = "/", global = true)]
    pub vhost: String,

    #[command(flatten)]
    pub server: ServerArgs,

    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Subcommand, Debug)]
pub enum CtlCommand {
    /// Members and their reachability; each Raft group's leader, followers and replication lag
    ClusterStatus,
    /// Adds a node to the cluster's metadata group (it must be running with the same secret)
    AddNode {
        /// The new node's id
        id: u64,
        /// Its cluster address, HOST:PORT
        addr: String,
    },
    /// Removes a node from the cluster: each quorum queue with a member on it gets one on another
    /// node instead (where the cluster has one), then the node leaves every group
    RemoveNode {
        /// The node's id
        id: u64,
    },
    /// Adds a member on a node to every quorum queue that has none there (RabbitMQ's
    /// `rabbitmq-queues grow NODE all`), e.g. after `add-node`
    Grow {
        /// The node's id
        id: u64,
    },
    /// Hands the leadership of quorum queues back to their preferred nodes now, where a node leads
    /// more than its fair share (done automatically a few seconds after a node returns)
    Rebalance,
    /// Moves a group's leadership to a node
    TransferLeader {
        /// The group (0: the metadata group; a quorum queue's group is its queue id)
        group: u64,
        /// The node to lead it (not named `node`: that is the global --node, and clap panicked on the clash)
        #[arg(value_name = "NODE")]
        to: u64,
    },
    #[command(flatten)]
    Api(crate::ctl_api::ApiCommand),
}

pub fn run(args: CtlArgs) -> std::process::ExitCode {
    match run_inner(args) {
        // Not println!/eprintln!: they panic when the reader has gone (`warren ctl ... | head -1`).
        Ok(out) => match output::stdout(&format!("{out}\n")) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                output::stderr(format_args!("warren ctl: cannot write the answer: {e}\n"));
                std::process::ExitCode::FAILURE
            }
        },
        Err(e) => {
            output::stderr(format_args!("warren ctl: {e}\n"));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_inner(mut args: CtlArgs) -> Result<String, String> {
    // `--tls-ca` is, for ctl, the CA an https:// URL's certificate chains to (not the server's
    // client-certificate CA, which needs the server's own certificate beside it).
    let tls_ca = args.server.tls_ca.take();
    let config = Config::load(&args.server).map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs(args.timeout.max(1));
    let (rpc, payload) = match &args.command {
        CtlCommand::Api(command) => {
            let mut target = crate::ctl_api::Target::new(args.url.as_deref(), &config, args.user.clone(), args.password.clone(), args.vhost.clone(), timeout);
            if let Some(ca) = tls_ca {
                target.tls_ca = Some(ca.into());
            }
            return crate::ctl_api::run(command, &target, args.json);
        }
        CtlCommand::ClusterStatus => (Rpc::Status, Vec::new()),
        CtlCommand::AddNode { id, addr } => (Rpc::Admin, admin(AdminRequest::AddNode { node: *id, addr: addr.clone() })?),
        CtlCommand::RemoveNode { id } => (Rpc::Admin, admin(AdminRequest::RemoveNode { node: *id })?),
        CtlCommand::Grow { id } => (Rpc::Admin, admin(AdminRequest::Grow { node: *id })?),
        CtlCommand::Rebalance => (Rpc::Admin, admin(AdminRequest::Rebalance)?),
        CtlCommand::TransferLeader { group, to } => {
            (Rpc::Admin, admin(AdminRequest::TransferLeader { group: *group, node: *to })?)
        }
    };
    // The cluster commands: to the cluster port, with the cluster secret.
    let addr = match (&args.node, config.cluster()) {
        (Some(n), _) => n.clone(),
        (None, Some(c)) if c.listen.ip().is_unspecified() => format!("127.0.0.1:{}", c.listen.port()),
        (None, Some(c)) => c.listen.to_string(),
        (None, None) => return Err("no node to ask: give --node HOST:PORT, or the node's configuration (--config, --peers and --node-id)".into()),
    };
    if config.cluster_secret.is_empty() {
        return Err("no cluster secret: give --cluster-secret, WARREN_CLUSTER_SECRET or the node's configuration".into());
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let answer = runtime.block_on(ctl_request(&addr, config.cluster_secret.as_bytes(), rpc, 0, &payload, timeout))?;
    match args.command {
        CtlCommand::ClusterStatus => {
            let status: ClusterStatus = serde_json::from_slice(&answer).map_err(|e| format!("unexpected answer from {addr}: {e}"))?;
            if args.json {
                serde_json::to_string_pretty(&status).map_err(|e| e.to_string())
            } else {
                Ok(render(&status, &addr))
            }
        }
        _ => Ok(String::from_utf8_lossy(&answer).into_owned()),
    }
}

fn admin(req: AdminRequest) -> Result<Vec<u8>, String> {
    serde_json::to_vec(&req).map_err(|e| e.to_string())
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// The status as two tables: members, then groups.
pub fn render(s: &ClusterStatus, asked: &str) -> String {
    let mut out = format!("Cluster status from node {} ({asked})\n\nMembers\n", s.node_id);
    out.push_str(&format!("  {:<6} {:<24} {:<24} {:<10} {}\n", "node", "cluster address", "AMQP address", "reachable", "leads"));
    for m in &s.members {
        let amqp = if m.amqp_addr.is_empty() { "-" } else { &m.amqp_addr };
        let leads = s.groups.iter().filter(|g| g.leader == Some(m.id) && g.state == "leader").count();
        out.push_str(&format!(
            "  {:<6} {:<24} {:<24} {:<10} {}\n",
            m.id,
            m.cluster_addr,
            amqp,
            if m.reachable { "yes" } else { "no" },
            leads
        ));
    }
    out.push_str(&format!("\nGroups ({})\n", s.groups.len()));
    out.push_str(&format!(
        "  {:<8} {:<7} {:<6} {:<10} {:<10} {:<10} {}\n",
        "group", "leader", "term", "last log", "committed", "seen by", "followers (node: matched/lag)"
    ));
    for g in &s.groups {
        let followers = if g.followers.is_empty() {
            g.voters.iter().filter(|v| Some(**v) != g.leader).map(|v| format!("{v}: ?")).collect::<Vec<_>>().join(", ")
        } else {
            g.followers.iter().map(|f| format!("{}: {}/{}", f.id, opt(f.matched), opt(f.lag))).collect::<Vec<_>>().join(", ")
        };
        out.push_str(&format!(
            "  {:<8} {:<7} {:<6} {:<10} {:<10} {:<10} {}\n",
            g.group,
            opt(g.leader),
            g.term,
            opt(g.last_log_index),
            opt(g.committed),
            format!("{} ({})", g.seen_by, g.state),
            followers
        ));
    }
    out
}
