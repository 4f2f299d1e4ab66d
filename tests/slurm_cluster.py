"""A one-host Slurm cluster for the tests: munge, slurmctld and slurmd on 127.0.0.1 alone.

Debian's slurm-wlm (``make slurm-tools`` installs it) run as root with everything in a
temporary folder: its own munge key and socket, a minimal ``slurm.conf`` chosen through
``SLURM_CONF`` (one node, ``localhost`` at 127.0.0.1 with this machine's CPUs, one partition,
no accounting, no cgroups), and ``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny`` so that
no daemon binds every interface. The daemons run in the foreground as the test's children and
are stopped by pid (never ``scontrol shutdown``, which would reach any other cluster).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.serving.vllm_api import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue")


def missing_tools() -> list[str]:
    return [tool for tool in DAEMONS if shutil.which(tool) is None]


def slurm_conf(folder: Path, cpus: int) -> str:
    return f"""ClusterName=eagle3test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=main Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def slurm_cluster(folder: Path, cpus: int | None = None) -> Iterator[dict[str, str]]:
    """Start the cluster; yield the environment its clients need (SLURM_CONF, the munge
    socket); stop every daemon on the way out, however the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool", "munge"):
        (folder / sub).mkdir(exist_ok=True)
    key, socket = folder / "munge" / "munge.key", folder / "munge" / "munge.socket"
    subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
    os.chmod(key, 0o400)
    conf = folder / "slurm.conf"
    # AuthInfo: daemons and clients (sbatch, squeue) reach this munged, not the system's.
    conf.write_text(slurm_conf(folder, cpus or os.cpu_count() or 1) + f"AuthInfo=socket={socket}\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    try:
        munge_args = ["munged", "-f", "-F", "--key-file", str(key), "--socket", str(socket),
                      "--pid-file", str(folder / "munge" / "munged.pid"),
                      "--log-file", str(folder / "munge" / "munged.log"),
                      "--seed-file", str(folder / "munge" / "munged.seed")]  # fmt: skip
        procs.append(subprocess.Popen(munge_args, env=env))
        _wait_for(socket.exists, 20, "munged's socket")
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env))
        procs.append(
            subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], env=env)
        )
        _wait_for(lambda: _node_idle(env), 60, "slurmd to register as idle")
        yield env
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _node_idle(env: dict[str, str]) -> bool:
    proc = subprocess.run(
        ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False
    )
    return proc.returncode == 0 and "idle" in proc.stdout


def _wait_for(ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test's Slurm cluster: no {what} after {timeout_s} s")
        time.sleep(0.3)


def wait_for_jobs(env: dict[str, str], job: str, timeout_s: float) -> None:
    """Until ``job`` (an array too) has left the queue."""
    _wait_for(
        lambda: (
            not subprocess.run(
                ["squeue", "-h", "-j", job], env=env, capture_output=True, text=True, check=False
            ).stdout.strip()
        ),
        timeout_s,
        f"end of job {job}",
    )
