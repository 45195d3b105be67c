"""The command-line contract: flags win over WARREN_* environment variables, which win over the file;
and no subcommand panics when its output is a closed pipe (`warren ... | head -1`)."""
import os
import signal
import subprocess

import pika
import pytest

from conftest import BIN, Broker, eventually, free_port

pytestmark = pytest.mark.needs_process


def start(tmp_path, args, env_extra):
    env = dict(os.environ)
    env["WARREN_PROMETHEUS_PORT"] = "0"  # not 15692: another broker (a RabbitMQ alongside) may have it
    env.update(env_extra)
    log = open(tmp_path / "log", "ab")
    return subprocess.Popen([BIN, "server", *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def accepting_line(proc, log_path):
    """The broker's "accepting AMQP ... on ADDR" log line, once written; raises if the broker exited.
    Waiting for it, rather than for the port to accept connections, cannot be fooled by another
    process (another test run) that took the port meanwhile."""
    if proc.poll() is not None:
        raise RuntimeError(f"warren exited with {proc.returncode}:\n{log_path.read_text()}")
    return next((line for line in log_path.read_text().splitlines() if "accepting AMQP" in line), None)


@pytest.mark.parametrize("winner", ["flag", "env", "file"])
def test_precedence(tmp_path, winner):
    file_port, env_port, flag_port = free_port(), free_port(), free_port()
    config = tmp_path / "warren.toml"
    config.write_text(f'amqp-port = {file_port}\nhttp-port = {free_port()}\ndata-dir = "{tmp_path / "data"}"\n')
    args = ["--config", str(config)]
    env = {}
    if winner in ("flag", "env"):
        env["WARREN_AMQP_PORT"] = str(env_port)
    if winner == "flag":
        args += ["--amqp-port", str(flag_port)]
    expected = {"flag": flag_port, "env": env_port, "file": file_port}[winner]
    proc = start(tmp_path, args, env)
    try:
        accepting = eventually(lambda: accepting_line(proc, tmp_path / "log"), timeout=60)
        assert accepting.endswith(f":{expected}"), accepting
        log = (tmp_path / "log").read_text()
        assert sum("accepting AMQP" in line for line in log.splitlines()) == 1
        for other in {file_port, env_port, flag_port} - {expected}:
            assert f":{other}" not in log
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, (tmp_path / "log").read_text()


def test_bad_config_is_refused_with_a_reason(tmp_path):
    config = tmp_path / "warren.toml"
    config.write_text("amqp-prot = 5672\n")
    proc = start(tmp_path, ["--config", str(config)], {})
    assert proc.wait(15) != 0
    assert "amqp-prot" in (tmp_path / "log").read_text()


def blocked_opening_a_fifo(pid):
    """Whether a thread of the process waits in open() for the other end of a FIFO."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            if open(f"/proc/{pid}/task/{task}/wchan").read().strip() == "wait_for_partner":
                return True
        except OSError:
            pass
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_startup_does_not_kill_the_broker(tmp_path, sig):
    """SIGTERM (stop cleanly) and SIGHUP (reload) are handled from the start, not only once the server
    loop runs: a service manager may send them during recovery or just after the port opens, and the
    default action of both is to kill the process. Here the store's LOCK file is a FIFO, so that the
    broker waits in open() during startup, at a known point, until the test opens the other end."""
    lock = tmp_path / "data" / "store" / "LOCK"
    lock.parent.mkdir(parents=True)
    os.mkfifo(lock)
    port = free_port()
    proc = start(tmp_path, ["--amqp-port", str(port), "--http-port", str(free_port()),
                            "--data-dir", str(tmp_path / "data")], {})
    other_end = None
    try:
        eventually(lambda: blocked_opening_a_fifo(proc.pid), timeout=30)
        proc.send_signal(sig)  # a fatal signal has doomed the process when this returns
        # Lets the broker's open() return. Kept open: an open() interrupted by the handled signal is
        # restarted, and would wait again for a reader that came and went meanwhile.
        other_end = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)
        if sig == signal.SIGTERM:
            assert proc.wait(30) == 0, (tmp_path / "log").read_text()
            assert "stopped" in (tmp_path / "log").read_text()
        else:
            eventually(lambda: proc.poll() is not None or "accepting AMQP" in (tmp_path / "log").read_text(), timeout=30)
            assert proc.poll() is None, (tmp_path / "log").read_text()
    finally:
        if proc.poll() is None:
            proc.terminate()
            assert proc.wait(30) == 0
        if other_end is not None:
            os.close(other_end)


def run_with_closed_output(args, close_stderr=False, timeout=60):
    """Runs `warren ARGS` with the read end of its stdout pipe (and of stderr's, if asked) closed
    before it writes, as `warren ... | head -0` would; returns (exit code, stderr)."""
    proc = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    if close_stderr:
        proc.stderr.close()
        return proc.wait(timeout), ""
    err = proc.stderr.read().decode(errors="replace")
    return proc.wait(timeout), err


def test_bench_ends_quietly_when_its_output_is_a_closed_pipe(broker):
    """println!/eprintln! panic on EPIPE (Rust ignores SIGPIPE): the summary and progress lines must
    not. The run still completes and exits with its own code."""
    bench = ["bench", "--uri", broker.url, "--pmessages", "200", "--confirm", "50", "--queue", "bench-pipe"]
    code, err = run_with_closed_output([*bench, "--progress-every", "0"])
    assert code == 0 and "panicked" not in err, err
    # Progress lines every 50 ms into a closed stderr too (where a panic could not even be seen).
    code, _ = run_with_closed_output([*bench, "--progress-every", "0.05", "--rate", "1000"], close_stderr=True)
    assert code == 0


def test_ctl_and_help_end_quietly_when_their_output_is_a_closed_pipe(tmp_path):
    cluster_port = free_port()
    node = Broker(tmp_path / "data", tmp_path / "warren.log")
    node.extra_args = ["--node-id", "1", "--peers", f"1=127.0.0.1:{cluster_port}", "--cluster-secret", "pipe-test-secret"]
    node.start()
    try:
        ctl = ["ctl", "--node", f"127.0.0.1:{cluster_port}", "--timeout", "5", "--cluster-secret"]
        code, err = run_with_closed_output([*ctl, "pipe-test-secret", "cluster-status"])
        assert code == 0 and "panicked" not in err, err
        # An error message into a closed stderr: the failure's exit code, not a panic's (101).
        code, _ = run_with_closed_output([*ctl, "not-the-secret", "cluster-status"], close_stderr=True)
        assert code == 1
    finally:
        node.kill9()
    code, err = run_with_closed_output(["--help"])
    assert code == 0 and "panicked" not in err, err


def test_server_keeps_serving_when_its_log_pipe_is_closed(tmp_path):
    """`warren server 2>&1 | head -1`: once the reader has gone, logging must not panic the threads
    that log (connections, the store, the cluster), and the broker goes on serving."""
    port = free_port()
    proc = subprocess.Popen([BIN, "server", "--amqp-port", str(port), "--http-port", str(free_port()), "--prometheus-port", "0",
                             "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        eventually(lambda: b"accepting AMQP" in proc.stdout.readline(), timeout=30)
        proc.stdout.close()
        for i in range(3):  # each connection logs as it opens and closes
            conn = pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{port}/%2F"))
            ch = conn.channel()
            ch.queue_declare(f"log-pipe-{i}")
            ch.basic_publish("", f"log-pipe-{i}", b"m")
            assert ch.basic_get(f"log-pipe-{i}", auto_ack=True)[2] == b"m"
            conn.close()
        assert proc.poll() is None
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


@pytest.mark.needs_process
def test_the_release_binary_reads_no_test_switch(tmp_path, monkeypatch):
    """Test switches (here a 3 s fsync and the power-loss simulator, which turns fsync off) exist
    only in the `test-hooks` build the suites use: the release binary ignores them and says nothing
    of them, the hooks build announces both (so this test can fail)."""
    from conftest import BIN, HOOKS_BIN, Broker
    monkeypatch.setenv("WARREN_TEST_FSYNC_DELAY_MS", "3000")
    monkeypatch.setenv("WARREN_TEST_SIMULATED_DISK", "1")
    logs = {}
    for label, binary in (("release", BIN), ("hooks", HOOKS_BIN)):
        if label == "hooks" and not os.path.exists(HOOKS_BIN):
            pytest.skip(f"{HOOKS_BIN} is not built")
        b = Broker(tmp_path / label, tmp_path / f"{label}.log")
        b.bin = binary
        b.start()
        try:
            c = b.connection()
            ch = c.channel()
            ch.confirm_delivery()
            ch.queue_declare("switches", durable=True)
            ch.basic_publish("", "switches", b"x", pika.BasicProperties(delivery_mode=2))
            c.close()
        finally:
            b.proc.kill()
            b.proc.wait(10)
        logs[label] = b.log_text()
    assert "WARREN_TEST_" not in logs["release"], logs["release"][-2000:]
    assert "WARREN_TEST_FSYNC_DELAY_MS is set" in logs["hooks"] and "WARREN_TEST_SIMULATED_DISK is set" in logs["hooks"]
