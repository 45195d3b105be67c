"""The checker's verdicts on hand-made histories (no brokers): what it must flag, and the pauses."""
from checker import History, check, longest_pause


def history_of(attempted, confirmed, received, confirm_at=None):
    h = History()
    h.attempt(attempted)
    h.confirm(confirmed)
    for i in received:
        h.receive(i)
    if confirm_at:
        h.confirmed = {i: (h.started + t, None) for i, t in confirm_at.items()}
    return h


def test_a_confirmed_message_never_received_is_lost():
    report = check(history_of(["a", "b", "c"], ["a", "b"], ["a"]))
    assert report.lost == ["b"] and not report.valid


def test_an_unconfirmed_message_may_be_missing_or_present():
    assert check(history_of(["a", "b", "c"], ["a"], ["a", "c"])).valid
    assert check(history_of(["a", "b", "c"], ["a"], ["a"])).valid


def test_a_message_nobody_published_is_unexpected():
    report = check(history_of(["a"], ["a"], ["a", "zzz"]))
    assert report.unexpected == ["zzz"] and not report.valid


def test_duplicates_are_counted_not_failed():
    report = check(history_of(["a", "b"], ["a", "b"], ["a", "a", "a", "b"]))
    assert report.valid and report.duplicates == 2 and report.duplicated_ids == 1


def test_longest_pause_per_fault_window():
    assert longest_pause([1, 2, 6, 7], 1.5, 10) == 4  # 2 -> 6
    assert longest_pause([1, 2, 9], 1.5, 5) == 7  # runs past the window: up to the confirm at 9
    assert longest_pause([1], 2, 5) == 3  # no confirm ever again: to the window's end
    h = history_of(["a", "b", "c"], [], ["a", "b", "c"], confirm_at={"a": 1.0, "b": 4.0, "c": 4.5})
    with h.fault("stop") as f:
        f.start = h.started + 2.0
    f.healed = h.started + 3.5
    h.ended = h.started + 5.0
    (pause,) = check(h).pauses
    assert (round(pause.longest, 6), round(pause.resumed_after_heal, 6)) == (2.0, 0.5)


def test_a_message_without_confirm_sent_while_healthy_must_arrive():
    """Healthy: before the first fault (less the grace before it) and from the recovery after the
    heal. What was sent in the fault, or just before it, may be missing."""
    h = History()
    t0 = h.started
    sends = {"early": 1.0, "just-before": 9.5, "during": 12.0, "healed-not-recovered": 15.5, "recovered": 17.0}
    for i, t in sends.items():
        h.plain([i])
        h.plain_sent[i] = (t0 + t, None)
    with h.fault("kill") as f:
        f.start = t0 + 10.0
    f.healed = t0 + 15.0
    h.recoveries = [t0 + 16.0]
    h.ended = t0 + 20.0
    report = check(h)
    assert sorted(report.lost_while_healthy) == ["early", "recovered"] and not report.valid
    for i in ("early", "recovered"):
        h.receive(i)
    assert check(h).valid


def test_lost_confirmed_messages_are_allowed_only_for_cut_off_no_ack_gets():
    h = history_of(["a", "b"], ["a", "b"], [])
    h.tolerate_no_ack_get()
    assert not check(h).valid, "two lost, one no-ack get cut off"
    h.tolerate_no_ack_get()
    assert check(h).valid


def test_a_delayed_message_delivered_before_its_due_time_is_early():
    h = history_of(["a", "b"], ["a", "b"], [])
    h.delayed("a", 0.0)  # due now: its delivery below is not early
    h.delayed("b", 60.0)  # due in a minute
    h.receive("a")
    h.receive("b")
    report = check(h)
    assert [i for i, _ in report.early] == ["b"] and report.delayed == 2 and not report.valid
    # Judged by its first delivery: had that come after the due time, it is on time.
    h.first_received_at["b"] = h.due["b"] + 1
    assert check(h).valid
