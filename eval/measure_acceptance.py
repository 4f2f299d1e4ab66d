"""Stage `eval`: acceptance of the trained EAGLE-3 drafter against its verifier, in vLLM.

Run as: python -m eval.measure_acceptance --config configs/tiny.yaml

Reads the `verifier` and `train` stages and the held-out prompts (``data.eval_dataset``).
Serves the verifier twice on the same flags, without speculation and with the drafter
(``method: eagle3``, ``k = eval.num_speculative_tokens``), sends the same greedy requests to
each, and writes ``<run>/eval/results.json`` (with ``results.md`` and a plot): acceptance
rate, mean acceptance length and per-position acceptance from ``/metrics`` counter deltas,
time per output token and speedup against the paired run, and whether the greedy outputs are
identical.

Invariants: the verifier and capture-layer ids the drafter was trained with are those served;
a run with no accepted token (acceptance length exactly 1.0) is an error, not a result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from eval.spec_decode_metrics import acceptance, scrape
from pipeline.build_verifier import resolved_verifier
from pipeline.chat_client import ChatClient
from pipeline.config import Profile
from pipeline.errors import PipelineError
from pipeline.manifest import (
    atomic_write_bytes,
    atomic_write_json,
    now,
    read_manifest,
    stage_dir,
    write_manifest,
)
from pipeline.progress import progress
from pipeline.prompts import PromptRow, data_revision, load_prompts
from pipeline.vllm_server import Endpoint, vllm_server

log = logging.getLogger(__name__)


class EvalError(PipelineError):
    """An evaluation whose numbers cannot be trusted; the message says what to check."""


def eval_prompts(profile: Profile) -> list[PromptRow]:
    d = profile.data
    return load_prompts(d.eval_dataset, d.eval_revision, d.eval_split, d.eval_max_samples)


async def _send_all(endpoint: Endpoint, profile: Profile, rows: list[PromptRow], desc: str):
    sem = asyncio.Semaphore(profile.eval.concurrency)
    results: dict[str, dict[str, Any]] = {}
    bar = progress(total=len(rows), desc=desc, unit="prompt")
    client = ChatClient(
        endpoint.v1,
        concurrency=profile.eval.concurrency,
        request_timeout_s=profile.generate.request_timeout_s,
        max_retries=profile.generate.max_retries,
    )
    async with client:

        async def one(row: PromptRow) -> None:
            body = {
                "model": endpoint.model,
                "messages": row.first_exchange_prompt(),
                "max_tokens": profile.eval.max_tokens,
                "temperature": 0.0,
                "seed": profile.run.seed,
            }
            async with sem:
                t0 = time.perf_counter()
                reply = await client.complete(body)
                latency = time.perf_counter() - t0
            results[row.id] = {
                "source": row.source,
                "text": reply["choices"][0]["message"].get("content") or "",
                "completion_tokens": reply["usage"]["completion_tokens"],
                "latency_s": latency,
            }
            bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(r) for r in rows))
        wall = time.perf_counter() - t0
    bar.close()
    return results, wall


def measure_run(
    profile: Profile,
    rows: list[PromptRow],
    log_path: Path,
    drafter: str | None,
    *,
    use_base_url: bool = False,
) -> dict[str, Any]:
    """Serve (or reach) the verifier, with ``drafter`` as EAGLE-3 if given; measure ``rows``."""
    k = profile.eval.num_speculative_tokens
    spec = None
    if drafter is not None:
        spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": k}
    verifier = resolved_verifier(profile)["model"]
    label = "eagle3" if drafter or use_base_url else "baseline"
    with vllm_server(
        profile, verifier, log_path, use_base_url=use_base_url, speculative_config=spec
    ) as endpoint:
        before = scrape(endpoint.base_url)
        outputs, wall = asyncio.run(_send_all(endpoint, profile, rows, f"eval {label}"))
        delta = scrape(endpoint.base_url) - before
    tokens = sum(o["completion_tokens"] for o in outputs.values())
    latency = sum(o["latency_s"] for o in outputs.values())
    return {
        "label": label,
        "drafter": drafter,
        "prompts": len(rows),
        "output_tokens": tokens,
        "wall_time_s": round(wall, 3),
        "output_tokens_per_s": tokens / wall if wall else None,
        # Per-request latency over tokens: at concurrency 1 this is the mean time per token.
        "time_per_output_token_s": latency / tokens if tokens else None,
        **(acceptance(delta, k) if spec or use_base_url else {}),
        "outputs": outputs,
    }


def check_drafter_matches(profile: Profile, train_outputs: dict[str, Any]) -> None:
    verifier = resolved_verifier(profile)
    trained_on = train_outputs["verifier"]
    served = {
        "model": verifier["model"],
        "capture_layer_ids": verifier["capture_layer_ids"],
        "chat_template_sha256": verifier["chat_template_sha256"],
    }
    for key, want in served.items():
        if trained_on.get(key) != want:
            raise EvalError(
                f"the drafter was trained with {key}={trained_on.get(key)!r} but the served "
                f"verifier has {key}={want!r}; retrain (`make train`) or serve the right verifier"
            )


def check_acceptance(result: dict[str, Any]) -> None:
    if not result.get("drafts"):
        raise EvalError(
            "the drafter ran no draft step: vLLM's spec-decode counters did not move. Check "
            "that --speculative-config reached the server (method 'eagle3') and its log"
        )
    if result["accepted_tokens"] == 0:
        raise EvalError(
            "the drafter had 0 accepted tokens (mean acceptance length exactly 1.0): check the "
            "drafter's capture-layer ids, its verifier and draft vocabulary, and that it trained"
        )


def plot_per_position(summary: dict[str, Any], path: Path) -> dict[str, str]:
    """A bar chart of per-position acceptance (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = summary["per_position_acceptance"]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.bar([str(i + 1) for i in range(len(rates))], rates, color="#3b6ea8")
    for i, r in enumerate(rates):
        ax.text(i, r + 0.01, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title(
        f"EAGLE-3 per-position acceptance (k={summary['num_speculative_tokens']}, "
        f"mean length {summary['mean_acceptance_length']:.2f})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return {"file": path.name, "title": "Per-position acceptance"}


def results_table(summary: dict[str, Any]) -> str:
    rows = [
        ("draft tokens per step (k)", summary["num_speculative_tokens"]),
        ("acceptance rate", f"{summary['acceptance_rate']:.3f}"),
        ("mean acceptance length", f"{summary['mean_acceptance_length']:.3f}"),
        *(
            (f"acceptance at position {i + 1}", f"{r:.3f}")
            for i, r in enumerate(summary["per_position_acceptance"])
        ),
    ]
    if "speedup" in summary:
        rows.append(("speedup (time per output token)", f"{summary['speedup']:.2f}x"))
        rows.append(("greedy outputs identical", summary["greedy_outputs_identical"]))
    return "| metric | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "eval")
    folder.mkdir(parents=True, exist_ok=True)
    train = read_manifest(profile, "train")["outputs"]
    rows = eval_prompts(profile)
    if profile.server.base_url:
        # A running deployment: measure it as it is; it has no paired baseline here.
        runs = {"eagle3": measure_run(profile, rows, folder / "vllm.log", None, use_base_url=True)}
    else:
        check_drafter_matches(profile, train)
        runs = {
            "baseline": measure_run(profile, rows, folder / "vllm-baseline.log", None),
            "eagle3": measure_run(profile, rows, folder / "vllm-eagle3.log", train["drafter"]),
        }
    eagle = runs["eagle3"]
    check_acceptance(eagle)
    summary = {k: v for k, v in eagle.items() if k != "outputs"}
    if "baseline" in runs:
        base = runs["baseline"]
        summary["baseline_time_per_output_token_s"] = base["time_per_output_token_s"]
        summary["speedup"] = base["time_per_output_token_s"] / eagle["time_per_output_token_s"]
        mismatched = [
            pid for pid, o in base["outputs"].items() if eagle["outputs"][pid]["text"] != o["text"]
        ]
        summary["greedy_outputs_identical"] = not mismatched
        summary["mismatched_prompt_ids"] = mismatched
    plots = [plot_per_position(summary, folder / "acceptance_per_position.png")]
    results = {"drafter": train["drafter"], "summary": summary, "plots": plots, "runs": runs}
    atomic_write_json(folder / "results.json", results)
    atomic_write_bytes(folder / "results.md", results_table(summary).encode())
    log.info(
        "eval: acceptance rate %.3f (k=%d), mean acceptance length %.3f, speedup %s",
        summary["acceptance_rate"],
        summary["num_speculative_tokens"],
        summary["mean_acceptance_length"],
        f"{summary['speedup']:.2f}x" if "speedup" in summary else "n/a",
    )
    return write_manifest(
        profile,
        "eval",
        started_at=started,
        counts={"input": len(rows), "succeeded": len(rows), "skipped": 0, "failed": 0},
        outputs={"results": "results.json", "summary": summary},
        inputs=("verifier", "train"),
        data_revision=data_revision(profile.data.eval_dataset, profile.data.eval_revision),
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import run_stage

    run_stage("eval", run, argv)


if __name__ == "__main__":
    main()
