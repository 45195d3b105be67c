"""A short `warren bench` run: every message sent is confirmed and consumed. Not a timed test."""
import json
import subprocess

from conftest import BIN


def test_warren_bench_confirms_and_consumes_everything(broker, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [BIN, "bench", "--uri", broker.url, "--pmessages", "20000", "--producers", "2", "--consumers", "2",
         "--confirm", "500", "--prefetch", "500", "--multi-ack-every", "50", "--persistent",
         "--queue", "bench-smoke", "--progress-every", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["sent"] == s["confirmed"] == s["consumed"] == 40000, s
    assert s["nacked"] == 0
    assert s["confirm_p50_us"] > 0 and s["e2e_p50_us"] > 0


def test_warren_bench_fanout_and_many_queues(broker, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [BIN, "bench", "--uri", broker.url, "--pmessages", "2000", "--producers", "1", "--consumers", "4",
         "--queues", "4", "--exchange", "bench-fanout", "--exchange-type", "fanout", "--confirm", "200",
         "--queue", "bench-fan", "--progress-every", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["sent"] == s["confirmed"] == 2000 and s["consumed"] == 8000, s


def test_warren_bench_drives_the_cmq_api_and_every_message_arrives(broker, tmp_path):
    """`warren bench --cmq`: batches sent over CMQ's HTTP API, received and deleted, counted."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [BIN, "bench", "--cmq", f"http://127.0.0.1:{broker.http_port}", "--pmessages", "3200", "--producers", "2",
         "--consumers", "2", "--size", "100", "--queue", "bench-cmq", "--progress-every", "0", "--time", "50",
         "--json", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["sent"] == s["received"] == 6400, s
    assert s["send_request_latency_us"]["p50"] > 0


def test_warren_bench_through_a_delayed_exchange_sees_nothing_early(broker, tmp_path):
    """`--delay-ms`: every message of a paced publisher arrives, and none before its send time plus
    the delay, measured by the bench client's clock (end-to-end in about 0.1 ms: a due time counted
    from the broker's clock rounded down let a fifth of them arrive up to a millisecond early)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [BIN, "bench", "--uri", broker.url, "--pmessages", "6000", "--rate", "2000", "--confirm", "100",
         "--persistent", "--exchange", "bench-delayed", "--exchange-type", "x-delayed-message", "--delay-ms", "30",
         "--queue", "bench-delayed", "--progress-every", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["sent"] == s["confirmed"] == s["consumed"] == 6000, s
    assert s["early"] == 0, s
