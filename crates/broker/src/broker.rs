//! The node's broker: its virtual hosts, users, the shared message store, and recovery.

use crate::metadata::log::OnCorruption;
use crate::metadata::group::{self, MetadataGroup};
use crate::metadata::{Metadata, MetadataError};
use crate::queue::quorum::{QuorumHost, QuorumRuntime};
use crate::vhost::{VHost, TRANSIENT_QUEUE_IDS};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;
use warren_store::{Batch, Store, StoreOptions};

pub use crate::auth::User;
use crate::auth::defs::{PermissionDef, SigningKeyDef, UserDef, VHostDef, VHostLimits, ADMINISTRATOR};
use crate::auth::{Algorithm, PasswordHash, Users};
use crate::metadata::{GroupCommitError, Op, Refusal};

/// A change to users or vhosts that open connections must follow (the server closes them:
/// `Broker::on_auth_change`). Every node sees the same ones, in the same order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthChange {
    UserDeleted(String),
    PermissionCleared { user: String, vhost: String },
    VhostDeleted(String),
}

pub type AuthListener = Box<dyn Fn(&AuthChange) + Send + Sync>;

/// Why a change to users, vhosts or permissions was not made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthChangeError {
    /// It names a user or vhost that does not exist: nothing changed.
    Refused(Refusal),
    /// Not recorded (a failed write, no quorum); `maybe`: it may still take effect.
    Failed { reason: String, maybe: bool },
}

impl std::fmt::Display for AuthChangeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AuthChangeError::Refused(r) => f.write_str(&r.text),
            AuthChangeError::Failed { reason, maybe: false } => write!(f, "not recorded, nothing changed: {reason}"),
            AuthChangeError::Failed { reason, maybe: true } => write!(f, "may not be recorded (it may still take effect): {reason}"),
        }
    }
}

pub struct BrokerOptions {
    pub default_vhost: String,
    pub default_user: String,
    pub default_pass: String,
    pub loopback_users: Vec<String>,
    /// `store.recovery_mode` also decides what opening the metadata log does about damage.
    pub store: StoreOptions,
    /// The memory this node's quorum replicas may hold bodies in, together (`queue::body_memory`;
    /// `DEFAULT_NODE_BODY_BYTES` where nothing else says).
    pub quorum_body_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot create data directory {path}: {source}")]
    DataDir { path: String, source: std::io::Error },
    #[error("cannot open the message store: {0}")]
    Store(#[from] warren_store::StoreError),
    #[error("cannot open the metadata log: {0}")]
    Metadata(#[from] MetadataError),
    #[error("the metadata log holds a durable queue id up to {0}, in the range of Raft log and transient queue ids (2^61 and up); it is damaged")]
    QueueIds(u64),
}

pub struct Broker {
    vhosts: RwLock<HashMap<String, Arc<VHost>>>,
    /// The recorded users and permissions as this node sees them (`refresh_users`).
    users: RwLock<Arc<Users>>,
    /// Recorded by the first start's bootstrap; until then the only user.
    default_user: String,
    default_pass: String,
    default_vhost: String,
    loopback_users: Vec<String>,
    auth_listeners: RwLock<Vec<AuthListener>>,
    /// Bumped whenever `users` is rebuilt: channels' cached permission checks compare it.
    auth_generation: AtomicU64,
    store: Store,
    metadata: Arc<Metadata>,
    next_queue_id: Arc<AtomicU64>,
    /// Starts the Raft groups of quorum queues (set by the server: `set_quorum_host`).
    quorum: Arc<QuorumRuntime>,
    /// Delayed messages (`crate::delay`); its timer starts with `start_delays`.
    delays: Arc<crate::delay::Delays>,
}

/// What recovery found, for the startup log.
#[derive(Debug, Default)]
pub struct RecoveryReport {
    pub queues: usize,
    pub messages: usize,
    pub dropped: usize,
    /// Queues the store holds messages for but the metadata log does not know: (queue id,
    /// messages). Their data is left untouched in the store, neither delivered nor deleted.
    pub kept_aside: Vec<(u64, u64)>,
    /// Messages lost with the bytes that held them (a queue segment file missing or cut short):
    /// (queue id, messages). Counted gone; the rest of each queue was recovered.
    pub lost: Vec<(u64, u64)>,
    pub elapsed_ms: u128,
    /// Every queue the store recovered, Raft logs included (the cluster's log store rebuilds the
    /// groups' logs from them).
    pub store_queues: Vec<warren_store::RecoveredQueue>,
}

impl Broker {
    /// Opens the data directory: the store (replaying its log), then the metadata log, then
    /// puts every recovered message back into its queue.
    ///
    /// Messages are never deleted because metadata is missing: the store's data for a queue id
    /// the metadata log does not know is kept aside (left in the store, logged at every start).
    /// Only a queue the log says was deleted, or a transient queue of the previous run, loses
    /// what the store still held for it.
    pub fn open(data_dir: &Path, opts: BrokerOptions) -> Result<(Arc<Broker>, RecoveryReport), OpenError> {
        Broker::open_on(data_dir, opts, warren_store::Disk::real())
    }

    /// [`Broker::open`] with every durable write (the store's and the metadata log's) going through
    /// `disk`: the power-loss simulator in tests (`WARREN_TEST_SIMULATED_DISK`), else the real disk.
    pub fn open_on(data_dir: &Path, opts: BrokerOptions, disk: warren_store::Disk) -> Result<(Arc<Broker>, RecoveryReport), OpenError> {
        let started = Instant::now();
        // Durably: the metadata log and the store are fsynced inside it. A new one is the broker
        // user's only (0700): it holds message bodies, password hashes and signing keys.
        let new_dir = !data_dir.exists();
        warren_store::create_dir_durably(data_dir)
            .and_then(|()| if new_dir { owner_only_dir(data_dir) } else { Ok(()) })
            .map_err(|source| OpenError::DataDir { path: data_dir.display().to_string(), source })?;
        let metadata_mode = OnCorruption::from(opts.store.recovery_mode);
        let (store, recovery) = Store::open_on(&data_dir.join("store"), opts.store, disk.clone())?;
        let (metadata, opened) = Metadata::open_on(data_dir, metadata_mode, &disk)?;
        if let Some(offset) = opened.torn_tail_at {
            tracing::warn!(offset, "the metadata log had a torn tail (an unacknowledged change a crash interrupted); it was cut and kept aside");
        }
        // Ids from `DELAY_SLOT_QUEUES` on are delay slots, then the cluster's Raft logs, then the transient queues'.
        if metadata.next_queue_id() >= crate::delay::DELAY_SLOT_QUEUES {
            // Only a damaged or forged log gets here; handing out such ids would mix queues.
            return Err(OpenError::QueueIds(metadata.next_queue_id()));
        }
        let metadata = Arc::new(metadata);
        let next_queue_id = Arc::new(AtomicU64::new(metadata.next_queue_id().max(1)));

        let broker = Arc::new(Broker {
            vhosts: RwLock::new(HashMap::new()),
            users: RwLock::new(Arc::default()),
            default_user: opts.default_user.clone(),
            default_pass: opts.default_pass.clone(),
            default_vhost: opts.default_vhost.clone(),
            loopback_users: opts.loopback_users.clone(),
            auth_listeners: RwLock::new(Vec::new()),
            auth_generation: AtomicU64::new(0),
            store: store.clone(),
            metadata: metadata.clone(),
            next_queue_id: next_queue_id.clone(),
            quorum: Arc::default(),
            delays: crate::delay::Delays::new(store.clone(), &recovery.queues),
        });
        broker.quorum.bodies().set_limit(opts.quorum_body_bytes);
        broker.refresh_users(Vec::new());

        let mut names = metadata.vhost_names();
        // Until the bootstrap declares it; from then on a deleted default vhost stays deleted.
        if !broker.auth_initialized() && !names.contains(&opts.default_vhost) {
            names.push(opts.default_vhost.clone());
        }
        let mut report = RecoveryReport::default();
        let mut by_id = HashMap::new();
        let mut restored = Vec::new();
        for name in names {
            let vhost = broker.add_vhost(&name);
            restored.extend(vhost.restore_definitions(&metadata.vhost(&name)));
        }
        report.queues = restored.len();
        for q in &restored {
            by_id.insert(q.id, q.clone());
            next_queue_id.fetch_max(q.store_ids().end() + 1, std::sync::atomic::Ordering::Relaxed);
        }
        // A priority queue's other levels are store queues of their own, numbered after its id (see
        // `lane`). A queue declared by a version without priority queues reserved only its own id.
        for q in &restored {
            for store_id in q.store_ids().skip(1) {
                match by_id.get(&store_id) {
                    Some(other) if !Arc::ptr_eq(other, q) => tracing::error!(queue = %q.name, other = %other.name, store_id,
                        "a priority level's store id belongs to another queue (declared by an older version); not restoring that level"),
                    _ => {
                        by_id.insert(store_id, q.clone());
                    }
                }
            }
        }
        let mut orphans = Batch::new();
        // Raft groups' queues are the cluster's, delay slots `delay::Delays`'s.
        for rec in recovery.queues.iter().filter(|rec| !warren_store::is_raft_queue(rec.queue) && !crate::delay::is_delay_slot(rec.queue)) {
            match by_id.get(&rec.queue) {
                // A transient queue of a cluster, of the previous run: its messages ended with it.
                Some(q) if !q.durable => {
                    orphans.drop_queue(rec.queue);
                    report.dropped = report.dropped.saturating_add(rec.live_count as usize);
                }
                Some(q) => {
                    q.restore(rec);
                    report.messages = report.messages.saturating_add(rec.live_count as usize);
                }
                // Deleted, a transient queue of the previous run, or nothing left: it may go.
                None if rec.queue >= TRANSIENT_QUEUE_IDS || metadata.was_deleted(rec.queue) || rec.live_count == 0 => {
                    orphans.drop_queue(rec.queue);
                    report.dropped = report.dropped.saturating_add(rec.live_count as usize);
                }
                None => {
                    tracing::error!(
                        queue_id = rec.queue,
                        messages = rec.live_count,
                        "the store holds {} messages for queue id {}, which the metadata log does not know (its declaration was lost): \
                         they are kept aside, untouched in the store, neither delivered nor deleted",
                        rec.live_count,
                        rec.queue
                    );
                    report.kept_aside.push((rec.queue, rec.live_count));
                }
            }
            if rec.queue < TRANSIENT_QUEUE_IDS {
                // Never reuse an id the store has seen: a new queue must not adopt kept-aside data.
                next_queue_id.fetch_max(rec.queue + 1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        for (store_id, q) in by_id.iter().filter(|(_, q)| q.args.retention_ms > 0) {
            store.set_retention(*store_id, q.args.retention_ms);
        }
        if !orphans.is_empty() {
            let ticket = store.append(&mut orphans)?;
            store.wait_durable(ticket)?;
        }
        // What the store held for deleted queues is gone for good: their records can go too.
        metadata.forget_deleted();
        report.lost = recovery.lost.iter().map(|l| (l.queue, l.messages)).collect();
        report.store_queues = recovery.queues;
        report.elapsed_ms = started.elapsed().as_millis();
        Ok((broker, report))
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Starts firing delayed messages (`crate::delay`). Call from the runtime, before serving clients.
    pub fn start_delays(self: &Arc<Self>) {
        let host: Arc<dyn crate::delay::DueHost> = self.clone();
        self.delays.start(Arc::downgrade(&host));
    }

    /// The node's delayed messages.
    pub fn delays(&self) -> &Arc<crate::delay::Delays> {
        &self.delays
    }

    pub fn add_vhost(&self, name: &str) -> Arc<VHost> {
        let mut vhosts = self.vhosts.write();
        vhosts
            .entry(name.to_string())
            .or_insert_with(|| {
                VHost::new(name.to_string(), self.store.clone(), self.metadata.clone(), self.next_queue_id.clone(), self.quorum.clone(), self.delays.clone())
            })
            .clone()
    }

    /// The node's budget for the bodies its quorum replicas hold (`queue::body_memory`).
    pub fn quorum_bodies(&self) -> Arc<crate::queue::body_memory::NodeBodies> {
        self.quorum.bodies().clone()
    }

    /// Sets the node's quorum host (the server's Raft runtime) and starts the group of every quorum
    /// queue restored from the metadata log. Call before serving clients.
    pub fn set_quorum_host(&self, host: Arc<dyn QuorumHost>) {
        self.quorum.set_host(host.clone());
        for vhost in self.vhosts() {
            vhost.doom_ended_transients();
            for queue in vhost.queues().into_iter().filter(|q| q.is_quorum()) {
                host.start(queue);
            }
        }
    }

    pub fn vhost(&self, name: &str) -> Option<Arc<VHost>> {
        self.vhosts.read().get(name).cloned()
    }

    pub fn vhosts(&self) -> Vec<Arc<VHost>> {
        self.vhosts.read().values().cloned().collect()
    }

    /// The recorded users and permissions as this node sees them now.
    pub fn users(&self) -> Arc<Users> {
        self.users.read().clone()
    }

    /// Changes whenever users or permissions do (see `connection::access` in the server).
    pub fn auth_generation(&self) -> u64 {
        self.auth_generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the first start's bootstrap is recorded (in a cluster: committed and applied here).
    pub fn auth_initialized(&self) -> bool {
        self.users.read().initialized
    }

    /// Checks a user name and password; the answer does not say which of the two was wrong, and
    /// an unknown name takes as long as a known one. In a cluster a refusal is given only after a
    /// metadata read barrier (`Metadata::catch_up`): a user added or a password changed through
    /// another node a moment ago works here at once. Failed logins are throttled before they get
    /// here (`login_guard`), and concurrent misses share one barrier.
    pub fn authenticate(&self, name: &str, password: &str) -> Option<Arc<User>> {
        self.users().authenticate(name, password).or_else(|| self.caught_up().then(|| self.users().authenticate(name, password)).flatten())
    }

    /// In a cluster, waits for a metadata read barrier before a "no": true if the caller should
    /// look again.
    fn caught_up(&self) -> bool {
        self.metadata.is_replicated() && self.metadata.catch_up()
    }

    /// The user a signed request (CMQ's HMAC signature, `SecretId`) acts as, and its key.
    pub fn signing_secret(&self, secret_id: &str) -> Option<(Arc<User>, String)> {
        self.users().signing_key(secret_id)
    }

    /// Whether a user may use a vhost: it exists and the user has a permission on it (in a
    /// cluster, a "no" after a read barrier, as `authenticate`).
    pub fn can_access(&self, user: &User, vhost: &str) -> bool {
        let allowed = || self.vhost(vhost).is_some() && self.users().permission(&user.name, vhost).is_some();
        allowed() || (self.caught_up() && allowed())
    }

    /// The declared vhosts, sorted by name, with their limits.
    pub fn vhost_defs(&self) -> Vec<(VHostDef, VHostLimits)> {
        self.metadata.declared_vhosts()
    }

    /// A vhost's limits (none: no limit).
    pub fn vhost_limits(&self, vhost: &str) -> VHostLimits {
        self.metadata.vhost_limits(vhost)
    }

    /// Calls `listener` with every change open connections must follow, on every node.
    pub fn on_auth_change(&self, listener: AuthListener) {
        self.auth_listeners.write().push(listener);
    }

    /// Rebuilds this node's view of users and permissions from the metadata state, and tells the
    /// listeners what went (users, permissions, vhosts). Serialised by the view's lock, so views
    /// are installed in the order of the states they come from.
    fn refresh_users(&self, mut changes: Vec<AuthChange>) {
        let mut view = self.users.write();
        let (defs, vhosts) = self.metadata.auth();
        let next = if defs.initialized {
            Users::build(true, defs.users.values(), defs.permissions.values(), defs.topic_permissions.values(), defs.signing_keys.values(), &self.loopback_users)
        } else {
            let hash = PasswordHash::new(Algorithm::Sha256, &self.default_pass);
            let user = User::new(&self.default_user, hash, vec![ADMINISTRATOR.to_string()], self.loopback_users.contains(&self.default_user));
            Users::default_only(user, &self.default_pass)
        };
        let was_initialized = view.initialized;
        if was_initialized {
            // Vhosts a snapshot says were deleted while this node was away.
            let declared: std::collections::HashSet<String> = vhosts.into_iter().map(|(d, _)| d.name).collect();
            let gone: Vec<String> = self.vhosts.read().keys().filter(|n| !declared.contains(*n)).cloned().collect();
            for name in gone {
                let removed = self.vhosts.write().remove(&name);
                if let Some(v) = removed {
                    v.drop_everything();
                }
                changes.push(AuthChange::VhostDeleted(name));
            }
            let deleted_vhosts: Vec<String> =
                changes.iter().filter_map(|c| if let AuthChange::VhostDeleted(v) = c { Some(v.clone()) } else { None }).collect();
            for user in view.all() {
                if next.user(&user.name).is_none() {
                    changes.push(AuthChange::UserDeleted(user.name.clone()));
                }
            }
            for p in view.permissions() {
                // Said once: a deleted user's or vhost's permissions go with it.
                if next.user(&p.user).is_some() && next.permission(&p.user, &p.vhost).is_none() && !deleted_vhosts.contains(&p.vhost) {
                    changes.push(AuthChange::PermissionCleared { user: p.user, vhost: p.vhost });
                }
            }
        }
        *view = Arc::new(next);
        self.auth_generation.fetch_add(1, std::sync::atomic::Ordering::Release);
        drop(view);
        let listeners = self.auth_listeners.read();
        for change in &changes {
            tracing::info!(?change, "closing the connections this change ends");
            for listener in listeners.iter() {
                listener(change);
            }
        }
    }

    /// Makes a change to vhosts, users or permissions durable (standalone: the metadata log;
    /// cluster: the metadata group, applied on every node) and applies it here. Blocks the caller
    /// (run it off the runtime's workers).
    pub fn change_auth(&self, ops: Vec<Op>) -> Result<(), AuthChangeError> {
        if ops.is_empty() {
            return Ok(());
        }
        if !self.auth_initialized() && !ops.iter().any(|op| matches!(op, Op::AuthInitialized)) {
            // A cluster whose bootstrap is not committed yet: it comes first (once, whoever proposes it).
            self.bootstrap_auth()?;
        }
        if self.metadata.is_replicated() {
            return self.metadata.commit_replicated(&ops).map_err(|e| match e {
                GroupCommitError::Refused(r) => AuthChangeError::Refused(r),
                GroupCommitError::NotCommitted(reason) => AuthChangeError::Failed { reason, maybe: false },
                GroupCommitError::Unknown(reason) => AuthChangeError::Failed { reason, maybe: true },
                // Only declarations of queues and exchanges conflict.
                GroupCommitError::Conflict => AuthChangeError::Failed { reason: "a conflicting change came first".into(), maybe: false },
            });
        }
        let applied = self.metadata.commit_admitted(ops).map_err(|e| AuthChangeError::Failed { reason: format!("writing the metadata log failed: {e}"), maybe: false })?;
        if let Some(refusal) = applied.refused {
            return Err(AuthChangeError::Refused(refusal));
        }
        self.apply_committed(&applied.ops);
        Ok(())
    }

    /// The first start's users and vhosts, as RabbitMQ's `default_user`: the default vhost (and
    /// every vhost the topology of an older version names), the default user as administrator
    /// with every permission on them, its password as its CMQ signing key. Recorded once: from then
    /// on `default-user` and `default-pass` are not applied again (a second bootstrap, from another
    /// node starting at the same time, is dropped whole). Nothing to do once recorded.
    pub fn bootstrap_auth(&self) -> Result<(), AuthChangeError> {
        if self.auth_initialized() {
            return Ok(());
        }
        let mut vhosts = self.metadata.vhost_names();
        if !vhosts.contains(&self.default_vhost) {
            vhosts.push(self.default_vhost.clone());
        }
        let (password_hash, hashing_algorithm) = PasswordHash::new(Algorithm::Sha256, &self.default_pass).to_rabbitmq();
        let user = &self.default_user;
        let mut ops: Vec<Op> = vhosts.iter().map(|v| Op::VhostDeclared { vhost: VHostDef::named(v) }).collect();
        ops.push(Op::UserPut {
            user: UserDef { name: user.clone(), password_hash, hashing_algorithm: hashing_algorithm.to_string(), tags: vec![ADMINISTRATOR.to_string()], limits: serde_json::Value::Null },
        });
        ops.extend(vhosts.iter().map(|v| Op::PermissionSet { permission: PermissionDef::all(user, v) }));
        ops.push(Op::SigningKeySet { key: SigningKeyDef { secret_id: user.clone(), user: user.clone(), key: self.default_pass.clone() } });
        ops.push(Op::AuthInitialized);
        self.change_auth(ops)?;
        tracing::info!(user = %user, vhost = %self.default_vhost, "recorded the default user and vhost (first start); default-user and default-pass are not applied again");
        Ok(())
    }

    /// Housekeeping for every vhost (TTL, x-expires); call periodically.
    pub fn tick(&self) {
        let now = crate::now_ms();
        for v in self.vhosts() {
            v.tick(now);
        }
    }

    // ---- the cluster's metadata group (`metadata::group`) ---------------------------------

    /// Joins the cluster's metadata group: from now on durable topology changes are proposed to
    /// `group`, and made (here and on every node) by [`Broker::apply_metadata_entry`]. Call
    /// before serving clients.
    ///
    /// Refused when this node's `metadata.log` holds a standalone topology (durable things never
    /// applied through the group): its queue ids and declarations are unknown to the other nodes
    /// and would diverge from theirs. A cluster member starts with no durable topology of its own.
    pub fn set_metadata_group(&self, group: Arc<dyn MetadataGroup>) -> Result<(), String> {
        let state = self.metadata.state();
        if state.group_applied().is_none() && (!state.vhost_names().is_empty() || self.metadata.next_queue_id() > 1) {
            return Err(format!(
                "this node's data directory holds a standalone topology (vhosts {:?} in metadata.log) that the cluster's \
                 metadata group does not know; a node joins a cluster with no durable exchanges or queues of its own \
                 (start it with an empty data directory, or run it standalone)",
                state.vhost_names()
            ));
        }
        self.metadata.set_group(group);
        tracing::info!(applied = self.metadata.group_applied(), "durable topology changes now go through the cluster's metadata group");
        Ok(())
    }

    /// In a cluster: every quorum queue whose group's members are recorded, as
    /// (vhost, name, queue id, members), once this node has applied everything the metadata group
    /// had committed (a read barrier: a queue declared through another node a moment ago is
    /// included). Blocks the caller (run it off the runtime's workers).
    pub fn quorum_members(&self) -> Vec<(String, String, u64, Vec<u64>)> {
        self.metadata.catch_up();
        let state = self.metadata.state();
        let mut out = Vec::new();
        for vhost in state.vhost_names() {
            for q in state.vhost(&vhost).queues {
                if let Some(members) = q.members {
                    out.push((vhost.clone(), q.name, q.id, members));
                }
            }
        }
        out
    }

    /// The durable classic queues homed on `node` (vhost, name): only that node holds their messages.
    pub fn classic_queues_homed_on(&self, node: u64) -> Vec<(String, String)> {
        self.metadata.catch_up();
        let state = self.metadata.state();
        let mut out = Vec::new();
        for vhost in state.vhost_names() {
            for q in state.vhost(&vhost).queues {
                if q.members.is_none() && q.home == Some(node) {
                    out.push((vhost.clone(), q.name));
                }
            }
        }
        out
    }

    /// Records other members for quorum queues' groups (`warren ctl remove-node`, `grow`), through
    /// the metadata group: `(vhost, name, queue id, members)` each. Blocks the caller (run it off
    /// the runtime's workers) until this node has applied them.
    pub fn set_quorum_members(&self, changes: Vec<(String, String, u64, Vec<u64>)>) -> Result<(), String> {
        // Entries of a bounded size, however many queues there are.
        const PER_ENTRY: usize = 256;
        let ops: Vec<crate::metadata::Op> =
            changes.into_iter().map(|(vhost, name, id, members)| crate::metadata::Op::QueueMembers { vhost, name, id, members }).collect();
        for chunk in ops.chunks(PER_ENTRY) {
            self.metadata.commit_replicated(chunk).map_err(|e| match e {
                crate::metadata::GroupCommitError::NotCommitted(e) => format!("not recorded: {e}"),
                crate::metadata::GroupCommitError::Unknown(e) => format!("may not be recorded: {e}"),
                crate::metadata::GroupCommitError::Conflict => "a conflicting change came first".to_string(),
                crate::metadata::GroupCommitError::Refused(r) => r.text,
            })?;
        }
        Ok(())
    }

    /// The metadata group's state machine: applies committed entry `index` (from any node) to
    /// the durable state (`metadata.log`) and the in-memory topology, and returns the proposer's
    /// reply. Deterministic: every node applying the same entries reaches the same topology and
    /// the same queue ids. An entry this node already applied (a replay) changes nothing.
    /// Whether this node has applied metadata-group entry `index`, waiting at most `timeout`.
    pub async fn metadata_applied_at_least(&self, index: u64, timeout: std::time::Duration) -> bool {
        self.metadata.applied_at_least(index, timeout).await
    }

    pub fn apply_metadata_entry(&self, index: u64, entry: &[u8]) -> bytes::Bytes {
        let reply = match group::decode_entry(entry) {
            Ok(ops) => {
                // A replay (None) answers no proposer: it was answered the first time.
                let applied = self.metadata.apply_group_entry(index, ops);
                if let Some(applied) = &applied {
                    self.apply_committed(&applied.ops);
                }
                if let Some(refusal) = applied.as_ref().and_then(|a| a.refused.as_ref()) {
                    tracing::debug!(index, reason = %refusal.text, "a metadata-group entry was refused by the state");
                }
                let (conflict, refused) = applied.map(|a| (a.conflict, a.refused)).unwrap_or_default();
                group::encode_reply(Ok(group::Committed { index, conflict, refused }))
            }
            Err(e) => {
                tracing::error!(index, error = %e, "refusing a metadata-group entry");
                group::encode_reply(Err(&e))
            }
        };
        self.metadata.group_entry_done(index);
        reply
    }

    fn apply_committed(&self, ops: &[Op]) {
        let mut auth_changed = false;
        let mut deleted = Vec::new();
        for op in ops {
            match op {
                Op::VhostDeclared { vhost } => {
                    self.add_vhost(&vhost.name);
                }
                Op::VhostDeleted { name } => {
                    let removed = self.vhosts.write().remove(name);
                    if let Some(v) = removed {
                        v.drop_everything();
                    }
                    deleted.push(AuthChange::VhostDeleted(name.clone()));
                }
                _ => {}
            }
            if op.is_auth() {
                auth_changed = true;
                continue;
            }
            let Some(name) = op.vhost() else { continue };
            let vhost = match self.vhost(name) {
                Some(v) => v,
                // A vhost recorded only through what is in it (before vhosts were recorded).
                None if !self.metadata.vhost_deleted(name) => self.add_vhost(name),
                None => continue,
            };
            vhost.apply_committed(op);
        }
        if auth_changed {
            self.refresh_users(deleted);
        }
    }

    /// The metadata group's snapshot: the durable topology as its shortest op list.
    pub fn metadata_snapshot(&self) -> bytes::Bytes {
        self.metadata.group_snapshot()
    }

    /// Installs a metadata-group snapshot: the durable topology becomes the snapshot's (queues it
    /// lacks are deleted with their messages: they were deleted while this node was away). A
    /// snapshot older than what this node has applied changes nothing.
    pub fn restore_metadata_snapshot(&self, snapshot: &[u8]) -> Result<(), String> {
        let (index, ops) = group::decode_snapshot(snapshot)?;
        let state = self.metadata.restore_group_snapshot(index, ops).map_err(|e| format!("rewriting the metadata log: {e}"))?;
        if let Some(state) = state {
            let mut names: Vec<String> = self.vhosts.read().keys().cloned().collect();
            names.extend(state.vhost_names());
            names.sort();
            names.dedup();
            for name in names {
                let vhost = self.add_vhost(&name);
                vhost.replace_durable(&state.vhost(&name));
            }
            // Users, permissions, vhosts deleted while this node was away.
            self.refresh_users(Vec::new());
        }
        self.metadata.group_entry_done(index);
        Ok(())
    }

    /// The last metadata-group entry applied on this node.
    pub fn metadata_applied(&self) -> u64 {
        self.metadata.group_applied()
    }

    /// Flushes the store; after this, everything accepted is on disk.
    pub fn close(&self) {
        for v in self.vhosts() {
            v.store_deferred();
        }
        if let Err(e) = self.store.close() {
            tracing::error!(error = %e, "closing the message store failed");
        }
    }
}

fn owner_only_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

impl crate::delay::DueHost for Broker {
    fn due_queue(&self, vhost: &str, id: u64) -> Option<Arc<crate::queue::Queue>> {
        self.vhost(vhost)?.queue_by_id(id)
    }

    fn publish_due(&self, vhost: &str, message: crate::message::MessageRef, queue: &Arc<crate::queue::Queue>, settle: crate::deadletter::SettleDeadLetter) {
        match self.vhost(vhost) {
            Some(v) => v.publish_due(message, queue, settle),
            // Deleted since its queues were looked up: nothing holds it, nothing will.
            None => settle(true),
        }
    }
}
