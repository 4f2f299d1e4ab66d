"""Measuring: each arm's server, the same requests at each concurrency, vLLM's counters.

An arm is one server configuration (:class:`Arm`). Each arm gets its own vLLM server on the
profile's flags (or, with ``server.base_url``, the running deployment, attached to and never
started) and sends every prompt, greedy, at each level of ``eval.concurrency``, ``eval.repeats``
times (each later repeat's replies compared with the first's), then at deployment sampling
(:func:`deployment_sampling`), each prompt's replies with their own seeds.
Acceptance comes from ``/metrics`` counter deltas (:mod:`pipeline.serving.spec_decode_metrics`):
around each pass, so a level's figures are its own requests only, and at concurrency 1 around
each request, so each prompt and each category has its own acceptance. Each prompt's pooled
measurements (``samples``) are what eval's intervals resample (:mod:`eval.intervals`).

Invariant: an arm's acceptance is checked (:func:`eval.guards.check_acceptance`) as soon as each
level is measured, before the next one starts: a drafter that does not draft stops the stage.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eval import lossless_lm_eval
from eval.arms import Arm
from eval.guards import check_acceptance, same_output
from eval.prompts import EvalPrompt, by_category
from pipeline.core.atomic_files import atomic_write_json
from pipeline.core.config import Profile
from pipeline.core.progress import progress
from pipeline.core.prompts import request_seed
from pipeline.serving.chat_client import ChatClient
from pipeline.serving.spec_decode_metrics import SpecDecodeCounters, acceptance, scrape
from pipeline.serving.speculative import speculative_config
from pipeline.serving.vllm_api import Endpoint
from pipeline.serving.vllm_server import vllm_server


async def send_all(
    endpoint: Endpoint,
    profile: Profile,
    prompts: list[EvalPrompt],
    concurrency: int,
    desc: str,
    *,
    per_request_counters: bool = False,
    sampling: Sampling | None = None,
) -> tuple[dict[str, dict[str, Any]], float, dict[str, SpecDecodeCounters]]:
    """The same request for each prompt, ``concurrency`` at a time: greedy, or with
    ``sampling`` each turn with its own seed; outputs by id and the wall time. With
    ``per_request_counters`` (concurrency 1: one request in flight), vLLM's counters are
    scraped after each request, so each prompt gets its own counter delta (the third value, by
    id); the wall time leaves the scrapes out."""
    sem = asyncio.Semaphore(concurrency)
    outputs: dict[str, dict[str, Any]] = {}
    counters: dict[str, SpecDecodeCounters] = {}
    bar = progress(total=len(prompts), desc=desc, unit="prompt")
    client = ChatClient(
        endpoint.v1,
        concurrency=concurrency,
        request_timeout_s=profile.generate.request_timeout_s,
        max_retries=profile.generate.max_retries,
    )
    last = await asyncio.to_thread(scrape, endpoint.base_url) if per_request_counters else None
    scraping = 0.0
    async with client:

        async def one(p: EvalPrompt) -> None:
            nonlocal last, scraping
            turns: list[dict[str, Any]] = []
            async with sem:  # a conversation's turns in order, each after the reply before
                for turn in range(1 + len(p.followups)):
                    body = {
                        "model": endpoint.model,
                        "messages": p.conversation([t["text"] for t in turns]),
                        "max_tokens": profile.eval.max_tokens,
                        "temperature": 0.0,
                        "seed": profile.run.seed,
                        "return_token_ids": True,  # losslessness is checked on tokens, not text
                    }
                    if sampling is not None:
                        body |= sampling.request(profile.run.seed, p.id, turn)
                    if profile.generate.chat_template_kwargs:  # the drafter's training template
                        body["chat_template_kwargs"] = profile.generate.chat_template_kwargs
                    t0 = time.perf_counter()
                    reply = await client.complete(body)
                    latency = time.perf_counter() - t0
                    if last is not None:
                        # vLLM records a step's counters before the request's last output is
                        # served, so this delta is this request's alone.
                        current = await asyncio.to_thread(scrape, endpoint.base_url)
                        counters[p.id] = counters.get(p.id, SpecDecodeCounters()) + (current - last)
                        last = current
                        scraping += time.perf_counter() - t0 - latency
                    choice = reply["choices"][0]
                    turns.append(
                        {
                            "text": choice["message"].get("content") or "",
                            "token_ids": choice.get("token_ids"),
                            "prompt_tokens": reply["usage"]["prompt_tokens"],
                            "completion_tokens": reply["usage"]["completion_tokens"],
                            "latency_s": latency,
                        }
                    )
            outputs[p.id] = {"category": p.category, **conversation_record(turns)}
            bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0 - scraping
    bar.close()
    return outputs, wall, counters


def conversation_record(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """One prompt's output: its one reply, or for several turns the replies' token ids and
    text in order, their tokens and latencies summed, the first request's prompt tokens, and
    each turn in ``turns``."""
    if len(turns) == 1:
        return turns[0]
    ids = [t["token_ids"] for t in turns]
    return {
        "text": "\n\n".join(t["text"] for t in turns),
        "token_ids": None if None in ids else [i for turn in ids for i in turn],
        "prompt_tokens": turns[0]["prompt_tokens"],
        "completion_tokens": sum(t["completion_tokens"] for t in turns),
        "latency_s": sum(t["latency_s"] for t in turns),
        "turns": turns,
    }


def served_k(delta: SpecDecodeCounters) -> int | None:
    """k of a server measured as it is: the draft positions its counters report."""
    return max(delta.accepted_per_pos) + 1 if delta.accepted_per_pos else None


def figures(
    requests: list[dict[str, Any]], wall: float, delta: SpecDecodeCounters, arm: Arm
) -> dict[str, Any]:
    """Throughput, time per output token and acceptance of ``requests`` (each with its
    completion tokens and latency) that took ``wall`` seconds and moved the counters by
    ``delta``."""
    tokens = sum(o["completion_tokens"] for o in requests)
    latency = sum(o["latency_s"] for o in requests)
    k = arm.k if arm.method != "served" else served_k(delta)
    return {
        "prompts": len({o["id"] for o in requests}),
        "output_tokens": tokens,
        "wall_time_s": round(wall, 3),
        "output_tokens_per_s": tokens / wall if wall else None,
        # Request latency over tokens: at concurrency 1, the mean time per output token.
        "time_per_output_token_s": latency / tokens if tokens else None,
        "acceptance": acceptance(delta, k) if k else None,
    }


@dataclass(frozen=True)
class Sampling:
    """Deployment sampling for one pass: its ``reply`` is each prompt's reply number, which
    fixes each request's seed (the same in every arm)."""

    temperature: float
    top_p: float
    reply: int = 0

    def request(self, run_seed: int, prompt_id: str, turn: int) -> dict[str, Any]:
        seed = request_seed(run_seed, f"eval:{prompt_id}:{self.reply}", turn)
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": seed}


def deployment_sampling(profile: Profile) -> Sampling | None:
    """The sampling eval measures every arm at too: ``eval.sampled``'s, else generate's; None
    when ``eval.sampled`` is null or that sampling is greedy."""
    sampled, g = profile.eval.sampled, profile.generate
    if sampled is None:
        return None
    temperature = sampled.temperature if sampled.temperature is not None else g.temperature
    top_p = sampled.top_p if sampled.top_p is not None else g.top_p
    return Sampling(temperature, top_p) if temperature > 0 else None


@dataclass(frozen=True)
class Pass:
    """One pass of every prompt through a server: each request (its output with its ``id``),
    the wall time, each request's own counter delta by id (concurrency 1, drafting arms) and
    the counters' delta over the pass."""

    requests: list[dict[str, Any]]
    wall_s: float
    counters: dict[str, SpecDecodeCounters]
    delta: SpecDecodeCounters


def measure_level(
    endpoint: Endpoint,
    profile: Profile,
    prompts: list[EvalPrompt],
    arm: Arm,
    concurrency: int,
    sampling: Sampling | None = None,
) -> dict[str, Any]:
    """One arm at one concurrency, ``eval.repeats`` greedy passes on the same server, or with
    ``sampling`` one pass per reply of ``eval.sampled.replies_per_prompt``, each reply with its
    own seeds, every reply kept in ``replies`` (:func:`pooled_level`). At concurrency 1 the
    prompts go category by category and a drafting arm's counters are read around each
    request."""
    at_one = concurrency == 1
    drafts = at_one and arm.method != "baseline"  # each request's own acceptance
    if at_one:
        prompts = [p for group in by_category(prompts).values() for p in group]
    sampled = profile.eval.sampled
    repeats = (
        profile.eval.repeats if sampling is None or sampled is None else sampled.replies_per_prompt
    )
    passes = []
    for r in range(repeats):
        desc = f"eval {arm.label} c={concurrency}"
        this = None if sampling is None else replace(sampling, reply=r)
        if this is not None:
            desc += f" sampled {r + 1}/{repeats}"
        elif repeats > 1:
            desc += f" repeat {r + 1}/{repeats}"
        start = scrape(endpoint.base_url)
        outputs, wall, counters = asyncio.run(
            send_all(
                endpoint,
                profile,
                prompts,
                concurrency,
                desc,
                per_request_counters=drafts,
                sampling=this,
            )
        )
        delta = scrape(endpoint.base_url) - start
        requests = [{"id": pid, **out} for pid, out in outputs.items()]
        for req in requests:
            if req["id"] in counters:
                req["drafts"] = int(counters[req["id"]].drafts)
                req["accepted_tokens"] = int(counters[req["id"]].accepted)
        passes.append(Pass(requests, wall, counters, delta))
    level = pooled_level(passes, arm, concurrency)
    if sampling is None and len(passes) > 1:  # greedy: every repeat gives the first's replies
        first = {req["id"]: req for req in passes[0].requests}
        level["repeat_mismatched_prompt_ids"] = sorted(
            {req["id"] for p in passes[1:] for req in p.requests
             if not same_output(req, first[req["id"]])}
        )  # fmt: skip
    if sampling is not None:
        level["sampling"] = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "replies_per_prompt": repeats,
        }
        replies: dict[str, list[dict[str, Any]]] = {}
        for p in passes:
            for req in p.requests:
                reply = {k: req[k] for k in ("text", "token_ids", "completion_tokens")}
                replies.setdefault(req["id"], []).append(reply)
        level["replies"] = replies
    return level


def pooled_level(passes: list[Pass], arm: Arm, concurrency: int) -> dict[str, Any]:
    """A level's figures over all its passes (each pass's own in ``per_repeat`` when there are
    several); at concurrency 1, also category by category. ``samples`` has each prompt's pooled
    measurements, which the intervals resample; ``outputs`` is the first pass's responses, each
    with its drafts and accepted tokens where read."""
    every = [req for p in passes for req in p.requests]
    level = {
        "concurrency": concurrency,
        **figures(
            every,
            sum(p.wall_s for p in passes),
            sum((p.delta for p in passes), SpecDecodeCounters()),
            arm,
        ),
    }
    if len(passes) > 1:
        level["per_repeat"] = [figures(p.requests, p.wall_s, p.delta, arm) for p in passes]
    if concurrency == 1:
        level["per_category"] = {}
        for category in dict.fromkeys(req["category"] for req in every):
            mine = [req for req in every if req["category"] == category]
            own = [p.counters[r["id"]] for p in passes for r in p.requests
                   if r["category"] == category and r["id"] in p.counters]  # fmt: skip
            level["per_category"][category] = figures(
                mine,
                sum(req["latency_s"] for req in mine),  # one request at a time
                sum(own, SpecDecodeCounters()),
                arm,
            )
    level["samples"] = pooled_samples(every)
    level["outputs"] = {
        req["id"]: {key: v for key, v in req.items() if key != "id"} for req in passes[0].requests
    }
    return level


def pooled_samples(requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each prompt's tokens, latency and (at concurrency 1) drafts and accepted tokens, summed
    over its repeats: what a bootstrap over prompts resamples."""
    samples: dict[str, dict[str, Any]] = {}
    for req in requests:
        sample = samples.setdefault(
            req["id"], {"category": req["category"], "completion_tokens": 0, "latency_s": 0.0}
        )
        sample["completion_tokens"] += req["completion_tokens"]
        sample["latency_s"] += req["latency_s"]
        if "drafts" in req:
            sample["drafts"] = sample.get("drafts", 0) + req["drafts"]
            sample["accepted_tokens"] = sample.get("accepted_tokens", 0) + req["accepted_tokens"]
    return samples


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
    k on their servers, each written to ``lm-eval/<arm>.json``. At deployment sampling
    (:func:`deployment_sampling`), each arm is measured once more, at
    ``eval.sampled.concurrency`` (a run's ``sampled`` level). Returns the runs (each level with
    its outputs) and lm-eval's scores by method."""
    lm_eval_arms: set[Arm] = set()
    if profile.eval.lm_eval_tasks and not deployed:
        k_max = max(profile.eval.num_speculative_tokens)
        if Arm("eagle3", k_max) in arms:  # scores compared with and without our drafter
            lm_eval_arms = {Arm("baseline"), Arm("eagle3", k_max)}
            tasks_dir = lossless_lm_eval.write_default_task(profile, folder / "lm-eval")
    runs, lm_scores = [], {}
    sampling = deployment_sampling(profile)
    for arm in arms:
        drafter = drafters.get(arm.reference)
        spec = speculative_config(profile, arm.method, arm.k, drafter, arm.reference)
        log_path = folder / f"vllm-{arm.label}.log"
        with vllm_server(
            profile, verifier, log_path, use_base_url=deployed, speculative_config=spec
        ) as endpoint:
            levels = []
            for concurrency in profile.eval.concurrency:
                level = measure_level(endpoint, profile, prompts, arm, concurrency)
                check_acceptance(arm, level, profile.eval.min_acceptance_length)
                levels.append(level)
            sampled = None
            if sampling is not None:
                concurrency = profile.eval.sampled.concurrency
                sampled = measure_level(endpoint, profile, prompts, arm, concurrency, sampling)
                check_acceptance(arm, sampled, 1.0)  # a drafter that drafts; any acceptance
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
                **({"sampled": sampled} if sampled else {}),
            }
        )
    return runs, lm_scores


def take_outputs(
    runs: list[dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every response and every prompt's pooled sample, by arm and concurrency
    (``eagle3-k3-c1``; ``eagle3-k3-sampled-c1`` with every sampled reply of each prompt), taken
    out of the runs' levels: they go to ``outputs.json`` and ``samples.json``, not
    ``results.json``."""
    outputs, samples = {}, {}
    for r in runs:
        label = Arm(r["method"], r["k"], r["reference"]).label
        for lv in r["levels"]:
            key = f"{label}-c{lv['concurrency']}"
            outputs[key], samples[key] = lv.pop("outputs"), lv.pop("samples")
        if "sampled" in r:
            lv = r["sampled"]
            key = f"{label}-sampled-c{lv['concurrency']}"
            lv.pop("outputs")
            outputs[key], samples[key] = lv.pop("replies"), lv.pop("samples")
    return outputs, samples
