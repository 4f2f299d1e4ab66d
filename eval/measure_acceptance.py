"""Stage `eval`: acceptance, speedup and losslessness of the drafter against its verifier, in vLLM.

Run as: python -m eval.measure_acceptance --config configs/tiny.yaml
   or:  make eval BASE_URL=http://host:8000   (a deployment someone already runs)

Reads the `verifier`, `generate` (to prove the prompts are held out) and `train` stages and the
evaluation prompts (``eval/eval_prompts.py``). Serves the verifier once per arm on the same
flags: without speculation (the paired baseline), then vLLM's ngram drafter and our EAGLE-3
drafter at each k in ``eval.num_speculative_tokens``. Each arm sends the same greedy requests at
each level of ``eval.concurrency``; at concurrency 1 it goes category by category. Acceptance
comes from ``/metrics`` counter deltas around each batch (prometheus-client's parser), in
vLLM's conventions: acceptance rate (with k), mean acceptance length 1 + accepted / drafts,
per-position acceptance; then output tokens/s, time per output token and speedup against the
baseline at the same concurrency.

Writes ``<run>/eval/results.json`` (every arm and level, per category, losslessness, the
headline: the EAGLE-3 k with the best batch-size-1 speedup; the prompts skipped as too long for
the context), ``results.md``, three PNG plots, ``outputs.json`` (every response, with its token
ids), ``lm-eval/<arm>.json`` (lm-eval's scores and each document's response, with and without
the drafter) and ``manifest.json``.

Invariants (each a refusal or an error naming what to check, never a silent number):
- a prompt longer than ``server.max_model_len - eval.max_tokens`` tokens (the verifier's
  tokenizer and chat template) is skipped before any server starts and named, with its
  category and token count, in ``results.json`` and ``results.md``;
- the drafter's recorded verifier, capture-layer ids and chat-template hash are those served;
- an EAGLE-3 arm with no draft step, or 0 accepted tokens (acceptance length exactly 1.0);
- greedy outputs with each drafter are compared token by token with the baseline's, and
  lm-eval's scores with and without the drafter must match (``eval/lossless_lm_eval.py``);
  differences are reported by prompt or document id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval import lossless_lm_eval, plots
from eval.eval_prompts import (
    EvalPrompt,
    by_category,
    check_held_out,
    eval_data_revision,
    fit_to_context,
    load_eval_prompts,
    prompt_token_counts,
)
from eval.spec_decode_metrics import SpecDecodeCounters, acceptance, scrape
from pipeline.build_verifier import resolved_verifier
from pipeline.chat_client import ChatClient
from pipeline.config import Profile
from pipeline.errors import PipelineError
from pipeline.manifest import (
    atomic_write_bytes,
    atomic_write_json,
    drafter_digest,
    now,
    portable,
    read_manifest,
    stage_dir,
    write_manifest,
)
from pipeline.progress import progress
from pipeline.vllm_server import Endpoint, vllm_server

log = logging.getLogger(__name__)


class EvalError(PipelineError):
    """An evaluation whose numbers cannot be trusted; the message says what to check."""


@dataclass(frozen=True)
class Arm:
    """One server configuration: ``baseline`` (no speculation), ``ngram`` or ``eagle3`` at k,
    or ``served``: a running deployment measured as it is."""

    method: str
    k: int | None = None

    @property
    def label(self) -> str:
        return self.method if self.k is None else f"{self.method}-k{self.k}"


def planned_arms(profile: Profile) -> list[Arm]:
    e = profile.eval
    return [Arm("baseline")] + [Arm(m, k) for m in e.methods for k in e.num_speculative_tokens]


def speculative_config(profile: Profile, arm: Arm, drafter: str) -> dict[str, Any] | None:
    if arm.method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": arm.k,
            "prompt_lookup_min": profile.eval.ngram_prompt_lookup_min,
            "prompt_lookup_max": profile.eval.ngram_prompt_lookup_max,
        }
    if arm.method == "eagle3":
        return {"method": "eagle3", "model": drafter, "num_speculative_tokens": arm.k}
    return None


async def send_all(
    endpoint: Endpoint, profile: Profile, prompts: list[EvalPrompt], concurrency: int, desc: str
) -> tuple[dict[str, dict[str, Any]], float]:
    """The same greedy request for each prompt, ``concurrency`` at a time; outputs by id."""
    sem = asyncio.Semaphore(concurrency)
    outputs: dict[str, dict[str, Any]] = {}
    bar = progress(total=len(prompts), desc=desc, unit="prompt")
    client = ChatClient(
        endpoint.v1,
        concurrency=concurrency,
        request_timeout_s=profile.generate.request_timeout_s,
        max_retries=profile.generate.max_retries,
    )
    async with client:

        async def one(p: EvalPrompt) -> None:
            body = {
                "model": endpoint.model,
                "messages": list(p.messages),
                "max_tokens": profile.eval.max_tokens,
                "temperature": 0.0,
                "seed": profile.run.seed,
                "return_token_ids": True,  # losslessness is checked on tokens, not text
            }
            if profile.generate.chat_template_kwargs:  # the template the drafter trained on
                body["chat_template_kwargs"] = profile.generate.chat_template_kwargs
            async with sem:
                t0 = time.perf_counter()
                reply = await client.complete(body)
                latency = time.perf_counter() - t0
            choice = reply["choices"][0]
            outputs[p.id] = {
                "category": p.category,
                "text": choice["message"].get("content") or "",
                "token_ids": choice.get("token_ids"),
                "prompt_tokens": reply["usage"]["prompt_tokens"],
                "completion_tokens": reply["usage"]["completion_tokens"],
                "latency_s": latency,
            }
            bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    bar.close()
    return outputs, wall


def served_k(delta: SpecDecodeCounters) -> int | None:
    """k of a server measured as it is: the draft positions its counters report."""
    return max(delta.accepted_per_pos) + 1 if delta.accepted_per_pos else None


def figures(
    outputs: dict[str, dict[str, Any]], wall: float, delta: SpecDecodeCounters, arm: Arm
) -> dict[str, Any]:
    tokens = sum(o["completion_tokens"] for o in outputs.values())
    latency = sum(o["latency_s"] for o in outputs.values())
    k = arm.k if arm.method != "served" else served_k(delta)
    return {
        "prompts": len(outputs),
        "output_tokens": tokens,
        "wall_time_s": round(wall, 3),
        "output_tokens_per_s": tokens / wall if wall else None,
        # Request latency over tokens: at concurrency 1, the mean time per output token.
        "time_per_output_token_s": latency / tokens if tokens else None,
        "acceptance": acceptance(delta, k) if k else None,
    }


def measure_level(
    endpoint: Endpoint, profile: Profile, prompts: list[EvalPrompt], arm: Arm, concurrency: int
) -> dict[str, Any]:
    """One arm at one concurrency; at concurrency 1, also category by category."""
    groups = by_category(prompts) if concurrency == 1 else {"all": prompts}
    outputs: dict[str, dict[str, Any]] = {}
    per_category = {}
    wall = 0.0
    start = previous = scrape(endpoint.base_url)
    for category, group in groups.items():
        desc = f"eval {arm.label} c={concurrency}" + (f" {category}" if concurrency == 1 else "")
        out, seconds = asyncio.run(send_all(endpoint, profile, group, concurrency, desc))
        current = scrape(endpoint.base_url)
        if concurrency == 1:
            per_category[category] = figures(out, seconds, current - previous, arm)
        previous = current
        outputs.update(out)
        wall += seconds
    level = {"concurrency": concurrency, **figures(outputs, wall, previous - start, arm)}
    if per_category:
        level["per_category"] = per_category
    level["outputs"] = outputs
    return level


def check_drafter_matches(profile: Profile, train_outputs: dict[str, Any]) -> None:
    """Refuse a drafter trained against another verifier, layers or chat template."""
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
    config_path = Path(train_outputs["drafter"]) / "config.json"
    config = json.loads(config_path.read_text())
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    if layers != trained_on["capture_layer_ids"]:
        raise EvalError(
            f"{config_path} reads capture layers {layers} but its hidden states were captured at "
            f"{trained_on['capture_layer_ids']}; vLLM would feed the drafter the wrong layers "
            "(acceptance near 1.0). Retrain with `make train`, or fix "
            "eagle_aux_hidden_state_layer_ids"
        )
    named = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    if named is not None and Path(named).name != Path(verifier["model"]).name:
        raise EvalError(
            f"{config_path} names verifier {named!r} but {verifier['model']!r} is served; "
            "evaluate the drafter against the verifier it was trained for"
        )


def check_acceptance(arm: Arm, level: dict[str, Any], min_length: float) -> None:
    """An EAGLE-3 (or served) arm that drafted nothing, or whose acceptance length is what an
    untrained or miswired drafter gives (about 1.0), is an error, not a result."""
    if arm.method not in ("eagle3", "served"):
        return
    where = f"{arm.label} at concurrency {level['concurrency']}"
    acc = level["acceptance"]
    if acc is None or not acc["drafts"]:
        raise EvalError(
            f"{where}: the drafter ran no draft step (vLLM's spec-decode counters did not move); "
            "check that --speculative-config reached the server (method 'eagle3') and its log"
        )
    length = acc["mean_acceptance_length"]
    if acc["accepted_tokens"] == 0 or length < min_length:
        raise EvalError(
            f"{where}: {acc['accepted_tokens']} accepted tokens in {acc['drafts']} drafts, mean "
            f"acceptance length {length:.4f}, below eval.min_acceptance_length={min_length}: "
            "what an untrained or miswired drafter gives. Check the drafter's capture-layer ids, "
            "its verifier and draft vocabulary, and that it trained"
        )


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["token_ids"] is not None and b["token_ids"] is not None:
        return a["token_ids"] == b["token_ids"]
    return a["text"] == b["text"]


def compare_with_baseline(runs: list[dict[str, Any]]) -> None:
    """Speedup and greedy-output identity of every arm against the baseline, level by level."""
    baseline = next((r for r in runs if r["method"] == "baseline"), None)
    if baseline is None:
        return
    base_levels = {lv["concurrency"]: lv for lv in baseline["levels"]}
    for run in runs:
        if run is baseline:
            continue
        for level in run["levels"]:
            base = base_levels[level["concurrency"]]
            level["speedup"] = ratio(base["time_per_output_token_s"], level)
            level["mismatched_prompt_ids"] = sorted(
                pid
                for pid, out in base["outputs"].items()
                if not same_output(out, level["outputs"][pid])
            )
            for cat, figs in level.get("per_category", {}).items():
                figs["speedup"] = ratio(base["per_category"][cat]["time_per_output_token_s"], figs)


def ratio(base_tpot: float | None, figs: dict[str, Any]) -> float | None:
    tpot = figs["time_per_output_token_s"]
    return base_tpot / tpot if base_tpot and tpot else None


def batch_size_one(run: dict[str, Any]) -> dict[str, Any]:
    """The run's level at concurrency 1 (eval.concurrency always includes it)."""
    return next(lv for lv in run["levels"] if lv["concurrency"] == 1)


def headline(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The EAGLE-3 (or served) arm at concurrency 1 with the best speedup, ngram's at its k."""
    candidates = [r for r in runs if r["method"] in ("eagle3", "served")]
    at_one = [(r, batch_size_one(r)) for r in candidates]
    run, level = max(
        at_one,
        key=lambda rl: (rl[1].get("speedup") or 0, rl[1]["acceptance"]["mean_acceptance_length"]),
    )
    summary = {
        "method": run["method"],
        "concurrency": 1,
        "prompts": level["prompts"],
        "output_tokens_per_s": level["output_tokens_per_s"],
        "time_per_output_token_s": level["time_per_output_token_s"],
        **level["acceptance"],
    }
    if "speedup" in level:
        baseline = next(r for r in runs if r["method"] == "baseline")
        base = batch_size_one(baseline)
        summary["baseline_time_per_output_token_s"] = base["time_per_output_token_s"]
        summary["speedup"] = level["speedup"]
        summary["greedy_outputs_identical"] = not level["mismatched_prompt_ids"]
        summary["mismatched_prompt_ids"] = level["mismatched_prompt_ids"]
    ngram = next((r for r in runs if r["method"] == "ngram" and r["k"] == run["k"]), None)
    if ngram is not None:
        ngram_level = batch_size_one(ngram)
        length = (ngram_level["acceptance"] or {}).get("mean_acceptance_length")
        summary["ngram_mean_acceptance_length"] = length
        summary["eagle3_over_ngram_acceptance_length"] = (
            summary["mean_acceptance_length"] / length if length else None
        )
    return summary


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def results_markdown(results: dict[str, Any]) -> str:
    s = results["summary"]
    lines = [
        f"Headline: {s['method']} k={s['num_speculative_tokens']}, batch size 1: acceptance "
        f"rate {fmt(s['acceptance_rate'])}, mean acceptance length "
        f"{fmt(s['mean_acceptance_length'])}, speedup {fmt(s.get('speedup'), '.2f')}x.",
        "",
        "| arm | k | concurrency | acceptance rate | mean acceptance length | output tok/s "
        "| ms / output token | speedup | greedy outputs identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        for lv in run["levels"]:
            acc = lv["acceptance"] or {}
            mismatched = lv.get("mismatched_prompt_ids")
            identical = "-" if mismatched is None else "yes"
            if mismatched:
                identical = f"no ({len(mismatched)})"
            lines.append(
                f"| {run['method']} | {run['k'] or '-'} | {lv['concurrency']} "
                f"| {fmt(acc.get('acceptance_rate'))} | {fmt(acc.get('mean_acceptance_length'))} "
                f"| {fmt(lv['output_tokens_per_s'], '.1f')} "
                f"| {fmt((lv['time_per_output_token_s'] or 0) * 1000, '.2f')} "
                f"| {fmt(lv.get('speedup'), '.2f')} | {identical} |"
            )
    per_cat = results.get("per_category", {})
    if per_cat:
        methods = sorted({m for c in per_cat.values() for m in c["mean_acceptance_length"]})
        lines += [
            "",
            f"Per category at k={s['num_speculative_tokens']}, batch size 1:",
            "",
            "| category | prompts | "
            + " | ".join(f"{m} acceptance length | {m} speedup" for m in methods)
            + " |",
            "|---|---|" + "---|---|" * len(methods),
        ]
        for cat, c in sorted(per_cat.items()):
            cells = " | ".join(
                f"{fmt(c['mean_acceptance_length'].get(m))} | {fmt(c['speedup'].get(m), '.2f')}"
                for m in methods
            )
            lines.append(f"| {cat} | {c['prompts']} | {cells} |")
    skipped = results["prompts"].get("skipped") or {}
    if skipped.get("count"):
        per_category = ", ".join(f"{c} {n}" for c, n in sorted(skipped["per_category"].items()))
        lines += [
            "",
            f"Skipped {skipped['count']} prompts longer than {skipped['max_prompt_tokens']} tokens "
            f"(server.max_model_len - eval.max_tokens), by category: {per_category}.",
            "",
            "| skipped prompt | category | prompt tokens |",
            "|---|---|---|",
        ]
        lines += [
            f"| {p['id']} | {p['category']} | {p['prompt_tokens']} |" for p in skipped["prompts"]
        ]
    lossless = results.get("lm_eval")
    if lossless:
        lines += ["", "lm-eval (local-completions), with and without the drafter:", ""]
        lines += ["| task | documents | without | with | match |", "|---|---|---|---|---|"]
        for task, t in lossless["tasks"].items():
            without, with_ = (
                ", ".join(f"{name} {fmt(value)}" for name, value in sorted(scores.items()))
                for scores in (t["scores_without_drafter"], t["scores_with_drafter"])
            )
            lines.append(
                f"| {task} | {t['documents']} | {without} | {with_} "
                f"| {'yes' if t['scores_match'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def per_category_table(runs: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Each category's acceptance length and speedup for every method at ``k``, batch size 1."""
    table: dict[str, Any] = {}
    for run in runs:
        if run["k"] != k:
            continue
        level = batch_size_one(run)
        for cat, figs in level.get("per_category", {}).items():
            row = table.setdefault(
                cat, {"prompts": figs["prompts"], "mean_acceptance_length": {}, "speedup": {}}
            )
            row["mean_acceptance_length"][run["method"]] = (figs["acceptance"] or {}).get(
                "mean_acceptance_length"
            )
            row["speedup"][run["method"]] = figs.get("speedup")
    return table


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "eval")
    folder.mkdir(parents=True, exist_ok=True)
    train = read_manifest(profile, "train")["outputs"]
    generate = read_manifest(profile, "generate")
    prompts = load_eval_prompts(profile)
    check_held_out(prompts, stage_dir(profile, "generate") / generate["outputs"]["responses"])
    verifier = resolved_verifier(profile)["model"]
    deployed = profile.server.base_url is not None
    if deployed:
        arms = [Arm("served")]  # measured as it runs: no paired baseline, nothing started
    else:
        check_drafter_matches(profile, train)
        arms = planned_arms(profile)
    # Before any server starts: a prompt vLLM would refuse for its length is skipped and named.
    asked = len(prompts)
    prompts, skipped = fit_to_context(
        prompts, prompt_token_counts(prompts, verifier, profile), profile
    )
    for p in skipped["prompts"]:
        log.warning(
            "eval: skipping prompt %s (%s): %d tokens, over server.max_model_len - eval.max_tokens"
            " = %d",
            p["id"],
            p["category"],
            p["prompt_tokens"],
            skipped["max_prompt_tokens"],
        )
    lm_eval_arms = set()
    if profile.eval.lm_eval_tasks and not deployed:
        k_max = max(profile.eval.num_speculative_tokens)
        lm_eval_arms = {Arm("baseline"), Arm("eagle3", k_max)} & set(arms)
        tasks_dir = lossless_lm_eval.write_default_task(profile, folder / "lm-eval")
    runs, lm_scores = [], {}
    for arm in arms:
        spec = speculative_config(profile, arm, train["drafter"])
        log_path = folder / f"vllm-{arm.label}.log"
        with vllm_server(
            profile, verifier, log_path, use_base_url=deployed, speculative_config=spec
        ) as endpoint:
            levels = []
            for concurrency in profile.eval.concurrency:
                level = measure_level(endpoint, profile, prompts, arm, concurrency)
                check_acceptance(arm, level, profile.eval.min_acceptance_length)
                levels.append(level)
            if arm in lm_eval_arms:
                lm_scores[arm.method] = lossless_lm_eval.score(
                    endpoint, profile, verifier, tasks_dir
                )
                # Each document's response and the scores, for anyone to compare arm with arm.
                atomic_write_json(folder / "lm-eval" / f"{arm.label}.json", lm_scores[arm.method])
        runs.append({"method": arm.method, "k": arm.k, "spec": spec, "levels": levels})
    compare_with_baseline(runs)
    summary = headline(runs)
    outputs = {
        f"{Arm(r['method'], r['k']).label}-c{lv['concurrency']}": lv.pop("outputs")
        for r in runs
        for lv in r["levels"]
    }
    results: dict[str, Any] = {
        "drafter": train["drafter"],
        "verifier": verifier,
        "prompts": {"count": len(prompts), **eval_data_revision(profile), "skipped": skipped},
        "summary": summary,
        "runs": runs,
    }
    if len(lm_scores) == 2:
        results["lm_eval"] = lossless_lm_eval.compare(lm_scores["baseline"], lm_scores["eagle3"])
    k = summary["num_speculative_tokens"]
    results["per_category"] = per_category_table(runs, k)
    drafted = [
        {"method": r["method"], "k": r["k"] or k, **batch_size_one(r)}
        for r in runs
        if r["method"] != "baseline" and (batch_size_one(r)["acceptance"] or {}).get("drafts")
    ]
    results["plots"] = [
        plots.per_position(drafted, folder / "acceptance_per_position.png"),
        plots.acceptance_length_by_k(drafted, folder / "acceptance_length_by_k.png"),
    ]
    if not deployed:
        speedups = {c: row["speedup"] for c, row in results["per_category"].items()}
        results["plots"].append(
            plots.speedup_by_category(speedups, k, folder / "speedup_by_category.png")
        )
    atomic_write_json(folder / "outputs.json", outputs)
    # Published: paths relative to the run folder, none of this machine's (pipeline.manifest).
    atomic_write_json(folder / "results.json", portable(profile, results))
    atomic_write_bytes(folder / "results.md", results_markdown(results).encode())
    log.info(
        "eval: %s k=%d: acceptance rate %.3f, mean acceptance length %.3f (ngram %s), speedup %s",
        summary["method"],
        k,
        summary["acceptance_rate"],
        summary["mean_acceptance_length"],
        fmt(summary.get("ngram_mean_acceptance_length")),
        fmt(summary.get("speedup"), ".2f"),
    )
    return write_manifest(
        profile,
        "eval",
        started_at=started,
        counts={
            "input": asked,
            "succeeded": len(prompts),
            "skipped": skipped["count"],
            "failed": 0,
            "skip_reasons": {"prompt_too_long": skipped["count"]} if skipped["count"] else {},
        },
        outputs={
            "results": "results.json",
            "summary": summary,
            # What was measured: publish refuses results that belong to another checkpoint.
            "drafter_sha256": None if deployed else drafter_digest(Path(train["drafter"])),
        },
        inputs=("verifier", "generate", "train"),
        data_revision=eval_data_revision(profile),
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import run_stage

    run_stage("eval", run, argv)


if __name__ == "__main__":
    main()
