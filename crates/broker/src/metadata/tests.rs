//! The metadata log: append, reopen, torn tail, corruption in the middle, compaction and a crash
//! at each step of it, import of `definitions.json`.

use super::log::{self, OnCorruption};
use super::*;
use crate::definitions::{BindingDef, ExchangeDef, QueueDef};
use serde_json::json;
use std::fs;

fn queue(vhost: &str, name: &str, id: u64) -> Op {
    Op::QueueDeclared {
        vhost: vhost.into(),
        queue: QueueDef { name: name.into(), id, auto_delete: false, arguments: json!([]), home: None, members: None, leader: None, members_changed: false, transient: None },
    }
}

fn exchange(vhost: &str, name: &str) -> Op {
    Op::ExchangeDeclared {
        vhost: vhost.into(),
        exchange: ExchangeDef { name: name.into(), kind: "topic".into(), auto_delete: false, internal: false, arguments: json!([]) },
    }
}

fn bound(vhost: &str, source: &str, queue: &str, key: &str) -> Op {
    Op::Bound {
        vhost: vhost.into(),
        binding: BindingDef {
            source: source.into(),
            destination: queue.into(),
            destination_type: "queue".into(),
            routing_key: key.into(),
            arguments: json!([]),
        },
    }
}

fn open(dir: &Path) -> Metadata {
    Metadata::open(dir, OnCorruption::Refuse).expect("open").0
}

fn log_path(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

use std::path::PathBuf;

/// Three frames: an exchange, a queue, a binding. Returns the state and each frame's offset.
fn three_frames(dir: &Path) -> (State, Vec<u64>) {
    let m = open(dir);
    let mut offsets = Vec::new();
    for op in [exchange("/", "ex"), queue("/", "q", 7), bound("/", "ex", "q", "a.#")] {
        offsets.push(m.log_len());
        m.commit(vec![op]).unwrap();
    }
    (m.state(), offsets)
}

#[test]
fn appended_changes_come_back_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (state, _) = three_frames(dir.path());
    let m = open(dir.path());
    assert_eq!(m.state(), state);
    assert_eq!(m.next_queue_id(), 8);
    let defs = m.vhost("/");
    assert_eq!((defs.exchanges.len(), defs.queues.len(), defs.bindings.len()), (1, 1, 1));
    assert_eq!(m.vhost_names(), vec!["/".to_string()]);
}

#[test]
fn a_frame_is_applied_whole_and_deletes_cascade() {
    let dir = tempfile::tempdir().unwrap();
    let m = open(dir.path());
    m.commit(vec![exchange("/", "ex"), queue("/", "q", 1), queue("/", "r", 2), bound("/", "ex", "q", "k"), bound("/", "ex", "r", "k")]).unwrap();
    m.commit(vec![Op::QueueDeleted { vhost: "/".into(), name: "q".into(), id: 1 }]).unwrap();
    assert_eq!(m.vhost("/").bindings.len(), 1);
    assert!(m.was_deleted(1));
    m.commit(vec![Op::ExchangeDeleted { vhost: "/".into(), name: "ex".into() }]).unwrap();
    let defs = open(dir.path()).vhost("/");
    assert!(defs.exchanges.is_empty() && defs.bindings.is_empty());
    assert_eq!(defs.queues.len(), 1);
}

#[test]
fn a_deleted_priority_queue_releases_every_store_id_it_had_also_after_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let m = open(dir.path());
    let args = json!([["x-max-priority", {"t": "u8", "v": 3}]]);
    m.commit(vec![Op::QueueDeclared { vhost: "/".into(), queue: QueueDef { name: "p".into(), id: 10, auto_delete: false, arguments: args, home: None, members: None, leader: None, members_changed: false, transient: None } }]).unwrap();
    m.commit(vec![queue("/", "after", 14)]).unwrap();
    m.commit(vec![Op::QueueDeleted { vhost: "/".into(), name: "p".into(), id: 10 }]).unwrap();
    for m in [open(dir.path()), { m.compact().unwrap(); open(dir.path()) }] {
        assert!((10..=13).all(|id| m.was_deleted(id)));
        assert!(!m.was_deleted(9) && !m.was_deleted(14));
        assert_eq!(m.vhost("/").queues.len(), 1);
    }
}

#[test]
fn a_torn_tail_is_cut_and_kept_aside() {
    for cut in [1usize, 5, 9, 20] {
        let dir = tempfile::tempdir().unwrap();
        let (_, offsets) = three_frames(dir.path());
        let path = log_path(dir.path());
        let full = fs::read(&path).unwrap();
        // The last append was interrupted `cut` bytes into its frame.
        let end = offsets[2] as usize + cut;
        fs::write(&path, &full[..end]).unwrap();
        let m = open(dir.path());
        let defs = m.vhost("/");
        assert_eq!((defs.exchanges.len(), defs.queues.len(), defs.bindings.len()), (1, 1, 0), "cut {cut}");
        assert_eq!(fs::metadata(&path).unwrap().len(), offsets[2]);
        let aside = dir.path().join("damaged").join(format!("{FILE_NAME}.{}", offsets[2]));
        assert_eq!(fs::read(aside).unwrap(), &full[offsets[2] as usize..end]);
        // The log goes on from the cut.
        m.commit(vec![queue("/", "after", 9)]).unwrap();
        assert_eq!(open(dir.path()).vhost("/").queues.len(), 2);
    }
}

#[test]
fn absolute_consistency_refuses_even_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let (_, offsets) = three_frames(dir.path());
    let path = log_path(dir.path());
    let full = fs::read(&path).unwrap();
    fs::write(&path, &full[..offsets[2] as usize + 3]).unwrap();
    let err = Metadata::open(dir.path(), OnCorruption::RefuseAll).err().expect("must refuse");
    assert!(err.to_string().contains(&format!("torn tail at byte offset {}", offsets[2])), "{err}");
    assert_eq!(fs::read(&path).unwrap().len(), offsets[2] as usize + 3, "nothing was cut");
}

#[test]
fn zeros_after_the_last_frame_are_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let (state, _) = three_frames(dir.path());
    let path = log_path(dir.path());
    let mut bytes = fs::read(&path).unwrap();
    bytes.extend_from_slice(&[0u8; 4096]);
    fs::write(&path, &bytes).unwrap();
    assert_eq!(open(dir.path()).state(), state);
}

#[test]
fn corruption_in_the_middle_refuses_to_open_naming_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let (_, offsets) = three_frames(dir.path());
    let path = log_path(dir.path());
    let mut bytes = fs::read(&path).unwrap();
    bytes[offsets[1] as usize + 12] ^= 0xff;
    fs::write(&path, &bytes).unwrap();
    let err = Metadata::open(dir.path(), OnCorruption::Refuse).err().expect("must refuse");
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains(&format!("offset {}", offsets[1])), "{text}");
    // Nothing was changed by the refusal.
    assert_eq!(fs::read(&path).unwrap(), bytes);
}

#[test]
fn a_tolerant_open_skips_the_damage_and_keeps_a_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (_, offsets) = three_frames(dir.path());
    let path = log_path(dir.path());
    let mut bytes = fs::read(&path).unwrap();
    bytes[offsets[1] as usize + 12] ^= 0xff;
    fs::write(&path, &bytes).unwrap();
    let (m, report) = Metadata::open(dir.path(), OnCorruption::Skip).unwrap();
    assert_eq!(report.skipped, vec![(offsets[1], offsets[2] - offsets[1])]);
    let defs = m.vhost("/");
    assert_eq!((defs.exchanges.len(), defs.queues.len(), defs.bindings.len()), (1, 0, 1));
    let kept = fs::read(dir.path().join("damaged").join(format!("{FILE_NAME}.{}", offsets[1]))).unwrap();
    assert_eq!(kept, &bytes[offsets[1] as usize..offsets[2] as usize]);
    // The log was rewritten clean: a strict open now succeeds.
    assert_eq!(open(dir.path()).state(), m.state());
}

#[test]
fn compaction_keeps_the_state_and_shrinks_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let m = open(dir.path());
    m.commit(vec![exchange("/", "ex")]).unwrap();
    for i in 0..200 {
        m.commit(vec![queue("/", &format!("q{i}"), i + 1), bound("/", "ex", &format!("q{i}"), "k")]).unwrap();
        if i % 2 == 0 {
            m.commit(vec![Op::QueueDeleted { vhost: "/".into(), name: format!("q{i}"), id: i + 1 }]).unwrap();
        }
    }
    let state = m.state();
    let before = m.log_len();
    m.compact().unwrap();
    assert!(m.log_len() < before, "{} >= {before}", m.log_len());
    assert_eq!(open(dir.path()).state(), state);
    // Appends after a compaction land in the new file.
    m.commit(vec![queue("/", "late", 1000)]).unwrap();
    assert!(open(dir.path()).vhost("/").queues.iter().any(|q| q.name == "late"));
}

#[test]
fn churn_triggers_compaction_so_the_log_stays_near_the_state_size() {
    let dir = tempfile::tempdir().unwrap();
    let m = open(dir.path());
    let big = json!([["x-padding", {"t": "str", "v": "p".repeat(4000)}]]);
    let mut high = 0;
    for i in 0..500u64 {
        let op = Op::QueueDeclared { vhost: "/".into(), queue: QueueDef { name: "churn".into(), id: i + 1, auto_delete: false, arguments: big.clone(), home: None, members: None, leader: None, members_changed: false, transient: None } };
        m.commit(vec![op]).unwrap();
        m.commit(vec![Op::QueueDeleted { vhost: "/".into(), name: "churn".into(), id: i + 1 }]).unwrap();
        high = high.max(m.log_len());
    }
    // 500 declares of ~4 KiB each: without compaction the log would pass 2 MiB.
    assert!(high <= 2 * COMPACT_MIN_BYTES + 64 * 1024, "log grew to {high}");
    assert_eq!(open(dir.path()).state(), m.state());
}

/// A crash at each step of a compaction: before the new file is complete, after it is complete
/// but before the rename, after the rename. Opening finds the old state or the new, never neither.
#[test]
fn a_crash_during_compaction_leaves_the_old_log_or_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let (state, _) = three_frames(dir.path());
    let path = log_path(dir.path());
    let old = fs::read(&path).unwrap();
    let tmp = log::compacting_path(&path);
    let mut snapshot = log::encode_header().to_vec();
    for r in state.snapshot_records().unwrap() {
        snapshot.extend_from_slice(&log::encode_frame(&r).unwrap());
    }
    // Crashed while writing the new file (every length of it), or before renaming it.
    for len in [0, 3, log::HEADER_SIZE as usize, snapshot.len() / 2, snapshot.len()] {
        fs::write(&path, &old).unwrap();
        fs::write(&tmp, &snapshot[..len]).unwrap();
        assert_eq!(open(dir.path()).state(), state, "new file of {len} bytes");
        assert!(!tmp.exists(), "the unfinished compaction is removed");
        assert_eq!(fs::read(&path).unwrap(), old, "the old log is untouched");
    }
    // Crashed after the rename: the new file is the log.
    fs::write(&path, &snapshot).unwrap();
    assert_eq!(open(dir.path()).state(), state);
}

#[test]
fn a_failed_compaction_leaves_the_log_usable() {
    let dir = tempfile::tempdir().unwrap();
    let (state, _) = three_frames(dir.path());
    let m = open(dir.path());
    // The new file cannot be created: a directory is in its way.
    let tmp = log::compacting_path(&log_path(dir.path()));
    fs::create_dir(&tmp).unwrap();
    assert!(m.compact().is_err());
    fs::remove_dir(&tmp).unwrap();
    assert_eq!(open(dir.path()).state(), state);
    m.commit(vec![queue("/", "more", 20)]).unwrap();
    assert_eq!(open(dir.path()).vhost("/").queues.len(), 2);
}

#[test]
fn a_log_from_a_newer_version_or_with_a_bad_header_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    three_frames(dir.path());
    let path = log_path(dir.path());
    let mut bytes = fs::read(&path).unwrap();
    bytes[0] = b'X';
    fs::write(&path, &bytes).unwrap();
    assert!(Metadata::open(dir.path(), OnCorruption::Skip).err().unwrap().to_string().contains("bad header"));
}

#[test]
fn definitions_json_is_imported_once_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let legacy = json!({
        "version": 1,
        "next_queue_id": 42,
        "vhosts": {"/": {
            "exchanges": [{"name": "ex", "type": "direct", "auto_delete": false, "internal": false, "arguments": []}],
            "queues": [{"name": "q", "id": 5, "auto_delete": false, "arguments": []}],
            "bindings": [{"source": "ex", "destination": "q", "destination_type": "queue", "routing_key": "k", "arguments": []}]
        }}
    });
    fs::write(dir.path().join("definitions.json"), serde_json::to_vec(&legacy).unwrap()).unwrap();
    let (m, report) = Metadata::open(dir.path(), OnCorruption::Refuse).unwrap();
    assert!(report.migrated_from.is_some());
    assert_eq!(m.next_queue_id(), 42);
    let defs = m.vhost("/");
    assert_eq!((defs.exchanges.len(), defs.queues.len(), defs.bindings.len()), (1, 1, 1));
    assert!(!dir.path().join("definitions.json").exists());
    assert!(dir.path().join("definitions.json.migrated").exists());
    drop(m);
    let (again, report) = Metadata::open(dir.path(), OnCorruption::Refuse).unwrap();
    assert!(report.migrated_from.is_none());
    assert_eq!(again.vhost("/"), defs);
}

/// Found with the metadata_recovery fuzz target: a record whose checksum is valid but whose queue id
/// is u64::MAX (damage the CRC missed, or a forged file) overflowed the next queue id: a panic where
/// overflow is checked, a next id wrapped to 0 (ids handed out again) where it is not.
#[test]
fn a_queue_id_of_u64_max_does_not_overflow_the_next_queue_id() {
    let mut s = State::default();
    s.apply(queue("/", "q", 5));
    s.apply(queue("/", "far", u64::MAX));
    assert_eq!(s.next_queue_id, u64::MAX);
    s.apply(Op::QueueDeleted { vhost: "/".into(), name: "far".into(), id: u64::MAX });
    assert_eq!(s.next_queue_id, u64::MAX);
}

/// Three nodes declaring one queue at once propose three declarations: the first in the group's
/// log wins (as in every node's topology), also after a restart. A later one must not replace its
/// id: the queue would come back under another id, and its messages be kept aside (lost).
#[test]
fn concurrent_declarations_of_one_name_keep_the_first_queue_id_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let m = open(dir.path());
    let first = m.apply_group_entry(1, vec![queue("/", "q", 0)]).unwrap().ops;
    assert!(matches!(&first[..], [Op::QueueDeclared { queue, .. }] if queue.id == 1));
    let again = m.apply_group_entry(2, vec![queue("/", "q", 0)]).unwrap();
    assert!(again.ops.is_empty() && !again.conflict, "an identical re-declaration is dropped, and is no conflict");
    // In one entry too, and a re-declaration after a delete is a new queue.
    let del = Op::QueueDeleted { vhost: "/".into(), name: "q".into(), id: 1 };
    let ops = m.apply_group_entry(3, vec![queue("/", "q", 0), del, queue("/", "q", 0), queue("/", "q", 0)]).unwrap().ops;
    let ids: Vec<u64> = ops.iter().filter_map(|o| if let Op::QueueDeclared { queue, .. } = o { Some(queue.id) } else { None }).collect();
    assert_eq!(ids, vec![2]);
    assert!(m.apply_group_entry(4, vec![exchange("/", "ex"), exchange("/", "ex")]).unwrap().ops.len() == 1);
    drop(m);
    let m = open(dir.path());
    let defs = m.vhost("/");
    assert_eq!(defs.queues.iter().map(|q| (q.name.as_str(), q.id)).collect::<Vec<_>>(), vec![("q", 2)]);
    assert_eq!(defs.exchanges.len(), 1);
}

/// Two nodes declaring one name at once with other properties: the second declaration in the
/// group's log is dropped and reported as a conflict (its proposer answers 406, as RabbitMQ), on
/// every node alike; the first one's properties stay.
#[test]
fn a_concurrent_declaration_with_other_properties_is_a_conflict() {
    let dir = tempfile::tempdir().unwrap();
    let m = open(dir.path());
    let quorum = |name: &str| {
        let mut op = queue("/", name, 0);
        if let Op::QueueDeclared { queue, .. } = &mut op {
            queue.arguments = json!([["x-queue-type", {"t": "longstr", "v": "quorum"}]]);
        }
        op
    };
    assert!(!m.apply_group_entry(1, vec![quorum("q")]).unwrap().conflict);
    let classic = m.apply_group_entry(2, vec![queue("/", "q", 0)]).unwrap();
    assert!(classic.ops.is_empty() && classic.conflict);
    let mut auto_delete = quorum("q");
    if let Op::QueueDeclared { queue, .. } = &mut auto_delete {
        queue.auto_delete = true;
    }
    assert!(m.apply_group_entry(3, vec![auto_delete]).unwrap().conflict);
    assert!(!m.apply_group_entry(4, vec![quorum("q")]).unwrap().conflict, "the same properties: no conflict");
    // Exchanges: another type.
    assert!(!m.apply_group_entry(5, vec![exchange("/", "ex")]).unwrap().conflict);
    let mut fanout = exchange("/", "ex");
    if let Op::ExchangeDeclared { exchange, .. } = &mut fanout {
        exchange.kind = "fanout".into();
    }
    let applied = m.apply_group_entry(6, vec![fanout, bound("/", "ex", "q", "k")]).unwrap();
    assert!(applied.conflict && applied.ops.len() == 1, "only the declaration is dropped");
    assert_eq!(m.state().exchange("/", "ex").map(|e| e.kind.as_str()), Some("topic"));
    assert_eq!(m.state().queue("/", "q").map(|q| q.arguments.clone()), Some(json!([["x-queue-type", {"t": "longstr", "v": "quorum"}]])));
}

#[test]
fn a_quorum_queues_new_members_survive_a_reopen_and_a_compaction_and_a_stale_id_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = open(dir.path());
    let mut declared = QueueDef { name: "qq".into(), id: 5, auto_delete: false, arguments: json!([]), home: None, members: Some(vec![1, 2, 3]), leader: Some(3), members_changed: false, transient: None };
    m.commit(vec![Op::QueueDeclared { vhost: "/".into(), queue: declared.clone() }]).unwrap();
    m.commit(vec![Op::QueueMembers { vhost: "/".into(), name: "qq".into(), id: 5, members: vec![1, 2, 4] }]).unwrap();
    // A change for another queue of the same name (an id since deleted) is not this queue's.
    m.commit(vec![Op::QueueMembers { vhost: "/".into(), name: "qq".into(), id: 4, members: vec![9] }]).unwrap();
    declared.members = Some(vec![1, 2, 4]);
    declared.members_changed = true;
    assert_eq!(open(dir.path()).vhost("/").queues, vec![declared.clone()]);
    m.compact().unwrap();
    assert_eq!(open(dir.path()).vhost("/").queues, vec![declared]);
}

/// Issue 34: a disk that persists the blocks of one write out of order. The last append (a frame
/// over several 4 KiB blocks) is cut by the power before its fsync returns and any subset of its
/// blocks survives. A frame's length is a binary `u32` whose top byte is below 0x20 and its payload
/// is JSON, where such bytes never appear raw: no valid frame can be found inside the torn one, so
/// the log always opens (the torn frame cut), never refuses as if it were corrupt in the middle.
#[test]
fn a_torn_last_frame_with_blocks_persisted_out_of_order_is_cut_never_refused() {
    use warren_store::sim::{Fault, Loss, OpKind, SimDisk};
    use warren_store::Disk;
    let mut torn = 0;
    for seed in 0..40u64 {
        let root = tempfile::tempdir().unwrap();
        let sim = SimDisk::new(root.path()).unwrap();
        let disk = Disk::simulated(sim.clone());
        let path = root.path().join(FILE_NAME);
        let (mut log, _) = log::RecordLog::open(&disk, &path, OnCorruption::Refuse).unwrap();
        let frame = |i: u64| serde_json::to_vec(&vec![queue("/", &format!("q{i}-{}", "x".repeat(3000)), i); 4]).unwrap();
        for i in 0..3 {
            log.append(&frame(i)).unwrap();
        }
        sim.fault_on(OpKind::FileSync, 0, Fault::PowerCut); // the next fsync: the append's
        assert!(log.append(&frame(3)).is_err(), "the power went before the fsync");
        drop(log);
        sim.power_loss(Loss::Reordered { seed }).unwrap();
        let (_, replayed) = log::RecordLog::open(&disk, &path, OnCorruption::Refuse)
            .unwrap_or_else(|e| panic!("seed {seed}: a torn last frame refused: {e}"));
        let frames: Vec<Vec<u8>> = replayed.records.into_iter().map(|(_, p)| p).collect();
        assert!(frames.len() == 3 || frames.len() == 4, "seed {seed}: {} frames", frames.len());
        for (i, f) in frames.iter().enumerate() {
            assert_eq!(*f, frame(i as u64), "seed {seed}: frame {i}");
        }
        torn += usize::from(replayed.torn.is_some());
    }
    assert!(torn > 20, "most cuts leave a torn frame to cut ({torn} of 40)");
}

// ---- vhosts, users, permissions ----------------------------------------------------------------

fn user(name: &str) -> Op {
    let (password_hash, algorithm) = crate::auth::PasswordHash::new(crate::auth::Algorithm::Sha256, "pw").to_rabbitmq();
    Op::UserPut { user: UserDef { name: name.into(), password_hash, hashing_algorithm: algorithm.into(), tags: vec![], limits: serde_json::Value::Null } }
}

fn vhost_declared(name: &str) -> Op {
    Op::VhostDeclared { vhost: VHostDef::named(name) }
}

fn permission(user: &str, vhost: &str) -> Op {
    Op::PermissionSet { permission: PermissionDef::all(user, vhost) }
}

fn bootstrapped() -> State {
    let mut state = State::default();
    for op in state.admit(vec![vhost_declared("/"), user("guest"), permission("guest", "/"), Op::AuthInitialized]).ops {
        state.apply(op);
    }
    state
}

#[test]
fn a_permission_naming_a_missing_user_or_vhost_refuses_its_entry_whole() {
    let state = bootstrapped();
    let refused = state.admit(vec![user("alice"), permission("alice", "nowhere")]);
    assert_eq!(refused.refused.map(|r| (r.code, r.text)), Some((404, "no vhost 'nowhere'".to_string())));
    assert!(refused.ops.is_empty(), "nothing of a refused entry is applied, alice included");
    assert_eq!(state.admit(vec![permission("bob", "/")]).refused.unwrap().text, "no user 'bob'");
    assert_eq!(state.admit(vec![Op::UserDeleted { name: "bob".into() }]).refused.unwrap().text, "no user 'bob'");
    // Earlier ops of the same entry count: a vhost and a user made together with the permission.
    let made = state.admit(vec![vhost_declared("v"), user("alice"), permission("alice", "v")]);
    assert!(made.refused.is_none() && made.ops.len() == 3);
    // ... and so do deletions before it.
    let gone = state.admit(vec![Op::VhostDeleted { name: "/".into() }, permission("guest", "/")]);
    assert_eq!(gone.refused.unwrap().text, "no vhost '/'");
}

#[test]
fn a_second_bootstrap_is_dropped_whole() {
    let state = bootstrapped();
    let again = state.admit(vec![vhost_declared("/"), user("guest"), permission("guest", "/"), Op::AuthInitialized]);
    assert!(again.ops.is_empty() && again.refused.is_none(), "another node's bootstrap changes nothing (the first one's password hash stays)");
}

#[test]
fn deleting_a_vhost_deletes_its_queues_and_permissions_and_later_declarations_in_it_are_refused() {
    let mut state = bootstrapped();
    for op in [vhost_declared("v"), user("alice"), permission("alice", "v"), permission("alice", "/"), queue("v", "q", 7), exchange("v", "x"), bound("v", "x", "q", "k")] {
        state.apply(op);
    }
    let deleted = state.admit(vec![Op::VhostDeleted { name: "v".into() }]);
    for op in deleted.ops {
        state.apply(op);
    }
    assert!(!state.vhost_declared("v") && !state.vhost_names().contains(&"v".to_string()));
    assert!(state.deleted.contains_key(&7), "its queue's store data may go");
    assert_eq!(state.auth.permissions.keys().cloned().collect::<Vec<_>>(), [("/".to_string(), "alice".to_string()), ("/".to_string(), "guest".to_string())]);
    let late = state.admit(vec![queue("v", "q2", 0)]);
    assert_eq!(late.refused.unwrap().text, "no vhost 'v'");
    // Deleting a user takes its permissions everywhere.
    state.apply(Op::UserDeleted { name: "alice".into() });
    assert_eq!(state.auth.permissions.len(), 1);
}

#[test]
fn users_vhosts_and_permissions_survive_reopen_and_compaction_and_declared_empty_vhosts_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let m = open(dir.path());
    let applied = m.commit_admitted(vec![vhost_declared("/"), vhost_declared("empty"), user("guest"), permission("guest", "/"), Op::AuthInitialized]).unwrap();
    assert!(applied.refused.is_none());
    m.commit_admitted(vec![Op::VhostLimitsSet { vhost: "empty".into(), limits: VHostLimits { max_connections: Some(3), max_queues: None } }]).unwrap();
    let refused = m.commit_admitted(vec![permission("nobody", "/")]).unwrap();
    assert!(refused.refused.is_some());
    let before = m.state();
    drop(m);
    let m = open(dir.path());
    assert_eq!(m.state(), before, "the refused entry left nothing in the log");
    assert_eq!(m.vhost_names(), ["/", "empty"]);
    m.compact().unwrap();
    drop(m);
    let m = open(dir.path());
    assert_eq!(m.state(), before);
    assert!(m.state().auth.initialized);
    // A declaration in a vhost that is not declared is refused once vhosts are recorded.
    assert!(m.commit(vec![queue("gone", "q", 3)]).unwrap_err().to_string().contains("vhost 'gone' was deleted"));
}

#[test]
fn the_log_is_the_owners_only_as_it_holds_password_hashes() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let m = open(dir.path());
    assert_eq!(mode(&log_path(dir.path())), 0o600);
    m.compact().unwrap();
    assert_eq!(mode(&log_path(dir.path())), 0o600, "a rewrite keeps it so");
    drop(m);
    // One from an older version, readable by everyone, is tightened at open.
    fs::set_permissions(log_path(dir.path()), fs::Permissions::from_mode(0o644)).unwrap();
    drop(open(dir.path()));
    assert_eq!(mode(&log_path(dir.path())), 0o600);
}
