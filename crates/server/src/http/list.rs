//! What every list of the management API takes, as RabbitMQ's: `columns=a,b.c` (only those
//! fields), `sort=FIELD` and `sort_reverse=true`, and pagination (`page`, `page_size` up to 500,
//! `name` filtered as a substring, or a regular expression is refused), which wraps the items in
//! `{"items": [...], "page": ..., "page_count": ..., ...}`.

use std::collections::HashMap;

use axum::Json;
use serde_json::{json, Map, Value};

use super::error::{ApiError, ApiResult};

/// The largest page RabbitMQ serves.
const MAX_PAGE_SIZE: usize = 500;

/// Applies the query's sort, pagination and columns to `items`.
pub fn answer(mut items: Vec<Value>, query: &HashMap<String, String>) -> ApiResult<Json<Value>> {
    if let Some(key) = query.get("sort").filter(|k| !k.is_empty()) {
        items.sort_by(|a, b| compare(lookup(a, key), lookup(b, key)));
    }
    if query.get("sort_reverse").is_some_and(|v| v == "true") {
        items.reverse();
    }
    let columns: Option<Vec<&str>> = query.get("columns").map(|c| c.split(',').filter(|c| !c.is_empty()).collect());
    let project = |items: Vec<Value>| -> Vec<Value> {
        match &columns {
            Some(cols) => items.into_iter().map(|item| only_columns(&item, cols)).collect(),
            None => items,
        }
    };
    let Some(page) = query.get("page") else { return Ok(Json(Value::Array(project(items)))) };
    let page: usize = page.parse().ok().filter(|p| *p >= 1).ok_or_else(|| ApiError::bad_request(format!("page must be a number from 1, not \"{page}\"")))?;
    let page_size: usize = match query.get("page_size") {
        None => 100,
        Some(s) => s
            .parse()
            .ok()
            .filter(|n| (1..=MAX_PAGE_SIZE).contains(n))
            .ok_or_else(|| ApiError::bad_request(format!("page_size must be a number from 1 to {MAX_PAGE_SIZE}, not \"{s}\"")))?,
    };
    let total_count = items.len();
    if let Some(name) = query.get("name").filter(|n| !n.is_empty()) {
        if query.get("use_regex").is_some_and(|v| v == "true") {
            return Err(ApiError::bad_request("use_regex is not supported by Warren: filter by a substring of the name"));
        }
        items.retain(|i| i.get("name").and_then(Value::as_str).is_some_and(|n| n.contains(name.as_str())));
    }
    let filtered_count = items.len();
    let page_count = filtered_count.div_ceil(page_size).max(1);
    if page > page_count {
        return Err(ApiError::bad_request(format!("page {page} is past the last page ({page_count})")));
    }
    let page_items: Vec<Value> = items.into_iter().skip((page - 1) * page_size).take(page_size).collect();
    Ok(Json(json!({
        "filtered_count": filtered_count,
        "item_count": page_items.len(),
        "page": page,
        "page_count": page_count,
        "page_size": page_size,
        "total_count": total_count,
        "items": project(page_items),
    })))
}

/// The value at a dotted path (`message_stats.publish`).
fn lookup<'a>(item: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(item, |v, key| v.get(key))
}

fn compare(a: Option<&Value>, b: Option<&Value>) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    match (a, b) {
        (Some(Value::Number(x)), Some(Value::Number(y))) => x.as_f64().partial_cmp(&y.as_f64()).unwrap_or(Ordering::Equal),
        (Some(Value::String(x)), Some(Value::String(y))) => x.cmp(y),
        (Some(Value::Bool(x)), Some(Value::Bool(y))) => x.cmp(y),
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        _ => Ordering::Equal,
    }
}

/// `item` with only the fields at `columns` (dotted paths keep their nesting).
fn only_columns(item: &Value, columns: &[&str]) -> Value {
    let mut out = Map::new();
    for col in columns {
        if let Some(v) = lookup(item, col) {
            insert_path(&mut out, col, v.clone());
        }
    }
    Value::Object(out)
}

fn insert_path(out: &mut Map<String, Value>, path: &str, v: Value) {
    match path.split_once('.') {
        None => {
            out.insert(path.to_owned(), v);
        }
        Some((head, rest)) => {
            let inner = out.entry(head.to_owned()).or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(m) = inner {
                insert_path(m, rest, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn columns_sort_and_pages_as_rabbitmq() {
        let items = vec![json!({"name": "b", "messages": 2, "x": {"y": 1, "z": 2}}), json!({"name": "a", "messages": 5, "x": {"y": 3}})];
        let Json(v) = answer(items.clone(), &q(&[("sort", "messages"), ("sort_reverse", "true"), ("columns", "name,x.y")])).unwrap();
        assert_eq!(v, json!([{"name": "a", "x": {"y": 3}}, {"name": "b", "x": {"y": 1}}]));
        let Json(v) = answer(items.clone(), &q(&[("page", "2"), ("page_size", "1"), ("sort", "name")])).unwrap();
        assert_eq!(v["items"], json!([items[0]]));
        assert_eq!((v["page_count"].as_u64(), v["total_count"].as_u64()), (Some(2), Some(2)));
        assert!(answer(items.clone(), &q(&[("page", "3"), ("page_size", "1")])).is_err());
        assert!(answer(items.clone(), &q(&[("page", "0")])).is_err());
        assert!(answer(items.clone(), &q(&[("page", "1"), ("page_size", "100000")])).is_err());
        let Json(v) = answer(items, &q(&[("page", "1"), ("name", "a")])).unwrap();
        assert_eq!(v["filtered_count"], json!(1));
    }
}
