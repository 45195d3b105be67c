//! The recorded users, permissions, topic permissions and signing keys: the auth part of the
//! metadata [`State`](super::State), changed by the auth ops of [`Op`] (vhosts themselves are
//! in the topology part: `VHostState::declared`).
//!
//! [`AuthDefs::admit`] checks an auth op against the state (as `State::admit` does for
//! declarations, in log order): a permission for a user or vhost that does not exist is refused,
//! so every node refuses the same entry and none records a dangling permission.

use super::Op;
use crate::auth::defs::{PermissionDef, SigningKeyDef, TopicPermissionDef, UserDef};
use std::collections::BTreeMap;

#[derive(Debug, Default, Clone, PartialEq)]
pub struct AuthDefs {
    /// The first start's bootstrap (default user, its permissions) is recorded.
    pub initialized: bool,
    pub users: BTreeMap<String, UserDef>,
    /// (vhost, user) -> permission.
    pub permissions: BTreeMap<(String, String), PermissionDef>,
    /// (vhost, user, exchange) -> topic permission.
    pub topic_permissions: BTreeMap<(String, String, String), TopicPermissionDef>,
    /// secret id -> key.
    pub signing_keys: BTreeMap<String, SigningKeyDef>,
}

/// Why an entry was refused as a whole (every node refuses it the same way): `code` is the AMQP
/// reply code a client would get (404 NOT_FOUND, 406 PRECONDITION_FAILED).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: u16,
    pub text: String,
}

impl Refusal {
    pub fn not_found(text: String) -> Refusal {
        Refusal { code: 404, text }
    }
}

impl AuthDefs {
    /// Applies an auth op (others are ignored). Takes any op: what it names may be gone.
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::UserPut { user } => {
                self.users.insert(user.name.clone(), user.clone());
            }
            Op::UserDeleted { name } => {
                self.users.remove(name);
                self.permissions.retain(|(_, u), _| u != name);
                self.topic_permissions.retain(|(_, u, _), _| u != name);
                self.signing_keys.retain(|_, k| k.user != *name);
            }
            Op::PermissionSet { permission } => {
                self.permissions.insert((permission.vhost.clone(), permission.user.clone()), permission.clone());
            }
            Op::PermissionCleared { user, vhost } => {
                self.permissions.remove(&(vhost.clone(), user.clone()));
            }
            Op::TopicPermissionSet { permission: p } => {
                self.topic_permissions.insert((p.vhost.clone(), p.user.clone(), p.exchange.clone()), p.clone());
            }
            Op::TopicPermissionCleared { user, vhost, exchange } => {
                self.topic_permissions.remove(&(vhost.clone(), user.clone(), exchange.clone()));
            }
            Op::SigningKeySet { key } => {
                self.signing_keys.insert(key.secret_id.clone(), key.clone());
            }
            Op::VhostDeleted { name } => {
                self.permissions.retain(|(v, _), _| v != name);
                self.topic_permissions.retain(|(v, _, _), _| v != name);
            }
            Op::AuthInitialized => self.initialized = true,
            _ => {}
        }
    }

    /// The ops that build this part from nothing (after the vhosts are declared).
    pub fn snapshot_ops(&self, ops: &mut Vec<Op>) {
        ops.extend(self.users.values().map(|u| Op::UserPut { user: u.clone() }));
        ops.extend(self.permissions.values().map(|p| Op::PermissionSet { permission: p.clone() }));
        ops.extend(self.topic_permissions.values().map(|p| Op::TopicPermissionSet { permission: p.clone() }));
        ops.extend(self.signing_keys.values().map(|k| Op::SigningKeySet { key: k.clone() }));
        if self.initialized {
            ops.push(Op::AuthInitialized);
        }
    }
}

/// What the ops before, in one entry, have done to users and vhosts (`State::admit` checks each
/// op against the state as those left it).
#[derive(Default)]
pub struct Pending {
    /// Declared (true) or deleted (false) earlier in the entry.
    pub vhosts: BTreeMap<String, bool>,
    pub users: BTreeMap<String, bool>,
}

impl Pending {
    pub fn vhost_exists(&self, state: &super::State, name: &str) -> bool {
        self.vhosts.get(name).copied().unwrap_or_else(|| state.vhost_declared(name))
    }

    pub fn user_exists(&self, state: &super::State, name: &str) -> bool {
        self.users.get(name).copied().unwrap_or_else(|| state.auth.users.contains_key(name))
    }

    /// Checks one auth or vhost op, and records its effect. None: admitted.
    pub fn check(&mut self, state: &super::State, op: &Op) -> Option<Refusal> {
        let no_user = |name: &str| Some(Refusal::not_found(format!("no user '{name}'")));
        let no_vhost = |name: &str| Some(Refusal::not_found(format!("no vhost '{name}'")));
        match op {
            Op::VhostDeclared { vhost } => {
                self.vhosts.insert(vhost.name.clone(), true);
            }
            Op::VhostDeleted { name } => {
                if !self.vhost_exists(state, name) {
                    return no_vhost(name);
                }
                self.vhosts.insert(name.clone(), false);
            }
            Op::VhostLimitsSet { vhost, .. } if !self.vhost_exists(state, vhost) => return no_vhost(vhost),
            Op::UserPut { user } => {
                self.users.insert(user.name.clone(), true);
            }
            Op::UserDeleted { name } => {
                if !self.user_exists(state, name) {
                    return no_user(name);
                }
                self.users.insert(name.clone(), false);
            }
            Op::PermissionSet { permission: PermissionDef { user, vhost, .. } }
            | Op::PermissionCleared { user, vhost }
            | Op::TopicPermissionSet { permission: TopicPermissionDef { user, vhost, .. } }
            | Op::TopicPermissionCleared { user, vhost, .. } => {
                if !self.user_exists(state, user) {
                    return no_user(user);
                }
                if !self.vhost_exists(state, vhost) {
                    return no_vhost(vhost);
                }
            }
            Op::SigningKeySet { key } if !self.user_exists(state, &key.user) => return no_user(&key.user),
            _ => {}
        }
        None
    }
}
