"""The total-queue checker (as Jepsen's RabbitMQ test): what was confirmed must come out.

Workload threads record into one `History`: every message id before it is sent (`attempt`), every
id a broker confirmed (`confirm`) or nacked (`nack`), every delivery to a consumer (`receive`), and
the nemesis records each fault's window (`with history.fault(name): ...`). After the faults are
healed and the queue is drained, `check(history)` returns a `Report`:

- lost = confirmed − received: must be empty (a confirm, or a tx.commit-ok, is a promise), but for
  as many as no-ack basic.gets were cut off with their connection (at most once: the message may
  have been taken and lost on its way; `tolerate_no_ack_get`);
- lost while healthy: messages published without confirms (`plain`) in a healthy window that never
  arrived: must be empty. The cluster is healthy from the start to the first fault, and from each
  recovery (`recovered`: the test saw confirms flow again after the heal) to the next fault, less
  the last `HEALTHY_GRACE` seconds before it (what was sent then may still be on its way when the
  fault hits);
- unexpected = received − attempted: must be empty (nothing appears that nobody published);
- early: delayed messages (`delayed`) whose first delivery came before their due time (less
  `EARLY_SLACK`, for the wall clock the broker dates them by against the monotonic one here):
  must be empty;
- duplicates: deliveries beyond the first of an id, counted and reported (allowed: a redelivery
  after a lost ack, a republish after a lost confirm);
- per fault, the longest pause between confirms (of all publishers together) in the fault's window
  (from its start to the next fault's start or the end), and how long after the heal confirms
  resumed.

Unconfirmed messages (in flight when a connection died) may or may not arrive; both are fine.
"""
import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

# What a publisher without confirms sent this close before a fault is not held to the healthy rule.
HEALTHY_GRACE = 2.0
# How much earlier than its due time (by this clock) a delayed message may arrive: the broker dates
# messages by the wall clock, the history by the monotonic one; they drift a few ms at most here.
EARLY_SLACK = 0.02


@dataclass
class Fault:
    name: str
    start: float
    healed: float = None  # when the nemesis undid it (node back, link healed)


class History:
    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.wall_offset = time.time() - self.started  # monotonic + wall_offset = Unix time
        self.ended = None
        self.attempted = set()
        self.confirmed = {}  # id -> (monotonic time, node label)
        self.nacked = set()
        self.plain_sent = {}  # id -> (monotonic time, node label): published without confirms
        self.recoveries = []  # monotonic times the cluster was seen recovered after a fault
        self.tolerated = 0  # no-ack gets cut off with their connection (see `tolerate_no_ack_get`)
        self.received = Counter()  # id -> deliveries
        self.received_from = {}  # id -> node label of the first delivery
        self.first_received_at = {}  # id -> monotonic time of the first delivery
        self.due = {}  # id -> monotonic time before which a delayed message must not arrive
        self.faults = []
        self.events = []  # (monotonic time, who, what): connects, errors, reconnects
        self.report = None  # the last `check` of this history
        self.on_fault = None  # called with a line at each fault's start and heal (Nemesis: node logs)

    def attempt(self, ids):
        with self._lock:
            self.attempted.update(ids)

    def confirm(self, ids, node=None):
        now = time.monotonic()
        with self._lock:
            for i in ids:
                self.confirmed.setdefault(i, (now, node))

    def nack(self, ids):
        with self._lock:
            self.nacked.update(ids)

    def plain(self, ids, node=None):
        """Ids published without confirms, just sent."""
        now = time.monotonic()
        with self._lock:
            self.attempted.update(ids)
            for i in ids:
                self.plain_sent[i] = (now, node)

    def recovered(self):
        """The cluster serves again after the last fault's heal (confirms flow): healthy from now."""
        with self._lock:
            self.recoveries.append(time.monotonic())

    def tolerate_no_ack_get(self):
        """A no-ack basic.get was outstanding when its connection failed: one message may be lost."""
        with self._lock:
            self.tolerated += 1

    def receive(self, msg_id, node=None):
        now = time.monotonic()
        with self._lock:
            self.received[msg_id] += 1
            self.received_from.setdefault(msg_id, node)
            self.first_received_at.setdefault(msg_id, now)

    def delayed(self, msg_id, seconds):
        """A message about to be sent with a delay of `seconds`: it must not arrive before then."""
        due = time.monotonic() + seconds
        with self._lock:
            self.due[msg_id] = due

    def last_due(self):
        """When the last delayed message comes due (monotonic; None without delayed messages)."""
        with self._lock:
            return max(self.due.values(), default=None)

    def event(self, who, what):
        with self._lock:
            self.events.append((time.monotonic(), who, what))

    @contextlib.contextmanager
    def fault(self, name):
        """Records the window of a fault: enter when it is done to the cluster, exit when healed."""
        f = Fault(name, time.monotonic())
        with self._lock:
            self.faults.append(f)
        if self.on_fault:
            self.on_fault(f"fault {name}: start")
        try:
            yield f
        finally:
            f.healed = time.monotonic()
            if self.on_fault:
                self.on_fault(f"fault {name}: healed")

    def dump(self, path):
        """Writes the history as JSON (times in seconds since the start) for a failed run's post-mortem."""
        import json
        with self._lock:
            rel = lambda t: round(t - self.started, 4)  # noqa: E731
            data = {
                "attempted": sorted(self.attempted),
                "confirmed": {i: [rel(t), node] for i, (t, node) in self.confirmed.items()},
                "nacked": sorted(self.nacked),
                "received": dict(self.received),
                "received_from": self.received_from,
                "faults": [[f.name, rel(f.start), f.healed and rel(f.healed)] for f in self.faults],
                "events": [[rel(t), who, what] for t, who, what in self.events],
            }
        with open(path, "w") as f:
            json.dump(data, f)

    def end(self):
        """Marks the end of the workload (publishers stopped); later confirms are not paused ones."""
        self.ended = time.monotonic()


@dataclass
class Pause:
    fault: str
    at: float  # seconds since the history started
    longest: float  # longest time without any confirm in the fault's window
    resumed_after_heal: float  # seconds from the heal to the first confirm after it (None: never)


@dataclass
class Report:
    attempted: int
    confirmed: int
    nacked: int
    received: int  # distinct ids
    lost: list
    unexpected: list
    lost_while_healthy: list  # published without confirms in a healthy window, never received
    tolerated: int  # lost confirmed messages allowed (no-ack gets cut off)
    plain: int  # published without confirms
    duplicates: int  # deliveries beyond the first
    duplicated_ids: int
    pauses: list = field(default_factory=list)
    delayed: int = 0  # messages sent with a delay
    early: list = field(default_factory=list)  # (id, seconds early): delayed messages delivered before due

    @property
    def valid(self):
        return len(self.lost) <= self.tolerated and not self.unexpected and not self.lost_while_healthy and not self.early

    def __str__(self):
        lines = [f"attempted {self.attempted}, confirmed {self.confirmed}, nacked {self.nacked}, "
                 f"received {self.received} distinct, lost {len(self.lost)}, unexpected {len(self.unexpected)}, "
                 f"duplicates {self.duplicates} ({self.duplicated_ids} ids); without confirms {self.plain}, "
                 f"lost while healthy {len(self.lost_while_healthy)}; no-ack gets cut off {self.tolerated}; "
                 f"delayed {self.delayed}, early {len(self.early)}"]
        for p in self.pauses:
            resumed = "never" if p.resumed_after_heal is None else f"{p.resumed_after_heal:.2f}s"
            lines.append(f"  {p.fault} at {p.at:.1f}s: longest pause in confirms {p.longest:.2f}s, "
                         f"resumed {resumed} after the heal")
        if self.lost:
            lines.append(f"  lost (first 20): {sorted(self.lost)[:20]}")
        if self.unexpected:
            lines.append(f"  unexpected (first 20): {sorted(self.unexpected)[:20]}")
        if self.early:
            lines.append(f"  delivered before due (first 20, s early): {sorted(self.early)[:20]}")
        if self.lost_while_healthy:
            lines.append(f"  lost while healthy (first 20): {sorted(self.lost_while_healthy)[:20]}")
        return "\n".join(lines)

    def assert_valid(self):
        assert self.valid, f"checker failed:\n{self}"


def write_timeline(history, path):
    """Writes the history's faults, client events and confirms per 100 ms, in wall-clock UTC time (the
    node logs' clock), to `path`: to line a pause up with what the nodes and clients did."""
    def wall(t):
        u = t + history.wall_offset
        return time.strftime("%H:%M:%S", time.gmtime(u)) + f".{int(u * 1000) % 1000:03d}"

    with history._lock:
        lines = [(f.start, f"fault {f.name}: start") for f in history.faults]
        lines += [(f.healed, f"fault {f.name}: healed") for f in history.faults if f.healed is not None]
        lines += [(t, f"{who}: {what}") for t, who, what in history.events]
        per_tick = Counter((int(t * 10), node) for t, node in history.confirmed.values())
    lines += [(tick / 10, f"confirmed {n} via {node}") for (tick, node), n in per_tick.items()]
    with open(path, "w") as f:
        for t, what in sorted(lines, key=lambda x: x[0]):
            f.write(f"{wall(t)} {what}\n")


def longest_pause(times, start, end):
    """The longest stretch in [start, end] with no time in `times` (sorted); a stretch that runs
    past `end` is counted up to the first confirm after it (or to `end` if none came)."""
    longest, prev = 0.0, start
    for t in times:
        if t <= start:
            continue
        if t > end:
            longest = max(longest, t - prev)
            return longest
        longest = max(longest, t - prev)
        prev = t
    return max(longest, end - prev)


def healthy_windows(start, faults, recoveries, end):
    """The (from, to) stretches in which the cluster was healthy: from `start` to the first fault,
    from the first recovery after each heal to the next fault (less `HEALTHY_GRACE` before a fault),
    and from the last recovery to `end`."""
    windows, since = [], start
    for f in faults:
        if since is not None and f.start - HEALTHY_GRACE > since:
            windows.append((since, f.start - HEALTHY_GRACE))
        healed = f.healed if f.healed is not None else end
        since = next((r for r in recoveries if r >= healed), None)
    if since is not None:
        windows.append((since, end))
    return windows


def check(history):
    with history._lock:
        confirmed = dict(history.confirmed)
        attempted = set(history.attempted)
        received = Counter(history.received)
        faults = list(history.faults)
        nacked = set(history.nacked)
        plain_sent = dict(history.plain_sent)
        recoveries = sorted(history.recoveries)
        tolerated = history.tolerated
        due = dict(history.due)
        first_at = dict(history.first_received_at)
    end = history.ended or time.monotonic()
    early = [(i, round(t - first_at[i], 3)) for i, t in due.items() if i in first_at and first_at[i] < t - EARLY_SLACK]
    windows = healthy_windows(history.started, faults, recoveries, end)
    lost_while_healthy = [i for i, (t, _) in plain_sent.items()
                          if i not in received and any(a <= t <= b for a, b in windows)]
    times = sorted(t for t, _ in confirmed.values())
    pauses = []
    for i, f in enumerate(faults):
        window_end = faults[i + 1].start if i + 1 < len(faults) else end
        healed = f.healed if f.healed is not None else end
        after = [t for t in times if t >= healed]
        pauses.append(Pause(f.name, f.start - history.started, longest_pause(times, f.start, window_end),
                            (after[0] - healed) if after else None))
    history.report = Report(
        attempted=len(attempted),
        confirmed=len(confirmed),
        nacked=len(nacked),
        received=len(received),
        lost=[i for i in confirmed if i not in received],
        unexpected=[i for i in received if i not in attempted],
        lost_while_healthy=lost_while_healthy,
        tolerated=tolerated,
        plain=len(plain_sent),
        duplicates=sum(n - 1 for n in received.values()),
        duplicated_ids=sum(1 for n in received.values() if n > 1),
        pauses=pauses,
        delayed=len(due),
        early=early,
    )
    return history.report
