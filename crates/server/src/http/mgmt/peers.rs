//! Cluster-wide answers: the connections, channels and consumers of every node, and every node's
//! own view of itself, from whichever node a client asks (RabbitMQ's management API answers so).
//! Each node answers for itself: the asked node sends the others a query (`Request::Management`
//! over the cluster transport, JSON both ways) and merges their parts with its own. A node that is
//! unreachable, or does not answer within `PEER_WAIT`, is left out, as RabbitMQ leaves out a down
//! node's connections. Closing a connection goes to the node that has it.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use warren_broker::queue::remote::wire::Request;

use crate::classic_home::ManagementService;
use crate::http::HttpContext;

/// How long an answer waits for the other nodes' parts.
const PEER_WAIT: Duration = Duration::from_secs(2);

/// What one node asks another about the other's own part.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "ask", rename_all = "snake_case")]
pub enum Query {
    Connections,
    Channels,
    Consumers,
    /// The node itself, as `/api/nodes` shows it.
    Node,
    /// How many connections and channels the node has (`/api/overview`'s totals).
    Totals,
    /// The node's listeners (`/api/overview` lists every node's).
    Listeners,
    /// Close connection `name` if it is on the asked node; the answer says whether it was.
    Close { name: String, reason: String },
    /// How many connections the node has to `vhost` (its `max-connections` counts every node's).
    VhostConnections { vhost: String },
}

/// This node's part: what it answers another node, and its own share of a merged answer.
fn part(ctx: &HttpContext, query: &Query) -> Value {
    match query {
        Query::Connections => Value::Array(super::connections::local_connections(ctx)),
        Query::Channels => Value::Array(super::connections::local_channels(ctx)),
        Query::Consumers => Value::Array(super::connections::local_consumers(ctx)),
        Query::Node => super::node::this_node(ctx),
        Query::Listeners => Value::Array(super::node::listeners(ctx)),
        Query::Totals => {
            let connections = ctx.connections.list();
            let channels: usize = connections.iter().map(|c| c.channels.lock().len()).sum();
            serde_json::json!({"connections": connections.len(), "channels": channels})
        }
        Query::Close { name, reason } => Value::Bool(super::connections::close_local(ctx, name, reason)),
        Query::VhostConnections { vhost } => ctx.connections.count_in(vhost).into(),
    }
}

/// What answers other nodes' queries (installed on `ClassicHome`). It holds the context weakly:
/// the cluster service outlives the HTTP server at shutdown.
pub fn service(ctx: &Arc<HttpContext>) -> ManagementService {
    let weak = Arc::downgrade(ctx);
    Arc::new(move |query: Bytes| {
        let weak = weak.clone();
        Box::pin(async move {
            let ctx = weak.upgrade().ok_or_else(|| "the management API is stopping".to_string())?;
            let query: Query = serde_json::from_slice(&query).map_err(|e| format!("a management query that does not parse: {e}"))?;
            serde_json::to_vec(&part(&ctx, &query)).map(Bytes::from).map_err(|e| e.to_string())
        })
    })
}

/// Every other node's answer to `query`, with its id, from those that answered in time.
async fn ask_peers(ctx: &HttpContext, query: &Query) -> Vec<(u64, Value)> {
    match &ctx.cluster {
        Some(cluster) => ask(cluster, query, PEER_WAIT, |m| m.reachable).await,
        None => Vec::new(),
    }
}

/// The answers to `query` of the other members `asked` picks that came within `wait`, with their ids.
async fn ask(
    cluster: &warren_cluster::ClusterNode,
    query: &Query,
    wait: Duration,
    asked: impl Fn(&warren_cluster::MemberStatus) -> bool,
) -> Vec<(u64, Value)> {
    let Ok(query) = serde_json::to_vec(query) else { return Vec::new() };
    let request = Request::Management { query: Bytes::from(query) }.encode();
    let status = cluster.local_status();
    let asks: Vec<_> = status
        .members
        .iter()
        .filter(|m| m.id != status.node_id && asked(m))
        .map(|m| {
            let (cluster, request, peer) = (cluster.clone(), request.clone(), m.id);
            tokio::spawn(async move { (peer, cluster.classic_request(peer, &request, wait).await) })
        })
        .collect();
    let mut answers = Vec::new();
    for ask in asks {
        match ask.await {
            Ok((peer, Ok(answer))) => match serde_json::from_slice(&answer) {
                Ok(value) => answers.push((peer, value)),
                Err(e) => tracing::debug!(peer, error = %e, "a node's management answer does not parse"),
            },
            Ok((peer, Err(e))) => tracing::debug!(peer, error = %e, "a node did not answer the management API"),
            Err(_) => {}
        }
    }
    answers
}

/// A list query answered cluster-wide: this node's items, then the others', in node order.
pub async fn everywhere(ctx: &HttpContext, query: Query) -> Vec<Value> {
    let mut items = match part(ctx, &query) {
        Value::Array(items) => items,
        _ => Vec::new(),
    };
    for (_, answer) in ask_peers(ctx, &query).await {
        if let Value::Array(theirs) = answer {
            items.extend(theirs);
        }
    }
    items
}

/// The other nodes' own views of themselves (`Query::Node`), by node id.
pub async fn other_nodes(ctx: &HttpContext) -> Vec<(u64, Value)> {
    ask_peers(ctx, &Query::Node).await.into_iter().filter(|(_, v)| v.is_object()).collect()
}

/// The connections and channels of every node that answered.
pub async fn totals(ctx: &HttpContext) -> (u64, u64) {
    let sum = |v: &Value| (v["connections"].as_u64().unwrap_or(0), v["channels"].as_u64().unwrap_or(0));
    let (mut connections, mut channels) = sum(&part(ctx, &Query::Totals));
    for (_, theirs) in ask_peers(ctx, &Query::Totals).await {
        let (c, ch) = sum(&theirs);
        connections += c;
        channels += ch;
    }
    (connections, channels)
}

/// Closes connection `name` on whichever other node has it; whether one did.
pub async fn close_elsewhere(ctx: &HttpContext, name: &str, reason: &str) -> bool {
    let query = Query::Close { name: name.to_owned(), reason: reason.to_owned() };
    ask_peers(ctx, &query).await.iter().any(|(_, closed)| *closed == Value::Bool(true))
}

/// How many connections to `vhost` the other nodes have, as those that answer within `wait` say.
/// Every member not known down is asked (one just started, not yet heard from, has connections
/// too); a node that does not answer is not counted, as RabbitMQ counts the nodes it reaches.
pub async fn vhost_connections_elsewhere(cluster: &warren_cluster::ClusterNode, vhost: &str, wait: Duration) -> u64 {
    let query = Query::VhostConnections { vhost: vhost.to_owned() };
    ask(cluster, &query, wait, |m| !cluster.is_known_down(m.id)).await.iter().map(|(_, n)| n.as_u64().unwrap_or(0)).sum()
}
