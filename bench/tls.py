#!/usr/bin/env python3
"""What TLS costs: row A over amqp:// and amqps://, and a load of AMQPS handshakes, against Warren and
RabbitMQ 3.10, in one sitting on this machine. Prints a markdown table ready for BENCHMARKS.md.

    bench/tls.py                      # Warren from /tmp/warren-tls/warren (waits for its READY file)
    bench/tls.py --runs 3 --rsa       # RSA 2048 instead of ECDSA P-256
    bench/tls.py --brokers rabbitmq --transports plain --warren-bin target/release/warren
    bench/tls.py handshakes --port 5671 --ca CA.pem --rate 167 --seconds 60   # the handshake client alone

1. A CA and a server certificate for localhost / 127.0.0.1 (openssl CLI; ECDSA P-256, or RSA 2048).
2. Row A (classic durable queue, 1 publisher / 1 consumer, persistent 1000-byte messages, confirms 1000
   in flight, prefetch 1000, multiple ack every 100), `--time` s each, over amqp:// and amqps://,
   alternated (plain, tls, plain, tls, ...), `--runs` times, against Warren (a fresh data dir each run)
   and RabbitMQ (one node started here with a TLS listener; the queue is deleted after each run).
   Both brokers run with their TLS listener open in every run: only the client's URI differs. One
   client for both: `warren bench`. Broker CPU: user+system of the broker process (/proc/PID/stat).
3. Handshakes: `--hs-rate` AMQPS connections a second (TCP connect, TLS handshake, AMQP
   connection.open, connection.close), open loop, for `--hs-seconds`, from this file's asyncio client
   (the `handshakes` subcommand, a process of its own): alone, and while row A runs over plain AMQP on
   the same broker; row A alone for the same time for comparison.
4. A markdown table with the date, the machine and the exact commands (also in OUT/tls-results.md,
   all figures in OUT/results.json).

Before every run the machine must be quiet (whole-machine CPU below --quiet-pct for 2 s, as
../shared/anchors/workloads.sh checks it; it waits up to --quiet-max-wait s); a run during which
processes other than the broker and the client took more than --disturbed-cores is run again
(up to --max-tries times) and flagged if it never ran clean.
"""
import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import shutil
import shlex
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import cpu_ticks, delete_queues, log, wait_port  # noqa: E402  (bench/run.py's helpers)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "target" / "bench" / "tls"
RBIN = Path("/usr/lib/rabbitmq/bin")
TCK = os.sysconf("SC_CLK_TCK")
ROW_A = ["--persistent", "--confirm", "1000", "--prefetch", "1000", "--multi-ack-every", "100"]


# ---------------------------------------------------------------------------------------------
# certificates

def make_certs(d, rsa):
    """CA + server certificate (SAN localhost, 127.0.0.1) in d; returns the paths."""
    d.mkdir(parents=True, exist_ok=True)
    newkey = ["-newkey", "rsa:2048"] if rsa else ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
    ca, ca_key, cert, key, csr = d / "ca.pem", d / "ca.key", d / "server.pem", d / "server.key", d / "server.csr"
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-new", *newkey, "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "30",
        "-subj", "/CN=warren-tls-bench CA", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", "-new", *newkey, "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    ext = d / "server.ext"
    ext.write_text("basicConstraints=critical,CA:FALSE\n"
                   f"keyUsage=critical,digitalSignature{',keyEncipherment' if rsa else ''}\n"
                   "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "30", "-sha256", "-extfile", str(ext))
    for p in (key, ca_key):
        p.chmod(0o600)
    return {"ca": ca, "cert": cert, "key": key, "kind": "RSA 2048" if rsa else "ECDSA P-256"}


def tls_probe(port, ca):
    """Protocol and cipher a default OpenSSL client gets from this listener."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, ctx.wrap_socket(s, server_hostname="localhost") as t:
        return f"{t.version()} {t.cipher()[0]}"


# ---------------------------------------------------------------------------------------------
# the machine

def stat_cpu():
    """(busy, total, user+nice+system, steal) ticks over all CPUs from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(f[:8])
    return total - f[3] - f[4], total, f[0] + f[1] + f[2], f[7]


def wait_quiet(pct, max_wait):
    """Waits until whole-machine CPU is below pct % over 2 s; returns (busy %, seconds waited)."""
    t0 = time.time()
    while True:
        a = stat_cpu()
        time.sleep(2)
        b = stat_cpu()
        busy = 100 * (b[0] - a[0]) / max(b[1] - a[1], 1)
        waited = time.time() - t0
        if busy < pct:
            return busy, waited
        if waited >= max_wait:
            log(f"    machine still {busy:.0f}% busy after {waited:.0f} s; running anyway")
            return busy, waited
        if int(waited) % 30 < 2:
            log(f"    machine {busy:.0f}% busy ({top_others()}); waiting")


def top_others(n=3):
    """The busiest processes right now (for the log), by CPU over 1 s."""
    def snap():
        out = {}
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    s = (p / "stat").read_text()
                    name = s[s.index("(") + 1:s.rindex(")")]
                    f = s.rsplit(")", 1)[1].split()
                    out[int(p.name)] = (name, int(f[11]) + int(f[12]))
                except (OSError, ValueError):
                    pass
        return out
    a = snap()
    time.sleep(1)
    b = snap()
    d = sorted(((b[p][1] - a[p][1], b[p][0], p) for p in b if p in a), reverse=True)[:n]
    return ", ".join(f"{name}[{pid}] {t * 100 // TCK}%" for t, name, pid in d if t)


def machine_facts():
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")), "?")
    flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    return {"nproc": os.cpu_count(), "cpu": cpu, "aes_ni": " aes " in flags + " ", "vaes": " vaes " in flags + " ",
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "kernel": platform.release(), "python": platform.python_version(),
            "openssl": subprocess.run(["openssl", "version"], capture_output=True, text=True).stdout.strip()}


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# ---------------------------------------------------------------------------------------------
# brokers

class Warren:
    name = "Warren"

    def __init__(self, binary, base_port, certs):
        self.bin, self.certs = binary, certs
        self.port, self.tls_port = base_port, base_port + 3
        self.ports = {"amqp": base_port, "http": base_port + 1, "prometheus": base_port + 2,
                      "amqps": base_port + 3, "https": base_port + 4, "prometheus-tls": base_port + 5}
        self.data = OUT / "warren-data"
        self.proc = None
        self.used = False

    def command(self):
        return [str(self.bin), "server", "--amqp-port", str(self.port), "--http-port", str(self.ports["http"]),
                "--prometheus-port", str(self.ports["prometheus"]), "--amqps-port", str(self.tls_port),
                "--https-port", str(self.ports["https"]), "--prometheus-tls-port", str(self.ports["prometheus-tls"]),
                "--tls-cert", str(self.certs["cert"]), "--tls-key", str(self.certs["key"]), "--data-dir", str(self.data)]

    def start(self):
        """A fresh node: a new data dir every time."""
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)
        busy = [p for p in self.ports.values() if not port_free(p)]
        if busy:
            raise RuntimeError(f"ports {busy} are taken; pass another --port-base")
        self.used = False
        self.proc = subprocess.Popen(self.command(), stdout=open(OUT / "warren.log", "ab"), stderr=subprocess.STDOUT)
        try:
            wait_port(self.port, 30)
            wait_port(self.tls_port, 10)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"Warren did not open {self.port} and {self.tls_port}; see {OUT / 'warren.log'}")

    def pid(self):
        return self.proc.pid

    def after_run(self):
        pass  # the next run starts a fresh node (fresh())

    def fresh(self):
        if self.used:
            self.start()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def version(self):
        return subprocess.run([str(self.bin), "--version"], capture_output=True, text=True).stdout.strip()


class RabbitMQ:
    """One RabbitMQ node with a TLS listener, started as ../shared/anchors/start_cluster.sh starts its
    nodes (rabbitmq-server run directly, HOME with its own Erlang cookie), under its own BASE dir and
    node name, so it leaves any other RabbitMQ on this machine alone."""
    name = "RabbitMQ"

    def __init__(self, base_port, certs):
        self.certs = certs
        self.port, self.tls_port, self.dist_port = base_port + 10, base_port + 11, base_port + 12
        self.base = OUT / "rabbitmq"
        self.node = f"warren-tls-bench-{base_port}@localhost"
        self._pid = None

    def conf(self):
        return (f"listeners.tcp.default = {self.port}\n"
                f"listeners.ssl.default = {self.tls_port}\n"
                f"ssl_options.certfile = {self.certs['cert']}\n"
                f"ssl_options.keyfile = {self.certs['key']}\n"
                f"ssl_options.cacertfile = {self.certs['ca']}\n"
                "ssl_options.verify = verify_none\n"
                "ssl_options.fail_if_no_peer_cert = false\n"
                "loopback_users = none\n"
                "log.file.level = warning\n")

    def env(self):
        d = self.base / "node"
        e = dict(os.environ, HOME=str(self.base / "home"), RABBITMQ_NODENAME=self.node,
                 RABBITMQ_NODE_PORT=str(self.port), RABBITMQ_DIST_PORT=str(self.dist_port),
                 RABBITMQ_MNESIA_BASE=str(d / "mnesia"), RABBITMQ_LOG_BASE=str(d / "log"), RABBITMQ_PID_FILE=str(d / "pid"),
                 RABBITMQ_ENABLED_PLUGINS_FILE=str(d / "enabled_plugins"), RABBITMQ_CONFIG_FILE=str(d / "rabbitmq.conf"),
                 RABBITMQ_ADVANCED_CONFIG_FILE=str(d / "advanced.config"), RABBITMQ_CONF_ENV_FILE=str(d / "rabbitmq-env.conf"))
        return e

    def start(self):
        self.stop()
        shutil.rmtree(self.base / "node", ignore_errors=True)
        busy = [p for p in (self.port, self.tls_port, self.dist_port) if not port_free(p)]
        if busy:
            raise RuntimeError(f"ports {busy} are taken; pass another --port-base")
        d, home = self.base / "node", self.base / "home"
        (d / "mnesia").mkdir(parents=True)
        (d / "log").mkdir()
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(os.urandom(10).hex())
            cookie.chmod(0o400)
        (d / "enabled_plugins").write_text("[].\n")
        (d / "rabbitmq-env.conf").write_text("")
        (d / "rabbitmq.conf").write_text(self.conf())
        t0 = time.time()
        subprocess.Popen([str(RBIN / "rabbitmq-server")], env=self.env(), stdout=open(d / "log" / "stdout.log", "ab"),
                         stderr=subprocess.STDOUT, start_new_session=True)
        r = subprocess.run([str(RBIN / "rabbitmqctl"), "-n", self.node, "wait", str(d / "pid"), "--timeout", "120"],
                           env=self.env(), capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"RabbitMQ did not start: {r.stdout}{r.stderr}; see {d / 'log'}")
        self._pid = int((d / "pid").read_text().strip())
        wait_port(self.port, 60)
        wait_port(self.tls_port, 30)
        log(f"  RabbitMQ node {self.node} up in {time.time() - t0:.1f} s (beam.smp pid {self._pid}), "
            f"amqp {self.port}, amqps {self.tls_port}")

    def pid(self):
        return self._pid

    def after_run(self):
        delete_queues(self.port, ["wl-a"])

    def fresh(self):
        pass  # one node for all runs; after_run deleted the queue

    def stop(self):
        pidfile = self.base / "node" / "pid"
        if pidfile.exists():
            try:
                pid = int(pidfile.read_text().strip())
                os.kill(pid, 0)
            except (ValueError, OSError):
                return
            subprocess.run([str(RBIN / "rabbitmqctl"), "-n", self.node, "stop", str(pidfile)], env=self.env(),
                           capture_output=True, timeout=120)
            pidfile.unlink(missing_ok=True)
            self._pid = None

    def version(self):
        v = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"], capture_output=True, text=True).stdout.strip()
        otp = next(iter(Path("/usr/lib/erlang/releases").glob("*/OTP_VERSION")), None)
        return f"RabbitMQ {v} (Erlang/OTP {otp.read_text().strip() if otp else '?'})"


# ---------------------------------------------------------------------------------------------
# one measured run

def uri(broker, tls):
    return f"amqp{'s' if tls else ''}://guest:guest@127.0.0.1:{broker.tls_port if tls else broker.port}/%2F"


def bench_cmd(opts, broker, tls, seconds, out):
    cmd = [str(opts.bench_bin), "bench", "--uri", uri(broker, tls), *ROW_A, "--time", str(seconds), "--queue", "wl-a",
           "--progress-every", "0", "--json", str(out)]
    if tls and not opts.no_tls_ca:
        cmd += ["--tls-ca", str(opts.certs["ca"])]
    return cmd


def wait_child(proc, timeout):
    """Waits for a Popen child, returning (exit code, CPU seconds it used)."""
    deadline = time.time() + timeout
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, ru.ru_utime + ru.ru_stime
        if time.time() > deadline:
            proc.kill()
            deadline = time.time() + 30
        time.sleep(0.2)


def measured(opts, broker, label, row_a=None, handshakes=None):
    """Runs row A (row_a = (tls, seconds)) and/or the handshake client (handshakes = seconds) at once,
    after waiting for a quiet machine, retrying a disturbed run; returns the figures."""
    for attempt in range(1, opts.max_tries + 1):
        r = measured_once(opts, broker, label, row_a, handshakes)
        r["attempt"] = attempt
        if not r["disturbed"] or attempt == opts.max_tries:
            return r
        log(f"    run disturbed (other processes {r['other_cores']:.2f} cores): again")


def measured_once(opts, broker, label, row_a, handshakes):
    broker.fresh()
    broker.used = True
    busy, waited = wait_quiet(opts.quiet_pct, opts.quiet_max_wait)
    tag = f"{broker.name}-{label}".replace(" + ", "-with-").replace(" ", "-")
    res = {"label": label, "broker": broker.name, "quiet_busy_pct": round(busy, 1), "quiet_waited_s": round(waited)}
    pid = broker.pid()
    procs = {}
    s0, c0, t0 = stat_cpu(), cpu_ticks([pid]), time.time()
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    if handshakes:
        hs_json = OUT / f"{tag}-handshakes.json"
        hs_json.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "handshakes", "--port", str(broker.tls_port), "--ca", str(opts.certs["ca"]),
               "--rate", f"{opts.hs_rate:.6g}", "--seconds", str(handshakes), "--json", str(hs_json)]
        res["handshake_command"] = shlex.join(cmd[1:]).replace(str(ROOT) + "/", "")
        procs["hs"] = (subprocess.Popen(cmd, stdout=open(OUT / f"{tag}-handshakes.txt", "w"), stderr=subprocess.STDOUT), hs_json)
    if row_a:
        tls, seconds = row_a
        a_json = OUT / f"{tag}.json"
        a_json.unlink(missing_ok=True)
        cmd = bench_cmd(opts, broker, tls, seconds, a_json)
        res["bench_command"] = shlex.join(cmd).replace(str(a_json), "FILE")
        procs["a"] = (subprocess.Popen(cmd, stdout=open(OUT / f"{tag}.txt", "w"), stderr=subprocess.STDOUT), a_json)
    longest = max(row_a[1] if row_a else 0, handshakes or 0)
    client_cpu = 0.0
    for key, (p, js) in procs.items():
        code, cpu = wait_child(p, longest + 120)
        client_cpu += cpu
        res[f"{key}_exit"], res[f"{key}_client_cpu_s"] = code, cpu
        res[key] = json.loads(js.read_text()) if js.exists() else None
    wall = time.time() - t0
    s1, c1 = stat_cpu(), cpu_ticks([pid])
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    self_cpu = (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)
    broker_cpu = c1 - c0
    machine = (s1[2] - s0[2]) / TCK  # user+nice+system of every process (not irq/softirq/steal)
    res.update(wall_s=wall, broker_cpu_s=broker_cpu, broker_cores=broker_cpu / wall, client_cores=client_cpu / wall,
               other_cores=max(0.0, (machine - broker_cpu - client_cpu - self_cpu) / wall),
               machine_busy_cores=(s1[0] - s0[0]) / max(s1[1] - s0[1], 1) * os.cpu_count(),
               steal_cores=(s1[3] - s0[3]) / TCK / wall)
    res["disturbed"] = res["other_cores"] > opts.disturbed_cores
    a = res.get("a")
    if row_a:
        if not a or res["a_exit"]:
            tail = (OUT / f"{tag}.txt").read_text()[-600:].strip()
            log(f"    {tag}: warren bench failed (exit {res['a_exit']}): {tail}")
            res["error"] = tail
        else:
            res["rate"] = a.get("consume_rate") or a.get("send_rate") or 0
            msgs = max(a.get("consumed", 0), a.get("sent", 0))
            res["broker_us_per_msg"] = broker_cpu * 1e6 / msgs if msgs else None
    h = res.get("hs")
    if handshakes and not h:
        res["error"] = (res.get("error", "") + " handshake client: " + (OUT / f"{tag}-handshakes.txt").read_text()[-600:]).strip()
    parts = [f"  {broker.name:8} {label:18}"]
    if a and "rate" in res:
        parts.append(f"A {res['rate'] / 1000:7.1f}k msg/s (sent {a.get('send_rate', 0) / 1000:.1f}k), e2e p99 {a.get('e2e_p99_us', 0) / 1000:.1f} ms")
    if h:
        parts.append(f"handshakes {h['ok']}/{h['attempted']} ok, p50 {h['p50_ms']:.1f} ms p99 {h['p99_ms']:.1f} ms")
    parts.append(f"broker {res['broker_cores']:.2f} cores, client {res['client_cores']:.2f}, other {res['other_cores']:.2f}"
                 + (" DISTURBED" if res["disturbed"] else ""))
    log(", ".join(parts))
    if row_a or handshakes:
        broker.after_run()
    return res


# ---------------------------------------------------------------------------------------------
# the handshake client (a process of its own: `tls.py handshakes ...`)

def frame(payload):
    return struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce"


def shortstr(s):
    b = s.encode()
    return struct.pack(">B", len(b)) + b


def longstr(b):
    return struct.pack(">I", len(b)) + b


def method(cls, mth, args=b""):
    return frame(struct.pack(">HH", cls, mth) + args)


PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
CLIENT_PROPS = shortstr("product") + b"S" + longstr(b"warren bench/tls.py handshakes")
START_OK = method(10, 11, longstr(CLIENT_PROPS) + shortstr("PLAIN") + longstr(b"\x00guest\x00guest") + shortstr("en_US"))
OPEN = method(10, 40, shortstr("/") + shortstr("") + b"\x00")
CLOSE = method(10, 50, struct.pack(">H", 200) + shortstr("bye") + struct.pack(">HH", 0, 0))


async def read_method(reader):
    """The next method frame: (class, method, arguments); skips heartbeats."""
    while True:
        kind, _ch, size = struct.unpack(">BHI", await reader.readexactly(7))
        payload = await reader.readexactly(size + 1)
        if payload[-1] != 0xCE:
            raise ValueError("bad frame end")
        if kind == 1:
            cls, mth = struct.unpack(">HH", payload[:4])
            return cls, mth, payload[4:-1]
        if kind != 8:
            raise ValueError(f"unexpected frame type {kind}")


async def expect(reader, cls, mth):
    c, m, args = await read_method(reader)
    if (c, m) == (10, 50):
        code = struct.unpack(">H", args[:2])[0]
        raise ConnectionError(f"server closed: {code} {args[3:3 + args[2]].decode(errors='replace')}")
    if (c, m) != (cls, mth):
        raise ValueError(f"expected {cls}.{mth}, got {c}.{m}")
    return args


async def one_handshake(host, port, ctx, timeout, st):
    t0 = time.perf_counter()
    writer = None
    try:
        async def go():
            nonlocal writer
            reader, writer = await asyncio.open_connection(host, port, ssl=ctx, server_hostname="localhost", ssl_handshake_timeout=timeout)
            t_tls = time.perf_counter()
            if not st["tls"]:
                so = writer.get_extra_info("ssl_object")
                st["tls"] = f"{so.version()} {so.cipher()[0]}"
            if writer.get_extra_info("ssl_object").session_reused:
                st["resumed"] += 1
            writer.write(PROTOCOL_HEADER)
            await expect(reader, 10, 10)  # start
            writer.write(START_OK)
            tune = await expect(reader, 10, 30)
            channel_max, frame_max, _hb = struct.unpack(">HIH", tune[:8])
            writer.write(method(10, 31, struct.pack(">HIH", channel_max, frame_max, 0)) + OPEN)
            await expect(reader, 10, 41)  # open-ok
            t_open = time.perf_counter()
            writer.write(CLOSE)
            await expect(reader, 10, 51)  # close-ok
            return t_tls, t_open
        t_tls, t_open = await asyncio.wait_for(go(), timeout)
        t1 = time.perf_counter()
        st["lat"].append(t1 - t0)
        st["tls_lat"].append(t_tls - t0)
        st["open_lat"].append(t_open - t_tls)
        writer.close()  # after close-ok: TLS close_notify, then the socket; not counted in the latency
        try:
            await asyncio.wait_for(writer.wait_closed(), 2)
        except Exception:  # noqa: BLE001 - a close after close-ok changes nothing measured
            st["close_errors"] += 1
        writer = None
    except Exception as e:  # noqa: BLE001 - every failure is counted by kind
        key = f"{type(e).__name__}: {e}"[:120]
        st["failures"][key] = st["failures"].get(key, 0) + 1
    finally:
        st["active"] -= 1
        if writer is not None:
            writer.transport.abort()


async def handshake_load(host, port, ca, rate, seconds, timeout):
    ctx = ssl.create_default_context(cafile=ca) if ca else ssl._create_unverified_context()  # noqa: S323
    st = {"lat": [], "tls_lat": [], "open_lat": [], "failures": {}, "active": 0, "max_active": 0, "tls": None, "resumed": 0,
          "close_errors": 0, "max_lag": 0.0}
    n = int(rate * seconds)
    tasks = []
    t0 = time.perf_counter()
    for i in range(n):
        target = t0 + i / rate
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            st["max_lag"] = max(st["max_lag"], -delay)
        st["active"] += 1
        st["max_active"] = max(st["max_active"], st["active"])
        tasks.append(asyncio.create_task(one_handshake(host, port, ctx, timeout, st)))
    sent_in = time.perf_counter() - t0
    await asyncio.gather(*tasks)
    return st, n, sent_in, time.perf_counter() - t0


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000


def handshakes_main(argv):
    ap = argparse.ArgumentParser(prog="tls.py handshakes", description="Open-loop AMQPS handshakes: TCP connect, TLS, "
                                 "AMQP start-ok (PLAIN guest) / tune-ok / open, close; each a fresh connection, no resumption.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5671)
    ap.add_argument("--ca", help="CA to verify the server with (hostname localhost); without it, none is verified")
    ap.add_argument("--rate", type=float, default=167, help="handshakes started per second")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--timeout", type=float, default=10, help="seconds before a handshake counts as failed")
    ap.add_argument("--json")
    o = ap.parse_args(argv)
    st, n, sent_in, total = asyncio.run(handshake_load(o.host, o.port, o.ca, o.rate, o.seconds, o.timeout))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    r = {"attempted": n, "ok": len(st["lat"]), "failed": n - len(st["lat"]), "failures": st["failures"],
         "rate_started": n / sent_in if sent_in else 0, "rate_ok": len(st["lat"]) / total, "max_start_lag_ms": st["max_lag"] * 1000,
         "max_in_flight": st["max_active"], "tls": st["tls"], "resumed": st["resumed"], "close_errors": st["close_errors"],
         "p50_ms": pct(st["lat"], 0.5), "p90_ms": pct(st["lat"], 0.9), "p99_ms": pct(st["lat"], 0.99), "max_ms": pct(st["lat"], 1.0),
         "tls_p50_ms": pct(st["tls_lat"], 0.5), "tls_p99_ms": pct(st["tls_lat"], 0.99),
         "amqp_open_p50_ms": pct(st["open_lat"], 0.5), "amqp_open_p99_ms": pct(st["open_lat"], 0.99),
         "client_cpu_s": ru.ru_utime + ru.ru_stime, "wall_s": total}
    print(json.dumps(r, indent=1))
    if o.json:
        Path(o.json).write_text(json.dumps(r, indent=1))
    return 0 if r["ok"] else 1


# ---------------------------------------------------------------------------------------------
# report

def k(v):
    return f"{v / 1000:.1f}k" if v else "—"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def report(opts, facts, versions, rows, hs, probes, started, finished):
    L = [f"## TLS (bench/tls.py)", "",
         f"{started:%Y-%m-%d %H:%M}–{finished:%H:%M} UTC, one sitting on this machine: {facts['nproc']} cores ({facts['cpu']}"
         f"{', AES-NI' if facts['aes_ni'] else ''}{', VAES' if facts['vaes'] else ''}), {facts['ram_gib']} GiB RAM, Linux {facts['kernel']}. "
         f"Brokers: {versions.get('Warren', '—')} (`{opts.warren_bin}`), {versions.get('RabbitMQ', '—')} (one node, default settings "
         f"plus a TLS listener). Client: `warren bench` (`{opts.bench_bin}`) for both. Server certificate: {opts.certs['kind']}, "
         f"signed by a CA made for the run{'' if opts.no_tls_ca else ' (the client verifies it: `--tls-ca`)'}. "
         + ("Negotiated with a default OpenSSL client: " + "; ".join(f"{b} {p}" for b, p in probes.items()) + "." if probes else ""), ""]
    if rows:
        L += [f"Row A (classic durable queue, 1 publisher / 1 consumer, persistent 1000-byte messages, confirms 1000 in flight, "
              f"prefetch 1000, multiple ack every 100), {opts.time} s a run, plain and TLS alternated, {opts.runs} rounds; "
              "Warren from a fresh data dir every run, RabbitMQ one node for all runs (queue deleted after each). Both brokers "
              "have their TLS listener open in every run; only the client's URI differs. msg/s: consumed per second. Broker "
              "CPU: user+system of the broker process over the run (Warren's `warren`, RabbitMQ's `beam.smp`).", "",
              "| broker | transport | msg/s, each run | mean | broker CPU, cores | broker CPU µs/msg | client CPU, cores | other processes, cores |",
              "|---|---|---|---|---|---|---|---|"]
        ratios = []
        for b in [x for x in ("Warren", "RabbitMQ") if any(r["broker"] == x for r in rows)]:
            means = {}
            for t in ("plain", "tls"):
                rs = [r for r in rows if r["broker"] == b and r["transport"] == t]
                if not rs:
                    continue
                each = " / ".join((k(r.get("rate")) if r.get("rate") else "failed") + ("*" if r["disturbed"] else "") for r in rs)
                m = mean([r.get("rate") for r in rs])
                us = mean([r.get("broker_us_per_msg") for r in rs])
                means[t] = (m, us)
                cores = " / ".join(f"{r['broker_cores']:.2f}" for r in rs)
                client = " / ".join(f"{r['client_cores']:.2f}" for r in rs)
                other = " / ".join(f"{r['other_cores']:.2f}" for r in rs)
                L.append(f"| {b} | {'amqps://' if t == 'tls' else 'amqp://'} | {each} | {k(m)} | {cores} | "
                         f"{f'{us:.1f}' if us else '—'} | {client} | {other} |")
            if "plain" in means and "tls" in means and means["plain"][0] and means["tls"][0] and means["plain"][1] and means["tls"][1]:
                (pm, pu), (tm, tu) = means["plain"], means["tls"]
                ratios.append(f"{b}: TLS/plain msg/s {tm / pm:.2f} ({(tm / pm - 1) * 100:+.0f}%), broker CPU per message "
                              f"{tu / pu:.2f}× ({tu - pu:+.1f} µs)")
        L += ["", "Ratios (means): " + "; ".join(ratios) + "." if ratios else "", ""]
        if any(r["disturbed"] for r in rows):
            L += ["`*`: other processes took more than "
                  f"{opts.disturbed_cores} cores during that run even after {opts.max_tries} tries.", ""]
    if hs:
        L += [f"Handshakes: {opts.hs_rate:g} AMQPS connections a second ({opts.hs_rate * 60:,.0f} a minute), open loop, for "
              f"{opts.hs_seconds} s, each a fresh connection (no session resumption): TCP connect, TLS handshake (the client "
              "verifies the certificate), AMQP header / start-ok PLAIN / tune-ok / open, then close / close-ok, from "
              "`bench/tls.py handshakes` (Python asyncio, one process). Latency: connect to close-ok. "
              f"Row A alongside: over plain AMQP, on the same broker, {opts.hs_seconds} s; 'A alone' is the same "
              "run without handshakes, just before.", "",
              "| broker | run | handshakes ok / started | failed | latency p50 / p99 (TLS part p50 / p99) | row A msg/s | "
              "broker CPU, cores | broker CPU per handshake | handshake client CPU, cores | other processes, cores |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for b in [x for x in ("Warren", "RabbitMQ") if any(r["broker"] == x for r in hs)]:
            mine = [x for x in hs if x["broker"] == b]
            a_alone = next((x for x in mine if x["label"] == "A alone"), None)
            for r in mine:
                h = r.get("hs")
                if not h:
                    cells = ["—", "—", "—"] if r["label"] == "A alone" else ["client failed", "—", "—"]
                else:
                    fails = f"{h['failed']:,}" + (" (" + ", ".join(f"{v}× {e}" for e, v in h["failures"].items()) + ")" if h["failures"] else "")
                    lat = (f"{h['p50_ms']:.1f} / {h['p99_ms']:.1f} ms ({h['tls_p50_ms']:.1f} / {h['tls_p99_ms']:.1f})" if h["ok"] else "—")
                    cells = [f"{h['ok']:,} / {h['attempted']:,}", fails, lat]
                per = "—"
                if h and h["ok"] and r["label"] == "handshakes":
                    per = f"{r['broker_cpu_s'] * 1000 / h['ok']:.2f} ms"
                elif h and h["ok"] and r.get("a") and a_alone and a_alone.get("broker_us_per_msg"):
                    msgs = max(r["a"].get("consumed", 0), r["a"].get("sent", 0))
                    per = f"≈{(r['broker_cpu_s'] - a_alone['broker_us_per_msg'] * msgs / 1e6) * 1000 / h['ok']:.2f} ms (¹)"
                rate = k(r.get("rate")) if r.get("rate") else "—"
                if r.get("rate") and a_alone and a_alone.get("rate") and r is not a_alone:
                    rate += f" ({r['rate'] / a_alone['rate']:.2f}× alone)"
                hc = f"{r['hs_client_cpu_s'] / r['wall_s']:.2f}" if "hs_client_cpu_s" in r else "—"
                run = r["label"] + (" (disturbed)" if r["disturbed"] else "")
                L.append(f"| {b} | {run} | {' | '.join(cells)} | {rate} | {r['broker_cores']:.2f} | {per} | {hc} | {r['other_cores']:.2f} |")
        L += ["", "(¹) the broker's CPU over the run less row A's µs per message in 'A alone' times the messages of this run, per handshake.", ""]
    me = Path(sys.argv[0]).resolve()
    L += ["Commands:", "", "```", "python3 " + shlex.join([me.relative_to(ROOT).as_posix() if me.is_relative_to(ROOT) else sys.argv[0], *sys.argv[1:]])]
    for b, cmd in opts.server_commands.items():
        L.append(f"# {b}: {cmd}")
    if "rabbitmq_conf" in opts.__dict__:
        L.append("# rabbitmq.conf: " + opts.rabbitmq_conf.strip().replace("\n", "; "))
    seen = set()
    for r in (rows or []) + (hs or []):
        for key in ("bench_command", "handshake_command"):
            c = r.get(key)
            if c:
                c = c.replace(str(OUT), "$OUT").replace(str(ROOT) + "/", "")
                if c not in seen:
                    seen.add(c)
                    L.append(c)
    L += ["```", "", f"Raw outputs: `{OUT.relative_to(ROOT)}/` (results.json, one .json/.txt per run).", ""]
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------

def main():
    if sys.argv[1:2] == ["handshakes"]:
        return handshakes_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2, help="rounds of (plain, tls) per broker")
    ap.add_argument("--time", type=int, default=15, help="seconds per row A run")
    ap.add_argument("--rsa", action="store_true", help="RSA 2048 certificates instead of ECDSA P-256")
    ap.add_argument("--brokers", default="warren,rabbitmq")
    ap.add_argument("--transports", default="plain,tls", help="plain, tls or both (row A)")
    ap.add_argument("--warren-bin", type=Path, default=Path("/tmp/warren-tls/warren"))
    ap.add_argument("--bench-bin", type=Path, help="the `warren bench` binary (default: --warren-bin)")
    ap.add_argument("--ready-file", type=Path, default=Path("/tmp/warren-tls/READY"), help="wait for this file before using --warren-bin ('' to skip)")
    ap.add_argument("--ready-timeout", type=int, default=5400)
    ap.add_argument("--no-tls-ca", action="store_true", help="don't pass --tls-ca to warren bench (it then trusts any certificate)")
    ap.add_argument("--port-base", type=int, default=26300, help="Warren uses BASE..BASE+5, RabbitMQ BASE+10..BASE+12")
    ap.add_argument("--skip-row-a", action="store_true")
    ap.add_argument("--skip-handshakes", action="store_true")
    ap.add_argument("--hs-brokers", default="warren,rabbitmq", help="brokers for the handshake part")
    ap.add_argument("--hs-rate", type=float, default=10000 / 60)
    ap.add_argument("--hs-seconds", type=int, default=60)
    ap.add_argument("--quiet-pct", type=float, default=10, help="whole-machine CPU %% below which a run may start")
    ap.add_argument("--quiet-max-wait", type=int, default=900)
    ap.add_argument("--disturbed-cores", type=float, default=0.3, help="CPU of other processes that makes a run count as disturbed")
    ap.add_argument("--max-tries", type=int, default=3)
    ap.add_argument("--report-only", action="store_true", help="print the table again from the last run's results.json")
    opts = ap.parse_args()
    opts.bench_bin = opts.bench_bin or opts.warren_bin
    if opts.report_only:
        saved = json.loads((OUT / "results.json").read_text())
        keep = vars(ap.parse_args(saved["argv"][1:]))  # the options of that run
        vars(opts).update(keep, bench_bin=keep["bench_bin"] or keep["warren_bin"], certs=saved["certs"],
                          server_commands=saved["server_commands"])
        if saved.get("rabbitmq_conf"):
            opts.rabbitmq_conf = saved["rabbitmq_conf"]
        sys.argv = saved["argv"]
        print(report(opts, saved["facts"], saved["versions"], saved["row_a"], saved["handshakes"], saved["probes"],
                     datetime.datetime.fromisoformat(saved["started"]), datetime.datetime.fromisoformat(saved["finished"])))
        return 0
    brokers = [b.strip().lower() for b in opts.brokers.split(",") if b.strip()]
    transports = [t.strip() for t in opts.transports.split(",") if t.strip()]
    OUT.mkdir(parents=True, exist_ok=True)
    opts.server_commands = {}

    if "warren" in brokers or opts.bench_bin == Path("/tmp/warren-tls/warren"):
        if str(opts.ready_file) not in ("", ".") and not opts.ready_file.exists():
            log(f"waiting for {opts.ready_file} (up to {opts.ready_timeout} s)")
            deadline = time.time() + opts.ready_timeout
            while not opts.ready_file.exists():
                if time.time() > deadline:
                    sys.exit(f"{opts.ready_file} did not appear")
                time.sleep(10)
    for b in {opts.warren_bin, opts.bench_bin}:
        if not b.exists():
            sys.exit(f"{b} does not exist")

    started = datetime.datetime.now(datetime.timezone.utc)
    facts = machine_facts()
    log(json.dumps(facts))
    opts.certs = make_certs(OUT / "certs", opts.rsa)
    log(f"certificates ({opts.certs['kind']}) in {OUT / 'certs'}")
    rows, hs, versions, probes = [], [], {}, {}
    objs = {"warren": Warren(opts.warren_bin, opts.port_base, opts.certs), "rabbitmq": RabbitMQ(opts.port_base, opts.certs)}
    results_file = OUT / "results.json"

    def save():
        results_file.write_text(json.dumps({"started": started.isoformat(), "facts": facts, "versions": versions, "probes": probes,
                                            "argv": sys.argv, "certs": opts.certs, "server_commands": opts.server_commands,
                                            "rabbitmq_conf": getattr(opts, "rabbitmq_conf", None), "row_a": rows, "handshakes": hs,
                                            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat()}, indent=1, default=str))

    try:
        for name in brokers:
            broker = objs[name]
            log(f"{broker.name}")
            broker.start()
            versions[broker.name] = broker.version()
            if isinstance(broker, Warren):
                opts.server_commands["Warren"] = " ".join(broker.command()).replace(str(OUT), "$OUT")
            else:
                opts.server_commands["RabbitMQ"] = f"{RBIN}/rabbitmq-server with RABBITMQ_NODENAME={broker.node} RABBITMQ_CONFIG_FILE=... (as ../shared/anchors/start_cluster.sh)"
                opts.rabbitmq_conf = broker.conf().replace(str(OUT), "$OUT")
            try:
                probes[broker.name] = tls_probe(broker.tls_port, opts.certs["ca"])
            except (OSError, ssl.SSLError) as e:
                probes[broker.name] = f"probe failed: {e}"
            log(f"  TLS listener {broker.tls_port}: {probes[broker.name]}")
            try:
                if not opts.skip_row_a:
                    for i in range(opts.runs):
                        for t in transports:
                            r = measured(opts, broker, f"A-{t}-{i + 1}", row_a=(t == "tls", opts.time))
                            r["transport"], r["round"] = t, i + 1
                            rows.append(r)
                            save()
                if not opts.skip_handshakes and name in opts.hs_brokers.lower():
                    for label, kw in [("A alone", {"row_a": (False, opts.hs_seconds)}),
                                      ("handshakes", {"handshakes": opts.hs_seconds}),
                                      ("A + handshakes", {"row_a": (False, opts.hs_seconds), "handshakes": opts.hs_seconds})]:
                        r = measured(opts, broker, label, **kw)
                        hs.append(r)
                        save()
            finally:
                broker.stop()
    finally:
        for b in objs.values():
            b.stop()
        save()
    finished = datetime.datetime.now(datetime.timezone.utc)
    md = report(opts, facts, versions, rows, hs, probes, started, finished)
    (OUT / "tls-results.md").write_text(md)
    print("\n" + md)
    log(f"wrote {OUT / 'tls-results.md'} and {results_file}")


if __name__ == "__main__":
    sys.exit(main())
