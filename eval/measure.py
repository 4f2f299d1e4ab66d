"""Measuring: each arm's server, the same greedy requests at each concurrency, vLLM's counters.

An arm is one server configuration (:class:`Arm`). Each arm gets its own vLLM server on the
profile's flags (or, with ``server.base_url``, the running deployment, attached to and never
started) and sends every prompt at each level of ``eval.concurrency``; at concurrency 1 it goes
category by category. Acceptance comes from ``/metrics`` counter deltas around each batch
(:mod:`pipeline.serving.spec_decode_metrics`), so a level's figures are its own requests only.

Invariant: an arm's acceptance is checked (:func:`eval.guards.check_acceptance`) as soon as each
level is measured, before the next one starts: a drafter that does not draft stops the stage.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from eval import lossless_lm_eval
from eval.arms import Arm
from eval.guards import check_acceptance
from eval.prompts import EvalPrompt, by_category
from pipeline.core.atomic_files import atomic_write_json
from pipeline.core.config import Profile
from pipeline.core.progress import progress
from pipeline.serving.chat_client import ChatClient
from pipeline.serving.spec_decode_metrics import SpecDecodeCounters, acceptance, scrape
from pipeline.serving.speculative import speculative_config
from pipeline.serving.vllm_api import Endpoint
from pipeline.serving.vllm_server import vllm_server


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


def measure_arms(
    profile: Profile,
    arms: list[Arm],
    prompts: list[EvalPrompt],
    *,
    verifier: str,
    drafters: dict[str | None, str],
    folder: Path,
    deployed: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every arm at every level of ``eval.concurrency``, one server per arm (its log
    ``vllm-<arm>.log`` in ``folder``), or the deployment when ``deployed``; ``drafters``: the
    folder each EAGLE-3 arm serves, ours under None, each reference drafter under its name.
    With ``eval.lm_eval_tasks``, lm-eval also scores the baseline and our EAGLE-3 at the largest
    k on their servers, each written to ``lm-eval/<arm>.json``. Returns the runs (each level
    with its outputs) and lm-eval's scores by method."""
    lm_eval_arms: set[Arm] = set()
    if profile.eval.lm_eval_tasks and not deployed:
        k_max = max(profile.eval.num_speculative_tokens)
        if Arm("eagle3", k_max) in arms:  # scores compared with and without our drafter
            lm_eval_arms = {Arm("baseline"), Arm("eagle3", k_max)}
            tasks_dir = lossless_lm_eval.write_default_task(profile, folder / "lm-eval")
    runs, lm_scores = [], {}
    for arm in arms:
        spec = speculative_config(profile, arm.method, arm.k, drafters.get(arm.reference))
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
        runs.append(
            {
                "method": arm.method,
                "k": arm.k,
                "series": arm.series,
                "reference": arm.reference,
                "spec": spec,
                "levels": levels,
            }
        )
    return runs, lm_scores


def take_outputs(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every response, by arm and concurrency (``eagle3-k3-c1``), taken out of the runs' levels:
    they go to ``outputs.json``, not ``results.json``."""
    return {
        f"{Arm(r['method'], r['k'], r['reference']).label}-c{lv['concurrency']}": lv.pop("outputs")
        for r in runs
        for lv in r["levels"]
    }
