"""Prompts the verifier writes itself (the Magpie method), for more training data than a set has.

The verifier's own chat template, rendered up to where a user's words begin (a system turn
included when the template adds one), is sent to the server as a raw completion: what the model
writes next, up to the end of that turn, is what a user says to it. Such prompts are open by
construction: no third party's text, the verifier's license alone (release/license_rules.py
licenses the ``self-written`` source as the verifier). Their replies are then regenerated like
any other prompt's, so the drafter learns the verifier on prompts from its own distribution.

Invariants:
- request ``i`` is sampled with seed ``request_seed(run seed, "self-written", i)`` at the
  profile's temperature and top_p, so the same profile writes the same prompts;
- a prompt cut at ``max_tokens``, shorter than ``min_chars``, or the same as one kept before it
  in request order (case and whitespace aside) is dropped and counted; at most
  ``count x max_attempts`` requests are sent; the prompts kept are ids ``self-written-<i>``;
- the file (open-perfectblend schema, source ``self-written``) is written atomically once it is
  complete; a run that finds it with this recipe's settings reads it instead of asking again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_bytes
from pipeline.core.config import Profile, SelfWrittenPrompts
from pipeline.core.errors import PipelineError
from pipeline.core.prompts import SELF_WRITTEN_SOURCE, request_seed
from pipeline.serving.chat_client import ChatClient
from pipeline.serving.vllm_api import Endpoint

SENTINEL = "\u2063USER-WORDS\u2063"  # invisible separators: no template escapes or keeps them


class SelfWrittenError(PipelineError):
    """The verifier's template has no user turn to write into, or it wrote too few prompts."""


@dataclass(frozen=True)
class UserTurnFrame:
    """The token ids before a user's words, and the token (or text) that ends them."""

    prefix_ids: list[int]
    stop_token_ids: list[int]
    stop: list[str]


def user_turn_frame(model: str, revision: str | None, trust_remote_code: bool) -> UserTurnFrame:
    """Where a user turn begins and ends in ``model``'s own chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model, revision=revision, trust_remote_code=trust_remote_code
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    prefix, found, after = text.partition(SENTINEL)
    end = after.strip()
    if not found or not end:
        raise SelfWrittenError(
            f"the chat template of {model} does not frame a user turn ({text[:200]!r}): "
            "data.self_written needs a template that ends a user turn with a marker"
        )
    end_ids = tokenizer.encode(end, add_special_tokens=False)
    if len(end_ids) == 1:  # a special token: detokenised text may not show it
        return UserTurnFrame(tokenizer.encode(prefix, add_special_tokens=False), end_ids, [])
    return UserTurnFrame(tokenizer.encode(prefix, add_special_tokens=False), [], [end])


def settings_record(spec: SelfWrittenPrompts, run_seed: int, frame: UserTurnFrame) -> dict:
    """What decides the prompts: a file written with other settings is written again."""
    return {
        **spec.model_dump(),
        "run_seed": run_seed,
        "prefix_sha256": hashlib.sha256(json.dumps(frame.prefix_ids).encode()).hexdigest(),
    }


@dataclass
class Tally:
    requested: int = 0
    kept: int = 0
    truncated: int = 0
    too_short: int = 0
    duplicates: int = 0
    texts: dict[int, str] = field(default_factory=dict)  # request index -> prompt kept


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


async def write_prompts(
    profile: Profile, endpoint: Endpoint, frame: UserTurnFrame, progress=None
) -> Tally:
    """Ask the server in batches until ``count`` distinct prompts are kept or the attempts run
    out; each batch is judged in request order, so which prompt is kept does not depend on
    which reply came back first."""
    spec = profile.data.self_written
    assert spec is not None
    g = profile.generate
    tally, seen = Tally(), set()
    attempts = spec.count * spec.max_attempts
    body = {
        "model": endpoint.model,
        "prompt": frame.prefix_ids,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "stop_token_ids": frame.stop_token_ids,
        "stop": frame.stop,
    }
    client = ChatClient(
        endpoint.v1,
        concurrency=g.concurrency,
        request_timeout_s=g.request_timeout_s,
        max_retries=g.max_retries,
        path="completions",
    )
    in_flight = asyncio.Semaphore(g.concurrency)

    async def one(i: int) -> tuple[int, dict[str, Any]]:
        async with in_flight:
            seed = request_seed(profile.run.seed, SELF_WRITTEN_SOURCE, i)
            return i, (await client.complete({**body, "seed": seed}))["choices"][0]

    def judge(i: int, choice: dict[str, Any]) -> None:
        tally.requested += 1
        text = choice["text"].strip()
        if choice.get("finish_reason") == "length":
            tally.truncated += 1
        elif len(text) < spec.min_chars:
            tally.too_short += 1
        elif (key := normalised(text)) in seen:
            tally.duplicates += 1
        elif tally.kept < spec.count:
            seen.add(key)
            tally.texts[i] = text
            tally.kept += 1
            if progress is not None:
                progress.update(1)

    start = 0
    async with client:
        while tally.kept < spec.count and start < attempts:
            wanted = spec.count - tally.kept
            stop = min(attempts, start + max(wanted + wanted // 4, g.concurrency))
            for i, choice in sorted(await asyncio.gather(*(one(i) for i in range(start, stop)))):
                judge(i, choice)
            start = stop
    return tally


def prompt_file_bytes(texts: dict[int, str]) -> bytes:
    """The prompts kept, in request order, as open-perfectblend JSONL."""
    rows = [
        {
            "id": f"{SELF_WRITTEN_SOURCE}-{i}",
            "source": SELF_WRITTEN_SOURCE,
            "conversations": [{"from": "human", "value": texts[i]}],
        }
        for i in sorted(texts)
    ]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def finished(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The record of a complete file written with ``settings``; None if there is none."""
    record_path = path.with_suffix(".json")
    try:
        record = json.loads(record_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if record.get("settings") != settings or not path.exists():
        return None
    return record


def ensure_prompts(
    profile: Profile, endpoint: Endpoint, frame: UserTurnFrame, path: Path, progress=None
) -> dict[str, Any]:
    """The prompt file at ``path`` with its record beside it (``.json``): read if this recipe
    already wrote it, else written now."""
    spec = profile.data.self_written
    assert spec is not None
    settings = settings_record(spec, profile.run.seed, frame)
    if (record := finished(path, settings)) is not None:
        return record
    tally = asyncio.run(write_prompts(profile, endpoint, frame, progress))
    if tally.kept < spec.min_count:
        raise SelfWrittenError(
            f"data.self_written: the verifier wrote {tally.kept} usable prompts in "
            f"{tally.requested} requests ({tally.truncated} cut at max_tokens, "
            f"{tally.too_short} under min_chars, {tally.duplicates} repeats), fewer than "
            f"min_count {spec.min_count}: raise data.self_written.temperature or max_tokens, "
            "or lower count"
        )
    data = prompt_file_bytes(tally.texts)
    atomic_write_bytes(path, data)
    record = {
        "settings": settings,
        "file": path.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "kept": tally.kept,
        "requested": tally.requested,
        "truncated": tally.truncated,
        "too_short": tally.too_short,
        "duplicates": tally.duplicates,
    }
    atomic_write_bytes(path.with_suffix(".json"), (json.dumps(record, indent=2) + "\n").encode())
    return record
