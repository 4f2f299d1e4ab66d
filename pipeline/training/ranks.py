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
- the launcher's only listener is the store on HOST:PORT, opened on node 0 alone, before any
  rank starts, and closed when the launcher exits;
- each rank gets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  GROUP_RANK, MASTER_ADDR, MASTER_PORT), global ranks numbered node by node;
- the first rank to fail stops the others (SIGTERM, then SIGKILL after a grace period) and the
  launcher exits with that rank's status; SIGTERM, SIGINT or SIGHUP to the launcher stops the
  ranks the same way. The stage runs the launcher under ``pipeline.serving.server_guard``, which
  stops the whole group if the stage itself dies.
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

MODULE = "pipeline.training.ranks"
GRACE_S = 15.0
POLL_S = 0.2


def store_endpoint(value: str) -> tuple[str, int]:
    """HOST:PORT (an IP address, IPv6 in brackets) as (host, port)."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--store {value!r}: expected IP:PORT") from None
    if not sep or not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"--store {value!r}: expected IP:PORT") from None
    return host, number


@contextmanager
def hosted_store(host: str, port: int, world_size: int) -> Iterator[None]:
    """A TCPStore server listening on ``host:port`` and nowhere else, for the life of the block."""
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
        host, port, world_size, True,
        wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=False,
    )  # fmt: skip
    listener.detach()  # the store owns the socket now, and closes it when it stops
    try:
        yield None
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


def wait_for_ranks(ranks: list[subprocess.Popen]) -> int:
    """0 once every rank has exited cleanly; else the first failure's status, the rest stopped."""
    while True:
        codes = [proc.poll() for proc in ranks]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            stop(ranks)
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def launch(args: argparse.Namespace) -> int:
    host, port = args.store
    world_size = args.nnodes * args.nproc_per_node
    ranks: list[subprocess.Popen] = []

    def on_signal(signum: int, frame: object) -> None:
        stop(ranks)
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    command = [sys.executable, "-m", args.module, *args.args]
    with hosted_store(host, port, world_size) if args.node_rank == 0 else _no_store():
        for local in range(args.nproc_per_node):
            env = rank_env(
                dict(os.environ), host, port,
                args.nproc_per_node, args.nnodes, args.node_rank, local,
            )  # fmt: skip
            ranks.append(subprocess.Popen(command, env=env))
        return wait_for_ranks(ranks)


@contextmanager
def _no_store() -> Iterator[None]:
    yield None


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
