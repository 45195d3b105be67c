"""Run RabbitMQ PerfTest against a warren broker started by this test.

Self-contained: starts the warren binary itself (WARREN_BIN, default
target/release/warren) on free ports with a tmp_path data dir.
Installs PerfTest via scripts/install-perftest.sh if needed.
Skipped only if `java` is not installed.
"""
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PERFTEST_VERSION = "2.22.1"
DURATION = 10


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _perftest_dir():
    cache = os.environ.get("WARREN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "warren")
    return Path(cache) / "perftest"


@pytest.fixture
def warren_broker(tmp_path):
    bin_path = Path(os.environ.get("WARREN_BIN", ROOT / "target" / "release" / "warren"))
    if not bin_path.exists():
        pytest.fail(f"warren binary not found at {bin_path}; run `cargo build --release` or set WARREN_BIN")
    amqp_port = _free_port()
    http_port = _free_port()
    while http_port == amqp_port:
        http_port = _free_port()
    log_path = tmp_path / "warren.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [str(bin_path), "server", "--amqp-port", str(amqp_port), "--http-port", str(http_port), "--prometheus-port", "0",
         "--data-dir", str(tmp_path / "data")],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 20
        while True:
            if proc.poll() is not None:
                pytest.fail(f"warren exited early ({proc.returncode}):\n{log_path.read_text(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", amqp_port), timeout=0.2):
                    break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("warren did not accept AMQP connections within 20s")
                time.sleep(0.05)
        yield {"amqp_port": amqp_port, "http_port": http_port, "log": log_path, "proc": proc}
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def _parse_rate(line):
    m = re.search(r"([\d,]+(?:\.\d+)?)\s*msg/s", line)
    return float(m.group(1).replace(",", "")) if m else None


def test_perftest_persistent_confirms(warren_broker):
    if shutil.which("java") is None:
        pytest.skip("java is not installed")
    lib = _perftest_dir() / "lib"
    if not (lib / f"perf-test-{PERFTEST_VERSION}.jar").exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "install-perftest.sh")], check=True, timeout=900)

    port = warren_broker["amqp_port"]
    cmd = [
        "java", "-cp", str(lib) + "/*", "com.rabbitmq.perf.PerfTest",
        "--uri", f"amqp://guest:guest@127.0.0.1:{port}",
        "-x", "1", "-y", "1", "-s", "1000", "-f", "persistent",
        "-c", "1000", "-q", "1000", "--multi-ack-every", "100",
        "-z", str(DURATION), "-u", "perftest-q",
    ]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=DURATION + 90)
    out = res.stdout
    diag = f"command: {' '.join(cmd)}\n--- perftest output ---\n{out}\n--- broker log (tail) ---\n" + \
        warren_broker["log"].read_text(errors="replace")[-4000:]

    assert res.returncode == 0, f"PerfTest exit code {res.returncode}\n{diag}"
    bad = [l for l in out.splitlines() if "exception" in l.lower() or "error" in l.lower()]
    assert not bad, f"PerfTest output has errors/exceptions: {bad}\n{diag}"

    sending = [l for l in out.splitlines() if "sending rate avg" in l]
    receiving = [l for l in out.splitlines() if "receiving rate avg" in l]
    assert sending and receiving, f"no summary rates in PerfTest output\n{diag}"
    send_rate = _parse_rate(sending[-1])
    recv_rate = _parse_rate(receiving[-1])
    assert send_rate is not None and send_rate > 0, f"sending rate not > 0: {sending[-1]}\n{diag}"
    assert recv_rate is not None and recv_rate > 0, f"receiving rate not > 0: {receiving[-1]}\n{diag}"
    print(f"PerfTest: sending {send_rate:.0f} msg/s, receiving {recv_rate:.0f} msg/s")
