"""Start the trainer's ranks on this node around a rendezvous store that listens only where told.

Run as: python -m pipeline.training.ranks --nproc-per-node N --store HOST:PORT
                                          [--nnodes M --node-rank R] -m MODULE [ARGS...]

torchrun (torch 2.13) opens its c10d store, and its agent a second one, on every interface
whatever ``--rdzv-endpoint`` or ``--master-addr`` names; so does ``init_process_group("env://")``
on rank 0. Those stores have no authentication. This launcher plays torchrun's part for one
attempt (no elastic restarts): node 0's launcher binds a socket to HOST:PORT itself and hands
it to a ``TCPStore`` (``master_listen_fd``), and every rank, node 0's included, is a client of
that store, through torch's own contract for a store an agent hosts
(``TORCHELASTIC_USE_AGENT_STORE``). So the trainer's stock ``init_process_group`` (env://)
works unchanged, and the store listens on HOST alone: 127.0.0.1 on one node, the private
fabric's address of node 0 across nodes.

Invariants:
- the launchers' only listener is the store on HOST:PORT, opened by node 0's launcher alone
  before any rank starts; an address of every interface (``0.0.0.0``, ``::``,
  ``::ffff:0.0.0.0``) is refused;
- each rank gets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  GROUP_RANK, MASTER_ADDR, MASTER_PORT), global ranks numbered node by node;
- the first rank to fail, on any node, stops every rank: its launcher names it on stderr and
  in the store, the other launchers see that within a second and stop theirs (SIGTERM, then
  SIGKILL after a grace period); a launcher exits with its own failed rank's status, 1 when
  another node failed, 128 + N on signal N (SIGTERM, SIGINT, SIGHUP: the ranks are stopped);
- node 0 keeps the store up until every node's ranks have ended (an exit barrier, bounded by
  ``STORE_TIMEOUT_S``). The stage runs the launcher under ``pipeline.serving.server_guard``,
  which stops the whole process group if the stage itself dies.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from pipeline.core.config import binds_one_interface

MODULE = "pipeline.training.ranks"
GRACE_S = 15.0
POLL_S = 0.2
STORE_POLL_S = 1.0
STORE_TIMEOUT_S = 900  # a node waits this long for node 0's store, node 0 for the others to end
# The launchers' own keys in the store (the ranks' process groups use other prefixes).
FAILED = "eagle3-launcher/failed"
DONE = "eagle3-launcher/done"


def store_endpoint(value: str) -> tuple[str, int]:
    """HOST:PORT, an IP address (IPv6 in brackets) of one interface, as (host, port)."""
    host, sep, port = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    try:
        address = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--store {value!r}: expected IP:PORT") from None
    if not sep or not 0 < number < 65536 or bracketed != (address.version == 6):
        raise argparse.ArgumentTypeError(f"--store {value!r}: expected IP:PORT ([IPv6]:PORT)")
    if not binds_one_interface(address):
        raise argparse.ArgumentTypeError(
            f"--store {value!r} names no single interface: the store would listen on every one"
        )
    return host, number


@contextmanager
def hosted_store(host: str, port: int, world_size: int) -> Iterator[object]:
    """A TCPStore server listening on ``host:port`` and nowhere else, for the life of the block;
    it is also the launcher's own handle on the store."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise SystemExit(
            f"rendezvous store: cannot listen on {host}:{port} ({exc.strerror}); on one node "
            "rerun (a free port is picked each time); across nodes set train.nodes.store_port "
            "to a free port and train.nodes.store_address to an address of node 0"
        ) from None
    listener.listen(max(world_size, 16))
    store = TCPStore(
        host, port, world_size, True, timeout=timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=False,
    )  # fmt: skip
    listener.detach()  # the store owns the socket now, and closes it when it stops
    try:
        yield store
    finally:
        del store


@contextmanager
def joined_store(host: str, port: int) -> Iterator[object]:
    """A client of node 0's store, once node 0 hosts it (up to ``STORE_TIMEOUT_S``)."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, port, None, False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    except RuntimeError as exc:  # torch's DistNetworkError and timeouts
        raise SystemExit(
            f"rendezvous store: node 0's store at {host}:{port} was not reachable within "
            f"{STORE_TIMEOUT_S} s ({str(exc).splitlines()[0]}); start node 0, and check that "
            "this node reaches that address and port on the fabric"
        ) from None
    try:
        yield store
    finally:
        del store


def rank_env(
    base: dict[str, str], host: str, port: int, nproc: int, nnodes: int, node_rank: int, local: int
) -> dict[str, str]:
    """What torchrun would set for one rank, with the store hosted by the launcher."""
    env = dict(base)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: ranks share this node's cores
    return env | {
        "RANK": str(node_rank * nproc + local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(nnodes * nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def stop(ranks: list[subprocess.Popen]) -> None:
    """SIGTERM to every rank still running, SIGKILL to those left after the grace period."""
    for proc in ranks:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in ranks:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def status_of(code: int) -> int:
    """A child's return code as an exit status (a signal N as 128 + N)."""
    return code if code >= 0 else 128 - code


class Signalled:
    """SIGTERM, SIGINT and SIGHUP noted, not acted on in the handler: the wait loop stops the
    ranks once, outside any Popen call the signal may have interrupted."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.signum = self.signum or signum


def wait_for_ranks(
    ranks: list[subprocess.Popen], store, node_rank: int, signalled: Signalled
) -> int:
    """0 once every rank of this node has exited cleanly. The first failure anywhere (a rank
    here, or a ``FAILED`` key another node's launcher set) or a signal stops the ranks here;
    the status is the failed rank's, 1 for another node's failure, 128 + N for a signal."""
    last_check = 0.0
    while True:
        if signalled.signum is not None:
            stop(ranks)
            return 128 + signalled.signum
        for local, proc in enumerate(ranks):
            code = proc.poll()
            if code not in (None, 0):
                why = f"node {node_rank} rank {local} (pid {proc.pid}) exited with {code}"
                print(f"{MODULE}: {why}; stopping the others", file=sys.stderr, flush=True)
                store.set(FAILED, why)
                stop(ranks)
                return status_of(code)
        if all(proc.poll() == 0 for proc in ranks):
            return 0
        if time.monotonic() - last_check > STORE_POLL_S:
            last_check = time.monotonic()
            if store.check([FAILED]):
                why = store.get(FAILED).decode()
                print(f"{MODULE}: {why}; stopping this node's ranks", file=sys.stderr, flush=True)
                stop(ranks)
                return 1
        time.sleep(POLL_S)


def exit_barrier(store, nnodes: int, signalled: Signalled) -> int:
    """Node 0 keeps its store up until every node's ranks have finished (or one failed)."""
    done = [f"{DONE}/{node}" for node in range(nnodes)]
    deadline = time.monotonic() + STORE_TIMEOUT_S
    while not store.check(done):
        if store.check([FAILED]):
            print(f"{MODULE}: {store.get(FAILED).decode()}", file=sys.stderr, flush=True)
            return 1
        if signalled.signum is not None:
            return 128 + signalled.signum
        if time.monotonic() > deadline:
            missing = [key for key in done if not store.check([key])]
            print(f"{MODULE}: no word from {missing} within {STORE_TIMEOUT_S} s", file=sys.stderr)
            return 1
        time.sleep(STORE_POLL_S)
    return 0


def launch(args: argparse.Namespace) -> int:
    host, port = args.store
    world_size = args.nnodes * args.nproc_per_node
    signalled = Signalled()
    command = [sys.executable, "-m", args.module, *args.args]
    first = args.node_rank == 0
    with hosted_store(host, port, world_size) if first else joined_store(host, port) as store:
        ranks: list[subprocess.Popen] = []
        for local in range(args.nproc_per_node):
            if signalled.signum is not None:
                break
            env = rank_env(
                dict(os.environ), host, port,
                args.nproc_per_node, args.nnodes, args.node_rank, local,
            )  # fmt: skip
            ranks.append(subprocess.Popen(command, env=env))
        status = wait_for_ranks(ranks, store, args.node_rank, signalled)
        if status:
            return status
        store.set(f"{DONE}/{args.node_rank}", "1")
        return exit_barrier(store, args.nnodes, signalled) if first else 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The launcher's own flags, then ``-m MODULE``: everything after MODULE is the rank's."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--store", type=store_endpoint, required=True, help="HOST:PORT")
    if "-m" not in argv or argv.index("-m") == len(argv) - 1:
        parser.error("name the ranks' entry point: -m MODULE [ARGS...]")
    split = argv.index("-m")
    args = parser.parse_args(argv[:split])
    args.module, args.args = argv[split + 1], argv[split + 2 :]
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        parser.error("need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    return args


def main(argv: list[str] | None = None) -> None:
    sys.exit(launch(parse(argv)))


if __name__ == "__main__":
    main()
