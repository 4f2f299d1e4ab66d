"""Keep a stage's server from outliving the stage: a small guard process between the two.

A stage starts ``python -m pipeline.serving.server_guard --owner <stage pid> -- <server
command>`` in a new session. The guard is the leader of the server's process group, runs the
command as its
child in that group, and exits with the command's status, so the stage sees the server's exit
as before. A stage killed outright (SIGKILL skips every ``finally``) leaves nobody to stop a
server whose engine and worker processes are grandchildren of the stage; the guard does it.
In a server container (``server.runtime=docker``) the guard is the container's first process
and watches the stage through ``--lifeline host:port`` instead: a loopback connection the stage
holds open, which the kernel closes when the stage ends, however it ends, even when the whole
pipeline container is killed. The container then exits, and the engine removes it.

Invariants:
- when the owner is gone, by any signal, the guard stops the whole group within about a second
  (PR_SET_PDEATHSIG on Linux wakes it; a poll of its parent process, or of the lifeline, backs
  that up): SIGTERM to the group, SIGKILL to whatever is left after the grace period;
- SIGTERM, SIGINT or SIGHUP to the guard means the group is being stopped (the stage sends
  SIGTERM to the whole group once): the guard waits up to the grace period for the server, then
  stops what is left of the group and of its descendants (it is their subreaper, so a worker
  that left the group and lost its parent is still one), and exits;
- the guard exits with the server's status, and dies of the server's signal if it died of one;
- a process is named by its pid and its kernel start time (:func:`owner_id`), so a recycled pid
  is never taken for the process that once had it; the stage records each server's group with
  its owner (``pipeline.serving.vllm_server``), and the next start in the same run reaps the
  group of an owner that is gone, which covers a guard that was itself SIGKILLed.

Deliberately free of the pipeline's imports: it starts before every server.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import psutil

MODULE = "pipeline.serving.server_guard"
POLL_S = 0.2
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 15.0


def process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), after "pid (comm)"


def owner_id(pid: int | None = None) -> str:
    """A process, unambiguously: a recycled pid in a fresh container has another start time."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{process_start(pid)}"


def owner_alive(owner: str) -> bool:
    """Whether the process :func:`owner_id` named still runs; another host's is assumed to."""
    host, _, rest = owner.partition(":")
    pid, _, ticks = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's process: not ours to judge
    return process_start(int(pid)) == ticks


def guarded(cmd: list[str], grace_s: float = GRACE_S) -> list[str]:
    """``cmd`` under a guard that stops it, and its process group, once this process is gone.
    Start it with ``start_new_session=True``, so that the guard leads a group of its own."""
    guard = [sys.executable, "-m", MODULE, "--owner", str(os.getpid()), "--grace-s", str(grace_s)]
    return [*guard, "--", *cmd]


def start_guarded(
    cmd: list[str], stdout: IO[bytes], env: dict[str, str] | None = None, cwd: str | None = None
) -> tuple[subprocess.Popen, str | None]:
    """Start ``cmd`` under a guard, in a session of its own, its output to ``stdout``; the
    guard's process and its kernel start time (for :func:`stop_guarded`)."""
    proc = subprocess.Popen(
        guarded(cmd),
        stdout=stdout,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    return proc, process_start(proc.pid)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_members(pgid: int, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """The live (not zombie) processes of process group ``pgid``."""
    skip = set(exclude)
    found = []
    for p in psutil.process_iter():
        if p.pid in skip:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(p.pid) == pgid and _alive(p):
                found.append(p)
    return found


def terminate(procs: Iterable[psutil.Process], grace_s: float) -> None:
    """SIGTERM ``procs``, SIGKILL those still alive after ``grace_s``, wait until all are gone."""
    procs = [p for p in procs if _alive(p)]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        deadline = time.monotonic() + wait_s
        while (procs := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not procs:
            return


def stop_group(pgid: int, grace_s: float, exclude: Iterable[int] = ()) -> int:
    """Stop every process of group ``pgid`` but ``exclude``; how many there were."""
    exclude = set(exclude)
    stopped = 0
    for _ in range(3):  # a member may fork while the others are stopped
        members = group_members(pgid, exclude)
        if not members:
            break
        stopped += len(members)
        terminate(members, grace_s)
    return stopped


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):  # elsewhere the poll of the parent process still works
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _leftovers(me: int) -> list[psutil.Process]:
    """This guard's descendants (orphans are re-parented to it) and the rest of its group."""
    found = {p.pid: p for p in psutil.Process(me).children(recursive=True) if _alive(p)}
    found |= {p.pid: p for p in group_members(me, exclude={me})}
    return list(found.values())


def reap_adopted(child: int) -> None:
    """Wait for the orphans this subreaper adopted and that have exited (no zombies piling up
    over a long server run); the server itself is waited for by ``Popen``."""
    for p in psutil.Process().children():
        if p.pid != child:
            with contextlib.suppress(ChildProcessError, psutil.NoSuchProcess):
                if p.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(p.pid, os.WNOHANG)


def stop_guarded(proc: subprocess.Popen, start: str | None, grace_s: float = GRACE_S) -> None:
    """Stop a command started under :func:`guarded` (``start``: its kernel start time): SIGTERM
    to its group, for the guard to stop the command and sweep its descendants; SIGKILL to the
    group if the guard outlasts its own worst case; then whatever is left of the group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=4 * grace_s + 40)  # the guard's grace periods, and a margin
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    stop_group_of(proc.pid, start, grace_s)


def stop_group_of(pgid: int, start: str | None, grace_s: float = GRACE_S) -> int:
    """Stop what is left of the group whose leader was ``pgid`` started at ``start``; how many.

    A live leader with another start time is a recycled pid: nothing is stopped. A dead leader's
    group id stays reserved while any member lives, so its members are the server's.
    """
    now = process_start(pgid)
    return stop_group(pgid, grace_s) if now is None or now == start else 0


def _exit_like(status: int) -> None:
    if status < 0:  # died of a signal: so does the guard, and its parent sees the same
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's action is always the default
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        status = 128 - status
    sys.exit(status)


def parent_is(owner: int) -> Callable[[], bool]:
    """Whether ``owner``, the guard's parent, still runs: the parent-death signal wakes the
    guard when it goes."""
    signal.signal(signal.SIGUSR1, lambda *_: None)  # the parent-death signal: it only wakes us
    _prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    return lambda: os.getppid() == owner


def lifeline(address: str) -> Callable[[], bool]:
    """Whether the owner still holds the loopback connection it listens for at ``address``
    (``host:port``); the kernel closes it however the owner ends, SIGKILL included. For a
    guard in a container, where the owner's pid means nothing."""
    host, _, port = address.rpartition(":")
    try:
        line = socket.create_connection((host, int(port)), timeout=10)
    except OSError:
        return lambda: False  # the owner is gone already
    line.setblocking(False)

    def held() -> bool:
        try:
            return line.recv(1, socket.MSG_PEEK) != b""  # the owner never sends: b"" is EOF
        except BlockingIOError:
            return True
        except OSError:
            return False

    return held


def guard(owner_alive: Callable[[], bool], cmd: list[str], grace_s: float) -> int:
    """Run ``cmd`` in this process group while ``owner_alive()``; its status."""
    stopping: list[int] = []

    def on_stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_stop)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # the server's orphaned workers stay our descendants
    if not owner_alive():  # gone before the guard could watch it
        return 1
    me = os.getpid()
    if os.getpgrp() != me:
        os.setpgid(0, 0)
    if stopping:  # stopped before the server started: start nothing
        return 128 + stopping[0]
    child = subprocess.Popen(cmd)
    while child.poll() is None:
        owner_gone = not owner_alive()
        if owner_gone or stopping:
            if owner_gone:
                print(
                    f"server_guard: the stage is gone; stopping the server (group {me})",
                    file=sys.stderr,
                    flush=True,
                )
                os.killpg(me, signal.SIGTERM)  # the guard's own is caught by on_stop
            else:  # the group's SIGTERM may have come before the server was started
                child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            break
        reap_adopted(child.pid)
        time.sleep(POLL_S)
    for _ in range(3):  # one may fork while the others are stopped
        if not (rest := _leftovers(me)):
            break
        terminate(rest, grace_s)
    return child.returncode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.serving.server_guard")
    owner = parser.add_mutually_exclusive_group(required=True)
    owner.add_argument("--owner", type=int, help="the stage's pid (the guard's parent)")
    owner.add_argument("--lifeline", help="host:port where the stage holds a connection open")
    parser.add_argument("--grace-s", type=float, default=GRACE_S, help="SIGTERM to SIGKILL")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the server's command line")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no server command after --")
    alive = lifeline(args.lifeline) if args.lifeline else parent_is(args.owner)
    _exit_like(guard(alive, cmd, args.grace_s))


if __name__ == "__main__":
    main()
