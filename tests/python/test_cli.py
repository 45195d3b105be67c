"""The command-line contract: flags win over WARREN_* environment variables, which win over the file."""
import os
import signal
import subprocess

import pytest

from conftest import BIN, eventually, free_port

pytestmark = pytest.mark.needs_process


def start(tmp_path, args, env_extra):
    env = dict(os.environ)
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
