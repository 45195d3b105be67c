//! The Raft configuration every group runs with: settings whose default would be unsafe here.

use warren_cluster::node::group_config;

/// A leader commits with two followers' fsyncs and none of its own, so a restarted leader may lack
/// entries it replicated; leading again in its old term it would reuse their log ids and confirm
/// messages no other node has (tests/cluster/test_raft_safety.py shows the loss with it on).
#[test]
fn a_restarted_leader_does_not_lead_again_in_its_old_term() {
    assert_eq!(group_config().enable_leader_restore, Some(false));
}

/// Warren's node sweep drives heartbeats and elections for all groups at once.
#[test]
fn openraft_runs_no_timers_of_its_own() {
    assert!(!group_config().enable_tick);
}
