"""The command-line contract: flags win over WARREN_* environment variables, which win over the file."""
import os
import socket
import subprocess

import pytest

from conftest import BIN, eventually, free_port

pytestmark = pytest.mark.needs_process


def start(tmp_path, args, env_extra):
    env = dict(os.environ)
    env.update(env_extra)
    log = open(tmp_path / "log", "ab")
    return subprocess.Popen([BIN, "server", *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def listening(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3):
            return True
    except OSError:
        return False


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
        eventually(lambda: listening(expected), timeout=15)
        log = (tmp_path / "log").read_text()
        assert sum("accepting AMQP" in line for line in log.splitlines()) == 1
        assert f":{expected}" in log
        for other in {file_port, env_port, flag_port} - {expected}:
            assert not listening(other)
    finally:
        proc.terminate()
        assert proc.wait(15) == 0


def test_bad_config_is_refused_with_a_reason(tmp_path):
    config = tmp_path / "warren.toml"
    config.write_text("amqp-prot = 5672\n")
    proc = start(tmp_path, ["--config", str(config)], {})
    assert proc.wait(15) != 0
    assert "amqp-prot" in (tmp_path / "log").read_text()
