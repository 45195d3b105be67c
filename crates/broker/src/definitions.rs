//! The durable topology's records (exchanges, queues, bindings), rebuilding a vhost from them,
//! and the field-table JSON they are stored in.
//!
//! They are kept in the metadata log (`crate::metadata`). Versions before it wrote them whole to
//! `definitions.json` on every change; [`load_legacy`] reads that file once, to import it.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use warren_protocol::field::{Decimal, FieldTable, FieldValue};

/// The file earlier versions kept the topology in.
pub const FILE_NAME: &str = "definitions.json";

#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct VHostDefs {
    pub exchanges: Vec<ExchangeDef>,
    pub queues: Vec<QueueDef>,
    pub bindings: Vec<BindingDef>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExchangeDef {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueDef {
    pub name: String,
    /// The id the store tags this queue's messages with.
    pub id: u64,
    pub auto_delete: bool,
    pub arguments: Value,
    /// In a cluster, the node a durable classic queue lives on (the declaring client's node);
    /// absent standalone, for quorum queues, and in definitions from before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home: Option<u64>,
    /// In a cluster, the nodes of a quorum queue's Raft group, chosen once by the declaring node
    /// from its peers, so that every node (one added later, or started with other `--peers`)
    /// agrees on them; absent standalone, for classic queues, and in definitions from before it was
    /// recorded (then each node computes them from its peers, as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub members: Option<Vec<u64>>,
    /// In a cluster, the member that first leads a quorum queue's group, and that the leadership is
    /// handed back to when it returns: the declaring node, under RabbitMQ's `client-local` leader
    /// locator (the default). Absent under `balanced`, standalone, and in definitions from before it
    /// was recorded (then the members take turns by queue id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<u64>,
    /// The members were changed since the declaration (`warren ctl remove-node`, `grow`): the group
    /// runs already, so a member that starts with no state of it joins it, never initializes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub members_changed: bool,
    /// In a cluster, a transient (non-durable or exclusive) classic queue: recorded in the
    /// metadata group like a durable one, so that every node routes to it and refuses a second
    /// exclusive declaration, but it lives only as long as the run of its home node that declared
    /// it (`home` deletes it when it starts again). Absent for durable queues and standalone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transient: Option<TransientDef>,
}

/// What a transient queue of a cluster lives and dies with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransientDef {
    /// The run of the home node's process that declared it (`crate::run_id`).
    pub run: u64,
    /// An exclusive queue's owner: a connection of that run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclusive: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BindingDef {
    pub source: String,
    pub destination: String,
    /// "queue" or "exchange".
    pub destination_type: String,
    pub routing_key: String,
    pub arguments: Value,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct LegacyFile {
    version: u32,
    next_queue_id: u64,
    vhosts: BTreeMap<String, VHostDefs>,
}

/// Reads a `definitions.json`: (next queue id, each vhost's topology).
pub fn load_legacy(path: &Path) -> std::io::Result<(u64, BTreeMap<String, VHostDefs>)> {
    let bytes = fs::read(path)?;
    let file = serde_json::from_slice::<LegacyFile>(&bytes).map_err(|e| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{} is not a valid definitions file: {e}", path.display()))
    })?;
    Ok((file.next_queue_id.max(1), file.vhosts))
}

// Field tables are stored with their AMQP types, so a restored argument is exactly what was declared.

pub fn table_to_json(t: &FieldTable) -> Value {
    Value::Array(t.iter().map(|(k, v)| json!([k, value_to_json(v)])).collect())
}

fn value_to_json(v: &FieldValue) -> Value {
    match v {
        FieldValue::Bool(b) => json!({"t": "bool", "v": b}),
        FieldValue::I8(n) => json!({"t": "i8", "v": n}),
        FieldValue::U8(n) => json!({"t": "u8", "v": n}),
        FieldValue::I16(n) => json!({"t": "i16", "v": n}),
        FieldValue::U16(n) => json!({"t": "u16", "v": n}),
        FieldValue::I32(n) => json!({"t": "i32", "v": n}),
        FieldValue::U32(n) => json!({"t": "u32", "v": n}),
        FieldValue::I64(n) => json!({"t": "i64", "v": n}),
        FieldValue::U64(n) => json!({"t": "u64", "v": n}),
        FieldValue::F32(n) => json!({"t": "f32", "v": n}),
        FieldValue::F64(n) => json!({"t": "f64", "v": n}),
        FieldValue::Decimal(d) => json!({"t": "decimal", "scale": d.scale, "v": d.value}),
        FieldValue::LongString(b) => json!({"t": "str", "v": bytes_to_json(b)}),
        FieldValue::ByteArray(b) => json!({"t": "bytes", "v": bytes_to_json(b)}),
        FieldValue::Array(items) => json!({"t": "array", "v": items.iter().map(value_to_json).collect::<Vec<_>>()}),
        FieldValue::Timestamp(n) => json!({"t": "timestamp", "v": n}),
        FieldValue::Table(t) => json!({"t": "table", "v": table_to_json(t)}),
        FieldValue::Void => json!({"t": "void"}),
    }
}

/// UTF-8 text stays readable; anything else is kept as a list of byte values.
fn bytes_to_json(b: &Bytes) -> Value {
    match std::str::from_utf8(b) {
        Ok(s) => Value::String(s.to_string()),
        Err(_) => Value::Array(b.iter().map(|x| json!(x)).collect()),
    }
}

fn bytes_from_json(v: &Value) -> Bytes {
    match v {
        Value::String(s) => Bytes::copy_from_slice(s.as_bytes()),
        Value::Array(items) => items.iter().filter_map(|x| x.as_u64().map(|n| n as u8)).collect::<Vec<u8>>().into(),
        _ => Bytes::new(),
    }
}

impl QueueDef {
    /// The last store queue id this queue uses: a priority queue has one per level after its own id
    /// (see `lane`).
    pub fn last_store_id(&self) -> u64 {
        let max_priority = table_from_json(&self.arguments).get("x-max-priority").and_then(|v| v.as_i64()).unwrap_or(0);
        self.id.saturating_add(max_priority.clamp(0, 255) as u64)
    }
}

pub fn table_from_json(v: &Value) -> FieldTable {
    let mut t = FieldTable::new();
    if let Value::Array(pairs) = v {
        for pair in pairs {
            if let (Some(k), Some(val)) = (pair.get(0).and_then(Value::as_str), pair.get(1)) {
                if let Some(fv) = value_from_json(val) {
                    t.0.push((k.to_string(), fv));
                }
            }
        }
    }
    t
}

fn value_from_json(v: &Value) -> Option<FieldValue> {
    let t = v.get("t")?.as_str()?;
    let val = v.get("v");
    let int = || val.and_then(Value::as_i64);
    let uint = || val.and_then(Value::as_u64);
    Some(match t {
        "bool" => FieldValue::Bool(val?.as_bool()?),
        "i8" => FieldValue::I8(int()? as i8),
        "u8" => FieldValue::U8(uint()? as u8),
        "i16" => FieldValue::I16(int()? as i16),
        "u16" => FieldValue::U16(uint()? as u16),
        "i32" => FieldValue::I32(int()? as i32),
        "u32" => FieldValue::U32(uint()? as u32),
        "i64" => FieldValue::I64(int()?),
        "u64" => FieldValue::U64(uint()?),
        "f32" => FieldValue::F32(val?.as_f64()? as f32),
        "f64" => FieldValue::F64(val?.as_f64()?),
        "decimal" => FieldValue::Decimal(Decimal { scale: v.get("scale")?.as_u64()? as u8, value: uint()? as u32 }),
        "str" => FieldValue::LongString(bytes_from_json(val?)),
        "bytes" => FieldValue::ByteArray(bytes_from_json(val?)),
        "array" => FieldValue::Array(val?.as_array()?.iter().filter_map(value_from_json).collect()),
        "timestamp" => FieldValue::Timestamp(uint()?),
        "table" => FieldValue::Table(table_from_json(val?)),
        "void" => FieldValue::Void,
        _ => return None,
    })
}
