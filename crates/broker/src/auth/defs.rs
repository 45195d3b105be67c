//! Users, vhosts and permissions as the metadata log and the metadata group record them (the
//! fields of `metadata::Op`'s auth ops), in RabbitMQ's definitions vocabulary: a user's
//! `password_hash` is base64 and `hashing_algorithm` RabbitMQ's name, permissions are three
//! regular expressions (configure, write, read), as `rabbitmqctl export_definitions` writes them.
//! Checked when made ([`UserDef::check`], [`PermissionDef::check`]): what is recorded is valid.

use serde::{Deserialize, Serialize};

/// The tags RabbitMQ knows; others are kept (RabbitMQ keeps any tag) but grant nothing.
pub const ADMINISTRATOR: &str = "administrator";
pub const MANAGEMENT_TAGS: [&str; 4] = [ADMINISTRATOR, "monitoring", "policymaker", "management"];

/// Names of users, vhosts and exchanges: what AMQP's shortstr can carry.
pub const MAX_NAME_BYTES: usize = 255;

#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct UserDef {
    pub name: String,
    /// base64 of salt ‖ digest (`auth::password`); empty: no password login.
    pub password_hash: String,
    pub hashing_algorithm: String,
    #[serde(default)]
    pub tags: Vec<String>,
    /// RabbitMQ's user limits (`max-connections`, `max-channels`): kept and exported, not enforced.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub limits: serde_json::Value,
}

/// Shows no byte of the hash.
impl std::fmt::Debug for UserDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserDef").field("name", &self.name).field("hashing_algorithm", &self.hashing_algorithm).field("tags", &self.tags).finish_non_exhaustive()
    }
}

impl UserDef {
    pub fn check(&self) -> Result<(), String> {
        check_name("user", &self.name)?;
        super::PasswordHash::from_rabbitmq(&self.password_hash, &self.hashing_algorithm)?;
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VHostDef {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_queue_type: Option<String>,
}

impl VHostDef {
    pub fn named(name: &str) -> VHostDef {
        VHostDef { name: name.to_string(), description: String::new(), tags: Vec::new(), default_queue_type: None }
    }
}

/// A vhost's limits (`rabbitmqctl set_vhost_limits`); None: no limit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VHostLimits {
    #[serde(default, rename = "max-connections", skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<i64>,
    #[serde(default, rename = "max-queues", skip_serializing_if = "Option::is_none")]
    pub max_queues: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PermissionDef {
    pub user: String,
    pub vhost: String,
    pub configure: String,
    pub write: String,
    pub read: String,
}

impl PermissionDef {
    /// Full permissions, as the default user gets on its vhost.
    pub fn all(user: &str, vhost: &str) -> PermissionDef {
        PermissionDef { user: user.to_string(), vhost: vhost.to_string(), configure: ".*".into(), write: ".*".into(), read: ".*".into() }
    }

    pub fn check(&self) -> Result<(), String> {
        for (what, pattern) in [("configure", &self.configure), ("write", &self.write), ("read", &self.read)] {
            compile(what, pattern)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopicPermissionDef {
    pub user: String,
    pub vhost: String,
    pub exchange: String,
    pub write: String,
    pub read: String,
}

impl TopicPermissionDef {
    pub fn check(&self) -> Result<(), String> {
        check_name("exchange", &self.exchange)?;
        compile("write", &self.write)?;
        compile("read", &self.read)?;
        Ok(())
    }
}

/// A key CMQ signatures are checked with (HMAC needs the key itself): `secret_id` names it in a
/// request (`SecretId`), `user` is who the request acts as.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct SigningKeyDef {
    pub secret_id: String,
    pub user: String,
    pub key: String,
}

impl std::fmt::Debug for SigningKeyDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeyDef").field("secret_id", &self.secret_id).field("user", &self.user).finish_non_exhaustive()
    }
}

pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("a {what} name cannot be empty"));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(format!("{what} name '{}...' is {} bytes long; at most {MAX_NAME_BYTES}", name.chars().take(32).collect::<String>(), name.len()));
    }
    Ok(())
}

/// A permission pattern as RabbitMQ matches it (Erlang `re:run`: unanchored; "" matches nothing,
/// which RabbitMQ writes as `^$`).
pub fn compile(what: &str, pattern: &str) -> Result<regex::Regex, String> {
    let pattern = if pattern.is_empty() { "^$" } else { pattern };
    regex::RegexBuilder::new(&literal_braces(pattern))
        .size_limit(1 << 20)
        .build()
        .map_err(|e| format!("{what} pattern '{pattern}' is not a regular expression this broker reads: {e}"))
}

/// PCRE (Erlang's `re`) reads a `{` that does not start a repetition (`{2}`, `{2,}`, `{2,5}`)
/// as a literal brace, and so a lone `}`; the `regex` crate refuses both. Escaped here, so
/// `^{username}\.` compiles as RabbitMQ compiles it (topic permissions expand it first).
fn literal_braces(pattern: &str) -> String {
    let bytes = pattern.as_bytes();
    let mut out = String::with_capacity(pattern.len() + 4);
    let mut i = 0;
    let mut class = false;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'\\' => {
                // An escape and what it escapes, whole (a multi-byte character is copied below).
                out.push('\\');
                i += 1;
                continue;
            }
            b'[' if !escaped(bytes, i) => class = true,
            b']' if !escaped(bytes, i) => class = false,
            b'{' if !class && !escaped(bytes, i) => {
                let rest = &pattern[i + 1..];
                let quantifier = rest.find('}').is_some_and(|end| {
                    let inner = &rest[..end];
                    let mut parts = inner.splitn(2, ',');
                    let first = parts.next().unwrap_or("");
                    !first.is_empty() && first.bytes().all(|b| b.is_ascii_digit()) && parts.next().is_none_or(|s| s.bytes().all(|b| b.is_ascii_digit()))
                });
                if quantifier {
                    let end = i + 1 + rest.find('}').unwrap_or(0);
                    out.push_str(&pattern[i..=end]);
                    i = end + 1;
                } else {
                    out.push_str("\\{");
                    i += 1;
                }
                continue;
            }
            b'}' if !class && !escaped(bytes, i) => {
                out.push_str("\\}");
                i += 1;
                continue;
            }
            _ => {}
        }
        let ch = pattern[i..].chars().next().unwrap_or('\0');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// Whether the byte at `i` is escaped by an odd run of backslashes before it.
fn escaped(bytes: &[u8], i: usize) -> bool {
    bytes[..i].iter().rev().take_while(|b| **b == b'\\').count() % 2 == 1
}

/// A topic permission's pattern as checked for `user` in `vhost`: `{username}` and `{vhost}`
/// expanded (each matching itself only), compiled. None when the expansion made it invalid: it
/// grants nothing.
pub fn topic_pattern(pattern: &str, user: &str, vhost: &str) -> Option<regex::Regex> {
    compile("topic", &pattern.replace("{username}", &escape(user)).replace("{vhost}", &escape(vhost))).ok()
}

/// `s` as a pattern matching itself (topic permissions' `{username}` and `{vhost}`).
pub fn escape(s: &str) -> String {
    regex::escape(s)
}

/// Tags as RabbitMQ takes them: a list, or one string of comma-separated names.
pub fn parse_tags(value: &serde_json::Value) -> Result<Vec<String>, String> {
    let mut tags: Vec<String> = match value {
        serde_json::Value::Null => Vec::new(),
        serde_json::Value::String(s) => s.split(',').map(str::trim).filter(|t| !t.is_empty()).map(str::to_string).collect(),
        serde_json::Value::Array(items) => items
            .iter()
            .map(|t| t.as_str().map(|s| s.trim().to_string()).ok_or_else(|| format!("a tag must be a string, not {t}")))
            .collect::<Result<_, _>>()?,
        other => return Err(format!("tags must be a list or a comma-separated string, not {other}")),
    };
    // Each once, in the order given ("a, b, a" is a and b).
    let mut seen = std::collections::HashSet::new();
    tags.retain(|t| !t.is_empty() && seen.insert(t.clone()));
    Ok(tags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_kept_once_each_in_their_order() {
        assert_eq!(parse_tags(&serde_json::json!("a, b, a")).unwrap(), vec!["a", "b"]);
        assert_eq!(parse_tags(&serde_json::json!(["b", "a", "b", " "])).unwrap(), vec!["b", "a"]);
    }

    #[test]
    fn empty_patterns_match_nothing_and_others_are_unanchored() {
        let nothing = compile("read", "").unwrap();
        assert!(!nothing.is_match("q") && nothing.is_match(""));
        assert!(compile("read", "^a").unwrap().is_match("abc"));
        assert!(compile("read", "b").unwrap().is_match("abc"), "unanchored, as re:run");
        assert!(compile("read", "(").unwrap_err().contains("read pattern '('"));
        assert!(compile("read", "(?=a)").is_err(), "lookaround is refused, not silently different");
        // PCRE's literal braces: a placeholder-like `{name}`, a lone `}`; repetitions stay.
        assert!(compile("write", "^{username}\\.").unwrap().is_match("{username}.x"));
        assert!(compile("write", "a}").unwrap().is_match("a}"));
        assert!(compile("write", "^a{2}$").unwrap().is_match("aa") && !compile("write", "^a{2}$").unwrap().is_match("a"));
        assert!(compile("write", "^a{1,}b{0,1}$").unwrap().is_match("aaab"));
        assert!(compile("write", "^\\{x\\}$").unwrap().is_match("{x}"), "escaped braces stay escaped");
        assert!(compile("write", "^[{]x$").unwrap().is_match("{x"), "in a class, as given");
    }

    #[test]
    fn tags_come_as_lists_or_comma_strings() {
        assert_eq!(parse_tags(&serde_json::json!("administrator, monitoring")).unwrap(), ["administrator", "monitoring"]);
        assert_eq!(parse_tags(&serde_json::json!(["management"])).unwrap(), ["management"]);
        assert_eq!(parse_tags(&serde_json::json!("")).unwrap(), Vec::<String>::new());
        assert!(parse_tags(&serde_json::json!(3)).is_err());
    }

    #[test]
    fn debug_shows_no_secret() {
        let user = UserDef { name: "u".into(), password_hash: "SECRETHASH".into(), hashing_algorithm: "rabbit_password_hashing_sha256".into(), tags: vec![], limits: serde_json::Value::Null };
        assert!(!format!("{user:?}").contains("SECRETHASH"));
        let key = SigningKeyDef { secret_id: "id".into(), user: "u".into(), key: "SECRETKEY".into() };
        assert!(!format!("{key:?}").contains("SECRETKEY"));
    }
}
