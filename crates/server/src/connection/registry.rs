//! The node's open AMQP connections, as the management API lists them (`/api/connections`,
//! `/api/channels`) and closes them (`DELETE /api/connections/{name}`).
//!
//! A connection registers once its handshake is done and leaves when it ends (the [`Registered`]
//! guard). Each has its own close signal: the server's shutdown closes them all, an operator one.

use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;
use warren_protocol::field::FieldTable;

/// What the management API shows of one connection.
pub struct ConnectionInfo {
    /// What it told the registry when it opened.
    pub opened: Opened,
    /// RabbitMQ's name for it: "PEER -> LOCAL".
    pub name: String,
    /// Milliseconds since the Unix epoch.
    pub connected_at: u64,
    /// Open channel numbers.
    pub channels: Mutex<BTreeSet<u16>>,
    /// Why an operator closed it (None: still open, or closed by its client or the shutdown).
    pub closed_by_operator: Mutex<Option<String>>,
    close: watch::Sender<bool>,
}

impl ConnectionInfo {
    /// Asks the connection to close with connection.close 320 (CONNECTION_FORCED) and `reason`
    /// (the first reason given, if several come).
    pub fn close(&self, reason: &str) {
        self.closed_by_operator.lock().get_or_insert_with(|| reason.to_string());
        let _ = self.close.send(true);
    }
}

#[derive(Default)]
pub struct ConnectionRegistry {
    state: Mutex<RegistryState>,
}

#[derive(Default)]
struct RegistryState {
    open: BTreeMap<u64, Arc<ConnectionInfo>>,
    /// The server is shutting down: a connection registering now is told to close at once.
    shut_down: bool,
}

/// A connection's place in the registry; it leaves when this is dropped.
pub struct Registered {
    pub info: Arc<ConnectionInfo>,
    /// Becomes true when the connection must close (an operator's close or the shutdown).
    pub close: watch::Receiver<bool>,
    registry: Arc<ConnectionRegistry>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.registry.state.lock().open.remove(&self.info.opened.id);
    }
}

/// What a connection tells the registry about itself once open.
pub struct Opened {
    pub id: u64,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    pub user: String,
    pub vhost: String,
    pub client_properties: FieldTable,
    pub frame_max: u32,
    pub channel_max: u16,
    pub heartbeat: u16,
    /// PLAIN, AMQPLAIN or EXTERNAL.
    pub auth_mechanism: String,
    /// Over TLS (the AMQPS port): its protocol, cipher and client certificate.
    pub tls: Option<crate::tls::Session>,
}

impl ConnectionRegistry {
    pub fn register(self: &Arc<Self>, c: Opened) -> Registered {
        let (close, rx) = watch::channel(false);
        let id = c.id;
        let info = Arc::new(ConnectionInfo {
            name: format!("{} -> {}", c.peer, c.local),
            opened: c,
            connected_at: warren_broker::now_ms(),
            channels: Mutex::new(BTreeSet::new()),
            closed_by_operator: Mutex::new(None),
            close,
        });
        let mut state = self.state.lock();
        if state.shut_down {
            let _ = info.close.send(true);
        }
        state.open.insert(id, info.clone());
        Registered { info, close: rx, registry: self.clone() }
    }

    /// Every open connection, oldest first.
    pub fn list(&self) -> Vec<Arc<ConnectionInfo>> {
        self.state.lock().open.values().cloned().collect()
    }

    pub fn find(&self, name: &str) -> Option<Arc<ConnectionInfo>> {
        self.state.lock().open.values().find(|c| c.name == name).cloned()
    }

    pub fn count(&self) -> usize {
        self.state.lock().open.len()
    }

    /// How many open connections are to `vhost`.
    pub fn count_in(&self, vhost: &str) -> usize {
        self.state.lock().open.values().filter(|c| c.opened.vhost == vhost).count()
    }

    /// Closes the connections a removed user, permission or vhost ends (320 CONNECTION_FORCED,
    /// with RabbitMQ's reply texts for the first and last).
    pub fn close_for(&self, change: &warren_broker::AuthChange) {
        use warren_broker::AuthChange;
        let (reason, ends): (String, Box<dyn Fn(&Opened) -> bool>) = match change {
            AuthChange::UserDeleted(user) => (format!("user '{user}' is deleted"), Box::new(move |c| c.user == *user)),
            AuthChange::PermissionCleared { user, vhost } => (
                format!("user '{user}' has no permission on vhost '{vhost}' any more"),
                Box::new(move |c| c.user == *user && c.vhost == *vhost),
            ),
            AuthChange::VhostDeleted(vhost) => (format!("vhost '{vhost}' is deleted"), Box::new(move |c| c.vhost == *vhost)),
        };
        for c in self.state.lock().open.values().filter(|c| ends(&c.opened)) {
            c.close(&reason);
        }
    }

    /// The server is stopping: every connection, open or opening, closes.
    pub fn shut_down(&self) {
        let mut state = self.state.lock();
        state.shut_down = true;
        for c in state.open.values() {
            let _ = c.close.send(true);
        }
    }
}
