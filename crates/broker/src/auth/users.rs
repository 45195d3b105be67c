//! Who may log in and where: the node's view of the recorded users, permissions and signing keys
//! ([`Users`]), rebuilt from the metadata state whenever an auth op is applied (every node applies
//! the same ops, so every node answers the same). Patterns are compiled once, here.
//!
//! Until the first start's bootstrap is recorded (`Users::initialized`; in a cluster, until the
//! metadata group commits it) the configured default user is the only one and may use every
//! vhost, as before users were recorded.

use super::defs::{PermissionDef, SigningKeyDef, TopicPermissionDef, UserDef, ADMINISTRATOR, MANAGEMENT_TAGS};
use super::PasswordHash;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone)]
pub struct User {
    pub name: String,
    password: PasswordHash,
    pub tags: Vec<String>,
    /// Like RabbitMQ's `loopback_users`: this user may only connect from 127.0.0.0/8 or ::1.
    pub loopback_only: bool,
}

/// Shows no secret: the password hash stays out of every log line.
impl std::fmt::Debug for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("User").field("name", &self.name).field("tags", &self.tags).field("loopback_only", &self.loopback_only).finish_non_exhaustive()
    }
}

impl User {
    pub fn new(name: &str, password: PasswordHash, tags: Vec<String>, loopback_only: bool) -> User {
        User { name: name.to_string(), password, tags, loopback_only }
    }

    pub fn has_tag(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }

    pub fn is_administrator(&self) -> bool {
        self.has_tag(ADMINISTRATOR)
    }

    /// Whether the management API lets it in at all (RabbitMQ: any of its four tags).
    pub fn may_use_management(&self) -> bool {
        MANAGEMENT_TAGS.iter().any(|t| self.has_tag(t))
    }

    pub fn password_hash(&self) -> &PasswordHash {
        &self.password
    }

    pub fn verify(&self, password: &str) -> bool {
        self.password.verify(password)
    }
}

/// What an operation does to a queue or exchange, as RabbitMQ's permissions name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Perm {
    Configure,
    Write,
    Read,
}

impl Perm {
    pub fn as_str(self) -> &'static str {
        match self {
            Perm::Configure => "configure",
            Perm::Write => "write",
            Perm::Read => "read",
        }
    }
}

/// The name permissions are matched against: the default exchange is `amq.default`.
pub fn exchange_resource(name: &str) -> &str {
    if name.is_empty() {
        "amq.default"
    } else {
        name
    }
}

/// A user's permission in one vhost, its patterns compiled.
#[derive(Debug, Clone)]
pub struct Permission {
    pub def: PermissionDef,
    pub configure: regex::Regex,
    pub write: regex::Regex,
    pub read: regex::Regex,
}

impl Permission {
    /// Whether it lets `perm` be done to the resource `name` (unanchored, as RabbitMQ's `re:run`).
    pub fn allows(&self, perm: Perm, name: &str) -> bool {
        match perm {
            Perm::Configure => &self.configure,
            Perm::Write => &self.write,
            Perm::Read => &self.read,
        }
        .is_match(name)
    }

    fn compile(def: &PermissionDef) -> Option<Permission> {
        let c = |what, p: &str| super::defs::compile(what, p).ok();
        Some(Permission { configure: c("configure", &def.configure)?, write: c("write", &def.write)?, read: c("read", &def.read)?, def: def.clone() })
    }
}

/// The recorded users and what they may do, as one node sees them.
#[derive(Debug, Default)]
pub struct Users {
    /// The bootstrap is recorded: only recorded users log in, only where permitted.
    pub initialized: bool,
    users: HashMap<String, Arc<User>>,
    /// (vhost, user) -> permission.
    permissions: HashMap<(String, String), Arc<Permission>>,
    topic_permissions: Vec<TopicPermissionDef>,
    /// secret id -> key.
    signing_keys: HashMap<String, SigningKeyDef>,
}

impl Users {
    /// The view of recorded definitions; `loopback_users` (node configuration) are loopback-only.
    pub fn build<'a>(
        initialized: bool,
        users: impl IntoIterator<Item = &'a UserDef>,
        permissions: impl IntoIterator<Item = &'a PermissionDef>,
        topic_permissions: impl IntoIterator<Item = &'a TopicPermissionDef>,
        signing_keys: impl IntoIterator<Item = &'a SigningKeyDef>,
        loopback_users: &[String],
    ) -> Users {
        let mut out = Users { initialized, ..Users::default() };
        for def in users {
            let Ok(hash) = PasswordHash::from_rabbitmq(&def.password_hash, &def.hashing_algorithm) else {
                // Checked when recorded: only a damaged record gets here. It cannot log in.
                tracing::error!(user = %def.name, "a recorded user's password hash cannot be read; it cannot log in");
                continue;
            };
            let user = User::new(&def.name, hash, def.tags.clone(), loopback_users.contains(&def.name));
            out.users.insert(def.name.clone(), Arc::new(user));
        }
        for def in permissions {
            match Permission::compile(def) {
                Some(p) => {
                    out.permissions.insert((def.vhost.clone(), def.user.clone()), Arc::new(p));
                }
                None => tracing::error!(user = %def.user, vhost = %def.vhost, "a recorded permission's pattern does not compile; it grants nothing"),
            }
        }
        out.topic_permissions = topic_permissions.into_iter().cloned().collect();
        out.signing_keys = signing_keys.into_iter().map(|k| (k.secret_id.clone(), k.clone())).collect();
        out
    }

    /// Before the bootstrap: the configured default user alone, everywhere, signing CMQ requests
    /// with its password as the key.
    pub fn default_only(user: User, password: &str) -> Users {
        let mut out = Users::default();
        out.signing_keys.insert(user.name.clone(), SigningKeyDef { secret_id: user.name.clone(), user: user.name.clone(), key: password.to_string() });
        out.users.insert(user.name.clone(), Arc::new(user));
        out
    }

    pub fn user(&self, name: &str) -> Option<Arc<User>> {
        self.users.get(name).cloned()
    }

    /// Every user, sorted by name.
    pub fn all(&self) -> Vec<Arc<User>> {
        let mut users: Vec<Arc<User>> = self.users.values().cloned().collect();
        users.sort_by(|a, b| a.name.cmp(&b.name));
        users
    }

    /// Checks a user name and password; an unknown name costs the same digest as a known one. A
    /// blank password never logs in, whatever the user's hash says (RabbitMQ's internal backend
    /// refuses it too: a user made with `"password": ""` is not open to anyone).
    pub fn authenticate(&self, name: &str, password: &str) -> Option<Arc<User>> {
        let user = self.users.get(name).filter(|_| !password.is_empty());
        let Some(user) = user else {
            PasswordHash::verify_nothing(password);
            return None;
        };
        user.verify(password).then(|| user.clone())
    }

    /// The user's permission in `vhost`; before the bootstrap, everything for everyone known.
    pub fn permission(&self, user: &str, vhost: &str) -> Option<Arc<Permission>> {
        if !self.initialized {
            let def = PermissionDef::all(user, vhost);
            return self.users.contains_key(user).then(|| Permission::compile(&def).map(Arc::new)).flatten();
        }
        self.permissions.get(&(vhost.to_string(), user.to_string())).cloned()
    }

    /// Every permission, sorted by vhost then user.
    pub fn permissions(&self) -> Vec<PermissionDef> {
        let mut out: Vec<PermissionDef> = self.permissions.values().map(|p| p.def.clone()).collect();
        out.sort_by(|a, b| (&a.vhost, &a.user).cmp(&(&b.vhost, &b.user)));
        out
    }

    pub fn topic_permissions(&self) -> &[TopicPermissionDef] {
        &self.topic_permissions
    }

    /// The user a CMQ `SecretId` acts as, and the key its signature is checked with.
    pub fn signing_key(&self, secret_id: &str) -> Option<(Arc<User>, String)> {
        let key = self.signing_keys.get(secret_id)?;
        Some((self.users.get(&key.user)?.clone(), key.key.clone()))
    }
}
