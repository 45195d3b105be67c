//! CMQ's topics on Warren's exchanges: a topic is a durable exchange, a subscription (protocol
//! `queue`) bindings from it to the endpoint queue, so filtering happens in the broker's routing and
//! an AMQP client can bind its own queues to a topic too.
//!
//! - `filterType` 1 (tags, CMQ's default): a headers exchange. A message's tags are headers
//!   `cmq-tag:TAG`; a subscription with `filterTag.n` is one binding with `x-match: any` over its
//!   tags (a message with any of them), one without tags `x-match: all` with none (every message).
//! - `filterType` 2 (routing keys): a topic exchange, one binding per `bindingKey.n` (`#` without
//!   any: every message); CMQ's binding keys are AMQP's topic patterns.
//!
//! A binding's `x-cmq-subscription` argument names its subscription.

use std::sync::Arc;

use serde_json::{json, Value};
use warren_broker::exchange::{Destination, ExchangeKind};
use warren_broker::vhost::ExchangeDeclare;
use warren_broker::Exchange;
use warren_protocol::field::{FieldTable, FieldValue};

use super::messages;
use super::queues::{self, check_cmq_name};
use super::{answer, code, CmqError, CmqResult, Request};
use crate::http::mgmt::queues::API_CONNECTION;

const SUBSCRIPTION_ARG: &str = "x-cmq-subscription";
const TAG_HEADER_PREFIX: &str = "cmq-tag:";
/// Tags or binding keys per message or subscription, at most (CMQ's limit).
const MAX_TAGS: usize = 5;

fn string(s: &str) -> FieldValue {
    FieldValue::LongString(s.as_bytes().to_vec().into())
}

fn find(request: &Request, name: &str) -> Result<Arc<Exchange>, CmqError> {
    request
        .vhost
        .exchange(name)
        .ok()
        .filter(|e| is_topic(e))
        .ok_or_else(|| CmqError::new(code::NOT_FOUND, format!("no topic '{name}' in vhost '{}'", request.vhost.name)))
}

/// Every exchange but the default and `amq.*` ones can be used as a topic.
fn is_topic(e: &Exchange) -> bool {
    !e.name.is_empty() && !e.name.starts_with("amq.")
}

fn filter_type(e: &Exchange) -> i64 {
    match e.kind {
        ExchangeKind::Topic | ExchangeKind::Direct => 2,
        _ => 1,
    }
}

pub fn create(request: &Request) -> CmqResult {
    let name = request.params.required("topicName")?;
    check_cmq_name("topicName", name)?;
    let kind = match request.params.int("filterType", 1, 1..=2)? {
        1 => "headers",
        _ => "topic",
    };
    let max_size = request.params.int("maxMsgSize", queues::MAX_MESSAGE_BYTES, 1024..=queues::MAX_MESSAGE_BYTES)?;
    if request.vhost.exchange(name).is_ok() {
        return Err(CmqError::new(code::ALREADY_EXISTS, format!("topic '{name}' already exists in vhost '{}'", request.vhost.name)));
    }
    let mut arguments = FieldTable::new();
    arguments.insert(queues::MAX_MSG_SIZE.into(), FieldValue::I64(max_size));
    request.vhost.exchange_declare(&ExchangeDeclare { name, kind, passive: false, durable: true, auto_delete: false, internal: false, arguments: &arguments })?;
    Ok(answer([("topicId", format!("topic-{name}").into())]))
}

pub fn list(request: &Request) -> CmqResult {
    let search = request.params.get("searchWord").unwrap_or("");
    let offset = request.params.int("offset", 0, 0..=i64::from(u32::MAX))? as usize;
    let limit = request.params.int("limit", 20, 1..=1000)? as usize;
    let mut names: Vec<String> = request.vhost.exchanges().into_iter().filter(|e| is_topic(e) && e.name.contains(search)).map(|e| e.name.clone()).collect();
    names.sort_unstable();
    let page: Vec<Value> = names.iter().skip(offset).take(limit).map(|n| json!({"topicId": format!("topic-{n}"), "topicName": n})).collect();
    Ok(answer([("totalCount", names.len().into()), ("topicList", page.into())]))
}

fn max_size(e: &Exchange) -> i64 {
    e.arguments.get(queues::MAX_MSG_SIZE).and_then(FieldValue::as_i64).unwrap_or(queues::MAX_MESSAGE_BYTES)
}

pub fn attributes(request: &Request) -> CmqResult {
    let e = find(request, request.params.required("topicName")?)?;
    Ok(answer([
        ("msgCount", 0.into()),
        ("maxMsgSize", max_size(&e).into()),
        // A topic keeps nothing itself: its messages are in the subscriptions' queues.
        ("msgRetentionSeconds", 0.into()),
        ("filterType", filter_type(&e).into()),
        ("exchangeType", e.type_name().into()),
    ]))
}

pub fn set_attributes(request: &Request) -> CmqResult {
    let e = find(request, request.params.required("topicName")?)?;
    let wanted = request.params.int("maxMsgSize", max_size(&e), 1024..=queues::MAX_MESSAGE_BYTES)?;
    if wanted != max_size(&e) {
        return Err(CmqError::invalid(format!(
            "Warren cannot change maxMsgSize of an existing topic (an exchange's arguments are fixed once declared): topic '{}' has {}",
            e.name,
            max_size(&e)
        )));
    }
    Ok(answer([]))
}

pub fn delete(request: &Request) -> CmqResult {
    let e = find(request, request.params.required("topicName")?)?;
    request.vhost.exchange_delete(&e.name, false)?;
    Ok(answer([]))
}

pub async fn publish(request: &Request, batch: bool) -> CmqResult {
    let e = find(request, request.params.required("topicName")?)?;
    let max = max_size(&e).min(request.ctx.config.max_message_size as i64) as usize;
    let bodies = messages::bodies(request, batch, max)?;
    let tags = request.params.numbered("msgTag", MAX_TAGS)?;
    let routing_key = request.params.get("routingKey").unwrap_or("");
    if routing_key.len() > 255 {
        return Err(CmqError::invalid(format!("routingKey is {} bytes long; at most 255", routing_key.len())));
    }
    messages::check_alarms(request)?;
    let headers = (!tags.is_empty()).then(|| {
        let mut h = FieldTable::new();
        for tag in &tags {
            h.insert(format!("{TAG_HEADER_PREFIX}{tag}"), string(""));
        }
        h
    });
    let cmq = &request.ctx.cmq;
    let ids: Vec<String> = bodies.iter().map(|_| cmq.message_id()).collect();
    let batch_of = bodies.iter().zip(&ids).map(|(body, id)| messages::message(&e.name, routing_key, body, id, headers.clone())).collect();
    let sent = cmq.confirms.publish(&request.vhost, &e.name, batch_of, messages::delay_ms(request)?)?;
    cmq.confirms.durable(request.ctx.broker.store(), &sent).await?;
    Ok(messages::sent_answer(ids, batch))
}

/// A subscription: its queue, binding keys and tags (from its bindings).
struct Subscription {
    name: String,
    queue: String,
    binding_keys: Vec<String>,
    tags: Vec<String>,
}

fn subscriptions_of(e: &Exchange) -> Vec<Subscription> {
    let mut out: Vec<Subscription> = Vec::new();
    for b in e.bindings() {
        let Destination::Queue(q) = &b.destination else { continue };
        let Some(name) = b.arguments.get(SUBSCRIPTION_ARG).and_then(FieldValue::as_str) else { continue };
        let tags = b.arguments.iter().filter_map(|(k, _)| k.strip_prefix(TAG_HEADER_PREFIX).map(str::to_owned));
        let at = match out.iter().position(|s| s.name == name) {
            Some(at) => at,
            None => {
                out.push(Subscription { name: name.to_owned(), queue: q.name.clone(), binding_keys: Vec::new(), tags: Vec::new() });
                out.len() - 1
            }
        };
        let s = &mut out[at];
        if e.kind == ExchangeKind::Topic || e.kind == ExchangeKind::Direct {
            s.binding_keys.push(b.routing_key.clone());
        }
        s.tags.extend(tags);
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

pub fn subscribe(request: &Request) -> CmqResult {
    let p = &request.params;
    let e = find(request, p.required("topicName")?)?;
    let name = p.required("subscriptionName")?;
    check_cmq_name("subscriptionName", name)?;
    match p.required("protocol")? {
        "queue" => {}
        other => return Err(CmqError::invalid(format!("protocol '{other}': Warren delivers a topic's messages to queues only (protocol=queue, endpoint a queue name)"))),
    }
    let endpoint = p.required("endpoint")?;
    queues::find(request, endpoint)?;
    let tags = p.numbered("filterTag", MAX_TAGS)?;
    let keys = p.numbered("bindingKey", MAX_TAGS)?;
    if subscriptions_of(&e).iter().any(|s| s.name == name) {
        return Err(CmqError::new(code::ALREADY_EXISTS, format!("subscription '{name}' of topic '{}' already exists", e.name)));
    }
    let mut arguments = FieldTable::new();
    arguments.insert(SUBSCRIPTION_ARG.into(), string(name));
    match e.kind {
        ExchangeKind::Topic | ExchangeKind::Direct => {
            let keys = if keys.is_empty() { vec![if e.kind == ExchangeKind::Topic { "#" } else { "" }] } else { keys };
            for key in keys {
                if key.len() > 255 {
                    return Err(CmqError::invalid(format!("bindingKey is {} bytes long; at most 255", key.len())));
                }
                request.vhost.queue_bind(endpoint, &e.name, key, &arguments, API_CONNECTION)?;
            }
        }
        _ => {
            arguments.insert("x-match".into(), string(if tags.is_empty() { "all" } else { "any" }));
            for tag in &tags {
                arguments.insert(format!("{TAG_HEADER_PREFIX}{tag}"), string(""));
            }
            request.vhost.queue_bind(endpoint, &e.name, "", &arguments, API_CONNECTION)?;
        }
    }
    Ok(answer([("subscriptionId", format!("subscription-{}-{name}", e.name).into())]))
}

pub fn unsubscribe(request: &Request) -> CmqResult {
    let e = find(request, request.params.required("topicName")?)?;
    let name = request.params.required("subscriptionName")?;
    let mut found = false;
    for b in e.bindings() {
        let Destination::Queue(q) = &b.destination else { continue };
        if b.arguments.get(SUBSCRIPTION_ARG).and_then(FieldValue::as_str) == Some(name) {
            found = true;
            // An unbind: write on the queue (read on the topic was checked before).
            request.check(crate::connection::access::Perm::Write, crate::connection::access::Resource::Queue, &q.name)?;
            request.vhost.queue_unbind(&q.name, &e.name, &b.routing_key, &b.arguments, API_CONNECTION)?;
        }
    }
    if !found {
        return Err(CmqError::new(code::NOT_FOUND, format!("no subscription '{name}' of topic '{}'", e.name)));
    }
    Ok(answer([]))
}

pub fn subscriptions(request: &Request) -> CmqResult {
    let e = find(request, request.params.required("topicName")?)?;
    let search = request.params.get("searchWord").unwrap_or("");
    let offset = request.params.int("offset", 0, 0..=i64::from(u32::MAX))? as usize;
    let limit = request.params.int("limit", 20, 1..=1000)? as usize;
    let all: Vec<Subscription> = subscriptions_of(&e).into_iter().filter(|s| s.name.contains(search)).collect();
    let page: Vec<Value> = all
        .iter()
        .skip(offset)
        .take(limit)
        .map(|s| json!({"subscriptionId": format!("subscription-{}-{}", e.name, s.name), "subscriptionName": s.name, "protocol": "queue", "endpoint": s.queue}))
        .collect();
    Ok(answer([("totalCount", all.len().into()), ("subscriptionList", page.into())]))
}

pub fn subscription_attributes(request: &Request) -> CmqResult {
    let e = find(request, request.params.required("topicName")?)?;
    let name = request.params.required("subscriptionName")?;
    let s = subscriptions_of(&e)
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| CmqError::new(code::NOT_FOUND, format!("no subscription '{name}' of topic '{}'", e.name)))?;
    let backlog = request.vhost.queue_any(&s.queue).map_or(0, |q| q.message_count());
    Ok(answer([
        ("topicOwner", request.user.name.clone().into()),
        ("msgCount", backlog.into()),
        ("protocol", "queue".into()),
        ("endpoint", s.queue.into()),
        ("notifyStrategy", "BACKOFF_RETRY".into()),
        ("notifyContentFormat", "SIMPLIFIED".into()),
        ("filterTags", s.tags.into()),
        ("bindingKey", s.binding_keys.into()),
    ]))
}
