"""Faults done to a `nodes.Cluster`, each recorded as a window in a `checker.History` (from when it
is done to when it is undone and, for a restart, the node listens again).

Each method does one fault and heals it after `seconds`; the caller's workload keeps running
throughout. Nodes are given by id (1..3); a leader is found by the caller (`Cluster.leader`).
"""
import time


class Nemesis:
    def __init__(self, cluster, history):
        self.cluster, self.history = cluster, history
        history.on_fault = cluster.mark  # fault windows in the node logs, with wall-clock times

    def kill9_restart(self, n, seconds=0.5):
        """kill -9 node n, leave it down `seconds`, restart it on the same data directory."""
        node = self.cluster.node(n)
        with self.history.fault(f"kill -9 n{n}"):
            node.kill9()
            time.sleep(seconds)
            node.start()

    def power_cut_restart(self, n, seconds=0.5):
        """Cut node n's power (it runs on the power-loss simulator: what it had not fsynced is
        dropped, then it dies as by SIGKILL), leave it down `seconds`, restart it on what is left."""
        node = self.cluster.node(n)
        with self.history.fault(f"power cut n{n}"):
            dropped = node.power_cut()
            self.history.event(f"n{n}", dropped[dropped.find("files="):] or dropped)  # what the cut dropped
            time.sleep(seconds)
            node.start()

    def power_cut_all_restart(self, seconds=0.5):
        """A data-centre power loss: every node's power cut at the same moment (the signals go out
        back to back, before any node is waited for), all down `seconds`, then all started again with
        their default options (no operator, no recovery-mode flag)."""
        with self.history.fault("power cut all"):
            sent = [(node, node.cut_power()) for node in self.cluster]
            for node, offset in sent:
                dropped = node.wait_power_cut(offset)
                self.history.event(f"{node}", dropped[dropped.find("files="):] or dropped)
            time.sleep(seconds)
            self.cluster.start()

    def graceful_restart(self, n, seconds=0.5):
        """Stop node n with SIGTERM (a clean shutdown: it must exit 0), leave it down `seconds` (an
        upgrade swaps the binary), start it again."""
        node = self.cluster.node(n)
        with self.history.fault(f"restart n{n}"):
            code = node.terminate()
            assert code == 0, f"{node} exited with {code} on SIGTERM:\n{node.log_tail()}"
            time.sleep(seconds)
            node.start()

    def kill9_all_restart(self, seconds=0.5):
        """kill -9 every node at once, then restart them all."""
        with self.history.fault("kill -9 all"):
            for node in self.cluster:
                node.kill9()
            time.sleep(seconds)
            self.cluster.start()

    def pause_resume(self, n, seconds):
        """SIGSTOP node n for `seconds` (past the election timeout, for a leader), then SIGCONT."""
        node = self.cluster.node(n)
        with self.history.fault(f"SIGSTOP n{n} {seconds}s"):
            node.pause()
            try:
                time.sleep(seconds)
            finally:
                node.resume()

    def isolate_heal(self, n, seconds, clients=False):
        """Cut node n from both peers (and from the clients, with `clients`) for `seconds`."""
        topo = self.cluster.topology
        with self.history.fault(f"isolate n{n}{' and its clients' if clients else ''} {seconds}s"):
            topo.isolate(n, clients=clients)
            try:
                time.sleep(seconds)
            finally:
                topo.heal_all()

    def cut_heal(self, a, b, seconds):
        """Cut only the a-b link for `seconds`: both still reach the third node."""
        topo = self.cluster.topology
        with self.history.fault(f"cut n{a}-n{b} {seconds}s"):
            topo.cut(a, b)
            try:
                time.sleep(seconds)
            finally:
                topo.heal(a, b)

    def one_way_heal(self, a, b, seconds):
        """Drop what node a sends to node b (b's packets still reach a) for `seconds`."""
        topo = self.cluster.topology
        with self.history.fault(f"drop n{a}->n{b} {seconds}s"):
            topo.one_way(a, b)
            try:
                time.sleep(seconds)
            finally:
                topo.heal(a, b)

    def cut_client_heal(self, n, seconds):
        """Cut the test clients off node n (n still reaches its peers) for `seconds`."""
        topo = self.cluster.topology
        with self.history.fault(f"clients cut from n{n} {seconds}s"):
            topo.cut_client(n)
            try:
                time.sleep(seconds)
            finally:
                topo.heal_client(n)
