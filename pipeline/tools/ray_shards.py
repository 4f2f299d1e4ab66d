"""Run generate or extract over a Ray cluster: one Ray task per shard, then the merge.

Run as: python -m pipeline.tools.ray_shards --address HEAD:PORT --config PROFILE \
            --stage generate --shards 64 [section.field=value ...]

Ray is the scheduler; the project adds nothing of its own but the shard contract
(:mod:`pipeline.core.shards`). Each task runs ``python -m pipeline.<stage> run.shard=k/S`` in the
same repository folder on its node (a container image, or the same checkout everywhere), so a
shard does exactly what the stage does on one box, against the vLLM server of its own node
(generate: ``generate.replica_urls`` or a server it starts; extract: the server it starts).

Invariants:
- shard ``k`` goes to alive node ``k mod N`` by *soft* node affinity: spread, and when a node
  is lost, its tasks run again elsewhere (Ray's ``max_retries``); a hard affinity or a custom
  resource of a dead node would leave its task pending forever;
- the stage runs under the project's server guard, owned by the Ray worker: when the node is
  lost (its worker killed), the stage and the servers it started stop too;
- a shard whose manifest is already written is not run again; a shard that failed resumes
  from what it finished (the stage's own resume), on whichever node runs it next;
- a stage's user error (exit status 2: a bad config, a dead server) is not retried: every
  retry would fail alike; a crash or a lost node is, up to ``--retries`` times;
- every wait has a bound (``--timeout-s``): a task that can never be scheduled fails the run
  instead of hanging it; the merge runs only when every shard finished.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_json
from pipeline.core.config import load_profile
from pipeline.core.errors import PipelineError
from pipeline.core.progress import progress
from pipeline.core.shards import SHARDED_STAGES, Shard, shard_folder
from pipeline.serving.logged_process import log_tail
from pipeline.serving.server_guard import start_guarded, stop_guarded

RECORD = "ran-by-ray.json"
USER_ERROR = 2  # a stage's exit status for an error its message explains (pipeline.core.cli)


class ShardCrashed(RuntimeError):
    """A shard's stage died (not a user error): Ray runs the task again."""


def run_shard(cmd: list[str], cwd: str, log_path: str) -> dict[str, Any]:
    """Ray task body: the stage for one shard, its output to ``log_path``; where and how it
    ran. Raises ShardCrashed for a crash (retried), returns the status of a user error."""
    import ray

    started = time.monotonic()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        env = {**os.environ, "PROGRESS": "0", "PYTHONPATH": cwd}
        proc, start = start_guarded(cmd, log, env=env, cwd=cwd)
        try:
            status = proc.wait()
        finally:
            stop_guarded(proc, start)
    if status not in (0, USER_ERROR):
        raise ShardCrashed(f"{cmd[-1]}: exit status {status}: {log_tail(Path(log_path), 3)}")
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "status": status,
        "wall_time_s": round(time.monotonic() - started, 1),
        "log": log_path,
    }


def stage_command(stage: str, config: str, overrides: list[str], shard: Shard | None) -> list[str]:
    cmd = [sys.executable, "-m", f"pipeline.{stage}", "--config", config, *overrides]
    return [*cmd, f"run.shard={shard}"] if shard else [*cmd, "--merge"]


def check_fits(nodes: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """A shard must fit some node, and on GPU nodes hold GPUs: a task no node can hold would
    wait forever, and shards sharing a node's GPUs would start vLLM servers over each other."""
    gpus = max(n["Resources"].get("GPU", 0) for n in nodes)
    cpus = max(n["Resources"].get("CPU", 0) for n in nodes)
    if gpus and not args.gpus_per_shard:
        raise PipelineError(
            f"the Ray cluster has GPU nodes (up to {gpus:g} GPUs): set --gpus-per-shard to a "
            "node's GPUs (8 for the hero), so that one shard holds a node's GPUs at a time"
        )
    if args.gpus_per_shard > gpus or args.cpus_per_shard > cpus:
        raise PipelineError(
            f"no node of the Ray cluster has {args.gpus_per_shard:g} GPUs and "
            f"{args.cpus_per_shard:g} CPUs for a shard (at most {gpus:g} GPUs, {cpus:g} CPUs): "
            "lower --gpus-per-shard / --cpus-per-shard"
        )


def run_shards(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    profile = load_profile(args.config, args.overrides)
    stage_folder = profile.run.run_dir / args.stage
    shards = [Shard(k, args.shards) for k in range(args.shards)]
    todo = [s for s in shards if not (shard_folder(stage_folder, s) / "manifest.json").is_file()]
    ray.init(address=args.address, logging_level="WARNING", log_to_driver=False)
    try:
        alive = [n for n in ray.nodes() if n["Alive"]]
        check_fits(alive, args)
        nodes = sorted(n["NodeID"] for n in alive)
        task = ray.remote(
            num_cpus=args.cpus_per_shard,
            num_gpus=args.gpus_per_shard,
            max_retries=args.retries,
            retry_exceptions=[ShardCrashed],
        )(run_shard)
        pending = {
            task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    nodes[s.index % len(nodes)], soft=True
                )
            ).remote(
                stage_command(args.stage, args.config, args.overrides, s),
                os.getcwd(),
                str((stage_folder / "shards" / f"{s.name}.log").absolute()),
            ): s
            for s in todo
        }
        done: dict[str, Any] = {}
        failed: dict[str, str] = {}
        deadline = time.monotonic() + args.timeout_s
        with progress(total=len(shards), initial=len(shards) - len(todo), desc=args.stage,
                      unit="shard") as bar:  # fmt: skip
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(
                        f"{args.stage}: {len(pending)} shards unfinished after --timeout-s "
                        f"{args.timeout_s} ({', '.join(str(s) for s in pending.values())}); "
                        "finished shards are kept: rerun to do the rest"
                    )
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 30))
                for ref in ready:
                    shard = pending.pop(ref)
                    try:
                        result = ray.get(ref)
                    except (ShardCrashed, ray.exceptions.RayError) as err:
                        failed[str(shard)] = str(err).strip().splitlines()[-1]
                    else:
                        if result["status"] == USER_ERROR:
                            failed[str(shard)] = log_tail(Path(result["log"]), 1)
                        else:
                            done[str(shard)] = {**result, "log": Path(result["log"]).name}
                    bar.update(1)
    finally:
        ray.shutdown()
    if failed:
        raise PipelineError(
            f"{args.stage}: {len(failed)} of {len(shards)} shards failed ("
            + "; ".join(f"{s}: {why}" for s, why in failed.items())
            + f"); their logs are in {stage_folder / 'shards'}; finished shards are kept: fix "
            "it and rerun"
        )
    # Where each shard ran this time (its last attempt), beside the shards: for the merge's
    # reader, and for a post-mortem of a lost node.
    record = stage_folder / "shards" / RECORD
    atomic_write_json(record, {"shards": len(shards), "ran": done, "already_finished": [
        str(s) for s in shards if s not in todo]})  # fmt: skip
    summary = {"stage": args.stage, "counts": {"shards": len(shards), "ran": len(done)}}
    if not args.no_merge:
        merge = stage_command(args.stage, args.config, args.overrides, None)
        proc = subprocess.run(merge, check=False)
        if proc.returncode:
            raise PipelineError(f"{args.stage} --merge failed (exit status {proc.returncode})")
        summary["merged"] = True
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.ray_shards")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="the Ray cluster's head, HOST:PORT (default: $RAY_ADDRESS)")  # fmt: skip
    p.add_argument("--config", required=True)
    p.add_argument("--stage", required=True, choices=SHARDED_STAGES)
    p.add_argument("--shards", type=int, required=True, help="S: many more than the nodes")
    p.add_argument("--retries", type=int, default=3, help="reruns of a lost or crashed shard")
    p.add_argument("--cpus-per-shard", type=float, default=1,
                   help="Ray CPUs a shard holds (CPU nodes: all of a node's)")  # fmt: skip
    p.add_argument("--gpus-per-shard", type=float, default=0,
                   help="GPUs a shard holds: a whole node's (8 for the hero), so that its "
                   "server gets them (Ray sets CUDA_VISIBLE_DEVICES)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=7 * 24 * 3600)
    p.add_argument("--no-merge", action="store_true", help="leave the merge to a later call")
    p.add_argument("overrides", nargs="*", help="section.field=value, as for every stage")
    return p


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import report

    args = parser().parse_args(argv)
    if not args.address:
        sys.exit("error: no Ray cluster: pass --address HEAD:PORT or set RAY_ADDRESS")
    if args.shards < 1:
        sys.exit("error: --shards must be at least 1")
    report(lambda: run_shards(args))


if __name__ == "__main__":
    main()
