//! AMQP field tables as the management API shows and takes them: plain JSON (`{"x-max-length": 10}`),
//! as RabbitMQ does, not the typed form the metadata log stores (`warren_broker::definitions`).

use bytes::Bytes;
use serde_json::{Map, Number, Value};
use warren_protocol::field::{FieldTable, FieldValue};

pub fn table_to_json(t: &FieldTable) -> Value {
    Value::Object(t.iter().map(|(k, v)| (k.clone(), value_to_json(v))).collect())
}

fn value_to_json(v: &FieldValue) -> Value {
    match v {
        FieldValue::Bool(b) => Value::Bool(*b),
        FieldValue::F32(n) => Number::from_f64(*n as f64).map_or(Value::Null, Value::Number),
        FieldValue::F64(n) => Number::from_f64(*n).map_or(Value::Null, Value::Number),
        FieldValue::U64(n) | FieldValue::Timestamp(n) => Value::from(*n),
        FieldValue::Decimal(d) => Number::from_f64(d.value as f64 / 10f64.powi(d.scale as i32)).map_or(Value::Null, Value::Number),
        FieldValue::LongString(b) | FieldValue::ByteArray(b) => Value::String(String::from_utf8_lossy(b).into_owned()),
        FieldValue::Array(items) => Value::Array(items.iter().map(value_to_json).collect()),
        FieldValue::Table(t) => table_to_json(t),
        FieldValue::Void => Value::Null,
        other => other.as_i64().map_or(Value::Null, Value::from),
    }
}

/// A JSON object as a field table: strings are long strings, integers signed 64-bit (as RabbitMQ
/// converts them), objects tables. Anything but an object (or null, an empty table) is refused.
pub fn table_from_json(v: &Value, what: &str) -> Result<FieldTable, String> {
    match v {
        Value::Null => Ok(FieldTable::new()),
        Value::Object(map) => Ok(table_from_map(map)),
        other => Err(format!("{what} must be a JSON object, not {other}")),
    }
}

fn table_from_map(map: &Map<String, Value>) -> FieldTable {
    FieldTable(map.iter().map(|(k, v)| (k.clone(), value_from_json(v))).collect())
}

fn value_from_json(v: &Value) -> FieldValue {
    match v {
        Value::Null => FieldValue::Void,
        Value::Bool(b) => FieldValue::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => FieldValue::I64(i),
            (None, Some(u), _) => FieldValue::U64(u),
            (_, _, f) => FieldValue::F64(f.unwrap_or(0.0)),
        },
        Value::String(s) => FieldValue::LongString(Bytes::copy_from_slice(s.as_bytes())),
        Value::Array(items) => FieldValue::Array(items.iter().map(value_from_json).collect()),
        Value::Object(map) => FieldValue::Table(table_from_map(map)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_objects_round_trip_through_field_tables() {
        let v = json!({"x-max-length": 10, "x-queue-type": "quorum", "x-flag": true, "nested": {"a": [1, "b", null]}, "f": 1.5});
        let t = table_from_json(&v, "arguments").unwrap();
        assert_eq!(t.get("x-max-length").and_then(|v| v.as_i64()), Some(10));
        assert_eq!(t.get("x-queue-type").and_then(|v| v.as_str()), Some("quorum"));
        assert_eq!(table_to_json(&t), v);
        assert!(table_from_json(&json!([1, 2]), "arguments").is_err());
        assert!(table_from_json(&json!("x"), "arguments").is_err());
        assert!(table_from_json(&Value::Null, "arguments").unwrap().is_empty());
    }
}
