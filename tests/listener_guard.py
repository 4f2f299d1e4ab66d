"""Watch every socket a process tree listens on, for as long as a run lasts.

``ListenerGuard(roots)`` samples, on a thread, every ``interval_s`` (0.25 s by default, so a
listener that lives half a second is seen), the machine's TCP listeners and bound UDP sockets
(psutil, which reads the kernel's tables), and keeps those held by a process of the watched trees:
each root pid ``roots()`` returns at that moment, and all their descendants. A listener on an
address that is not loopback is a violation; :meth:`ListenerGuard.check` fails naming each one's
process (pid, name, command line), address and port. What it reads is the kernel's view, not our
flags: a server that says 127.0.0.1 and binds ``*`` is caught.

Roots are asked anew each sample, so a container's first process (whose tree the engine, not the
test, started) can be watched from the moment it exists. A process that leaves the tree (double
fork to init) is not seen: the pipeline's own servers and launchers stay under their stage or
their guard, which is what this watches.
"""

from __future__ import annotations

import contextlib
import ipaddress
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

INTERVAL_S = 0.25


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str  # name and command line, as far as it could be read
    protocol: str  # tcp or udp
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.address.split("%")[0])
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.protocol} {host}:{self.port} held by pid {self.pid} ({self.process})"


def describe(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        return f"{proc.name()}: {' '.join(proc.cmdline())[:300]}"
    except psutil.Error:
        return "gone"


def tree(roots: Iterable[int]) -> set[int]:
    """The roots and all their descendants that exist now."""
    pids: set[int] = set()
    for root in roots:
        try:
            proc = psutil.Process(root)
            pids.add(root)
            pids.update(child.pid for child in proc.children(recursive=True))
        except psutil.Error:
            continue
    return pids


def listeners(pids: set[int]) -> list[Listener]:
    """The TCP listeners and bound, unconnected UDP sockets held by ``pids``."""
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in pids or not conn.laddr:
            continue
        tcp = conn.type == psutil.socket.SOCK_STREAM
        listening = conn.status == psutil.CONN_LISTEN if tcp else not conn.raddr
        if not listening:
            continue
        protocol = "tcp" if tcp else "udp"
        found.append(Listener(conn.pid, "", protocol, conn.laddr.ip, conn.laddr.port))
    return found


class ListenerGuard:
    """Samples the watched trees' listeners on a thread while the ``with`` block runs."""

    def __init__(self, roots: Callable[[], Iterable[int]], interval_s: float = INTERVAL_S):
        self.roots = roots
        self.interval_s = interval_s
        self.samples = 0
        self.seen: dict[tuple[int, str, str, int], Listener] = {}
        self.errors: list[str] = []  # a sample that raised: the watch must not end unnoticed
        self.started = self.ended = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="listener-guard", daemon=True)

    def sample(self) -> None:
        for listener in listeners(tree(self.roots())):
            key = (listener.pid, listener.protocol, listener.address, listener.port)
            if key not in self.seen:  # named while the process is still there to name
                self.seen[key] = Listener(*key[:1], describe(listener.pid), *key[1:])
        self.samples += 1

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as err:  # e.g. a root lookup that failed: noted, then go on
                self.errors.append(repr(err))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ListenerGuard:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.ended = time.monotonic()

    @property
    def mean_interval_s(self) -> float:
        return ((self.ended or time.monotonic()) - self.started) / max(self.samples, 1)

    @property
    def beyond_loopback(self) -> list[Listener]:
        return [listener for listener in self.seen.values() if not listener.loopback]

    def check(self, what: str) -> None:
        """Fail if ``what`` listened beyond loopback, or was not watched every 0.5 s."""
        assert self.samples > 0, f"the listener guard never sampled {what}"
        assert not self.errors, f"the listener guard failed to sample {what}: {self.errors[:3]}"
        assert self.mean_interval_s <= 0.5, (
            f"the listener guard sampled {what} every {self.mean_interval_s:.2f} s on average"
        )
        bad = "\n".join(f"  {listener}" for listener in self.beyond_loopback)
        assert not bad, f"{what} listened beyond loopback ({self.samples} samples):\n{bad}"


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def run_watched(
    cmd: list[str],
    timeout: float,
    started: Callable[[subprocess.Popen], None] | None = None,
    **popen: object,
) -> tuple[subprocess.CompletedProcess, ListenerGuard]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` with its whole process tree's
    listeners watched from start to end (the guard is returned for the caller to check);
    ``started`` is handed the process as soon as it exists (e.g. to stop it from elsewhere)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    if started is not None:
        started(proc)
    with ListenerGuard(lambda: [proc.pid]) as guard:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # grandchildren hold the pipes open too
            out, err = proc.communicate(timeout=60)
            tails = f"{out[-3000:]}{err[-3000:]}"
            raise AssertionError(f"{cmd[:4]} ran past {timeout} s:\n{tails}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), guard
