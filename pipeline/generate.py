"""Stage `generate`: regenerate every assistant turn with the verifier served by vLLM.

Run as: python -m pipeline.generate --config configs/tiny.yaml

Reads the prompt set (``data.dataset``) and the `verifier` stage; writes
``<run>/generate/responses.jsonl`` (one record per prompt id, open-perfectblend schema, each
regenerated ``gpt`` turn carrying the verifier's ``reasoning_content`` when it emitted any, the
field speculators' preprocessing reads) and ``manifest.json``.

Invariants:
- turns are regenerated in order: turn k is answered given the verifier's own turns < k;
- records are appended as they finish and fsynced in groups every ``generate.sync_every_s``,
  so a crash loses at most the requests in flight and the records of the last interval; a
  rerun reads the finished ids and sends only the rest (a torn last line from a crash is
  dropped before appending);
- transient failures (timeouts, connection errors, 5xx, 429) are retried with exponential
  backoff; a prompt that still fails is counted as failed, not written, and retried next run;
- a conversation ends unkept, written with its ``skip_reason``, when the server rejects it as
  over ``server.max_model_len`` (``prompt_too_long``), a reply is empty (``empty_response``), has
  reasoning but no answer (``reasoning_only_response``, unless ``generate.keep_reasoning_only``),
  or stopped at ``generate.max_tokens`` with ``generate.on_truncated: skip``
  (``truncated_response``); truncated replies are kept and counted by default, per source too;
- each reply is sampled with its own seed, derived from the run seed, the prompt id and the turn
  (:func:`request_seed`), so that sampling at the verifier's recommended temperature is
  reproducible however the run is interrupted, resumed or spread over replicas;
- with ``generate.replica_urls`` the prompts are spread over several running servers, each at
  ``generate.concurrency``, pulled from one queue (a faster or less loaded replica takes more);
  a dead replica's prompts fail after retries and are redone by the rerun;
- a skipped conversation's record keeps its id, source, usage and reason but no text (an
  over-long prompt's megabyte stays out of ``responses.jsonl``); every skipped row, malformed
  input lines included, is listed in ``skipped.jsonl`` with its place in the input (file and
  1-based line number) and reason, rewritten atomically from the records on every run;
- ``data.max_samples`` is a seeded sample stratified by source (pipeline.core.prompts); the manifest
  records it under ``outputs.sampling``; ``responses.jsonl`` holds the current selection only:
  finished records of other prompts are kept in ``responses.unselected.jsonl`` and come back
  when a later selection includes them (a pilot's work is reused by the full run);
- counts: ``succeeded + skipped + failed == input``, with the skips by reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.core.atomic_files import atomic_write_bytes
from pipeline.core.config import Profile
from pipeline.core.contracts import GenerateOutputs
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import (
    StageInputError,
    finished_shards,
    now,
    read_input,
    read_manifest,
    shard_record,
    stage_dir,
    write_manifest,
)
from pipeline.core.progress import progress
from pipeline.core.prompts import (
    SELF_WRITTEN_SOURCE,
    PromptRow,
    PromptSet,
    data_revision,
    load_prompt_set,
    request_seed,
)
from pipeline.core.responses import ResponseRecord, complete_records, read_responses
from pipeline.core.server_errors import (
    ServerRejectedError,
    context_length_exceeded,
    server_error,
)
from pipeline.core.shards import Shard, ShardError, check_ids, sum_counts
from pipeline.serving.chat_client import REQUEST_ERRORS, ChatClient
from pipeline.serving.self_written_prompts import (
    UserTurnFrame,
    ensure_prompts,
    finished,
    settings_record,
    user_turn_frame,
)
from pipeline.serving.vllm_api import Endpoint, attach
from pipeline.serving.vllm_server import vllm_server

log = logging.getLogger(__name__)
RESPONSES = "responses.jsonl"
# Finished records of prompts outside the current selection (data.max_samples lowered, another
# sample_seed): kept, and moved back when a later selection wants them.
UNSELECTED = "responses.unselected.jsonl"
SKIPPED = "skipped.jsonl"
SELF_WRITTEN = "self-written-prompts.jsonl"  # data.self_written; its record beside it (.json)
SKIP_DETAIL = {
    "prompt_too_long": "the server rejected the conversation as over server.max_model_len",
    "empty_response": "the verifier answered nothing",
    "reasoning_only_response": "reasoning but no answer (generate.keep_reasoning_only=false)",
    "truncated_response": "stopped at generate.max_tokens (generate.on_truncated=skip)",
}


def finished_ids(path: Path) -> set[str]:
    """Ids already written (a torn last line cut off first)."""
    return {record.id for record in read_responses(path, repair=True)}


def select_records(folder: Path, wanted: set[str]) -> set[str]:
    """Make ``responses.jsonl`` hold exactly the finished records of the ``wanted`` ids, parking
    the others in ``UNSELECTED`` and bringing parked ones back; return the finished wanted ids.

    Every reader of ``responses.jsonl`` (extract, the license check, eval's leak guard) then sees
    the current selection only. Every record is first in the parked file (old and new parked
    records), then the main file is rewritten, then the parked one: a crash anywhere leaves a
    record in both, never in neither, and duplicates are dropped on the next call.
    """
    main, parked = folder / RESPONSES, folder / UNSELECTED
    old_parked = complete_records(parked, repair=True)
    keep: list[bytes] = []
    park: list[bytes] = []
    seen: set[str] = set()
    for line in [*complete_records(main, repair=True), *old_parked]:
        if (rid := json.loads(line)["id"]) in seen:
            continue
        seen.add(rid)
        (keep if rid in wanted else park).append(line)
    kept_ids = seen & wanted
    if not park and not old_parked:
        return kept_ids  # nothing to move
    log.info("generate: %d finished records kept aside in %s", len(park), UNSELECTED)

    def write(path: Path, records: list[bytes]) -> None:
        atomic_write_bytes(path, b"".join(line + b"\n" for line in records))

    write(parked, [*old_parked, *park])  # first a superset, so a crash loses nothing
    write(main, keep)
    if park:
        write(parked, park)
    else:
        parked.unlink()
    return kept_ids


class ResponseWriter:
    """Appends one JSON record per line and group-commits: ``sync()`` flushes and fsyncs.

    One fsync per record would cap the stage at the disk's fsync rate (about a thousand a second
    here, below what a fast server answers at concurrency 128), so records are made durable in
    groups: ``regenerate_all`` syncs every ``generate.sync_every_s`` off the event loop, and
    ``close()`` syncs the rest. A crash loses at most the records of the last interval, which a
    rerun sends again (resume is by id, so nothing is written twice).
    """

    def __init__(self, path: Path):
        self._fh = open(path, "ab")  # noqa: SIM115 (closed in close())

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode())

    async def sync(self) -> None:
        self._fh.flush()
        await asyncio.to_thread(os.fsync, self._fh.fileno())

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()


async def sync_until(stop: asyncio.Event, writer: ResponseWriter, every_s: float) -> None:
    """Sync ``writer`` every ``every_s`` until ``stop`` is set; a sync in progress completes."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        await writer.sync()


def request_body(
    profile: Profile, endpoint: Endpoint, messages: list[dict], seed: int
) -> dict[str, Any]:
    g = profile.generate
    body: dict[str, Any] = {
        "model": endpoint.model,
        "messages": messages,
        "max_tokens": g.max_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "seed": seed,
    }
    if g.chat_template_kwargs:
        body["chat_template_kwargs"] = g.chat_template_kwargs
    return body


def skip_reason(profile: Profile, content: str, reasoning: str | None, finish: str | None):
    """Why a reply ends its conversation unkept, by the profile's policies; None to keep it."""
    if not content.strip():
        if not reasoning:
            return "empty_response"
        if not profile.generate.keep_reasoning_only:
            return "reasoning_only_response"
    if finish == "length" and profile.generate.on_truncated == "skip":
        return "truncated_response"
    return None


async def regenerate_row(
    client: ChatClient, endpoint: Endpoint, profile: Profile, row: PromptRow
) -> dict[str, Any]:
    """Answer each human turn in order; return the record, or one marked with a skip reason."""
    history: list[dict[str, str]] = []
    turns: list[dict[str, Any]] = []
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    finish_reasons = []
    skip = None
    for message in row.messages:
        if message["role"] == "assistant":
            continue  # the reference answer is replaced by the verifier's
        history.append(message)
        turns.append({"from": "system" if message["role"] == "system" else "human",
                      "value": message["content"]})  # fmt: skip
        if message["role"] != "user":
            continue
        try:
            seed = request_seed(profile.run.seed, row.id, len(finish_reasons))
            reply = await client.complete(request_body(profile, endpoint, history, seed))
        except ServerRejectedError as err:
            if not context_length_exceeded(err.status, err.text):
                raise
            skip = "prompt_too_long"
            break
        choice = reply["choices"][0]
        content = choice["message"].get("content") or ""
        # vLLM names it `reasoning` (newer) or `reasoning_content` (older).
        reasoning = choice["message"].get("reasoning") or choice["message"].get("reasoning_content")
        for k in usage:
            usage[k] += reply.get("usage", {}).get(k, 0)
        finish_reasons.append(choice.get("finish_reason"))
        skip = skip_reason(profile, content, reasoning, choice.get("finish_reason"))
        if skip:
            break
        history.append({"role": "assistant", "content": content})
        turn = {"from": "gpt", "value": content}
        if reasoning:
            turn["reasoning_content"] = reasoning
        turns.append(turn)
    return {
        "id": row.id,
        "source": row.source,
        "conversations": [] if skip else turns,
        "finish_reasons": finish_reasons,
        "usage": usage,
        "skip_reason": skip,
    }


async def regenerate_all(
    profile: Profile, endpoints: list[Endpoint], todo: list[PromptRow], writer: ResponseWriter
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Regenerate ``todo`` over ``endpoints``, ``generate.concurrency`` requests in flight on
    each; a free worker takes the next prompt, so a faster replica does more. Return, per
    endpoint, how many prompts it finished and how many failed, and the last error of each
    endpoint that had one (one line, for the stage's message)."""
    g = profile.generate
    queue: asyncio.Queue[PromptRow] = asyncio.Queue()
    for row in todo:
        queue.put_nowait(row)
    tally = [{"base_url": e.base_url, "finished": 0, "failed": 0} for e in endpoints]
    last_error: dict[str, str] = {}
    bar = progress(total=len(todo), desc="generate", unit="prompt")

    async def worker(client: ChatClient, endpoint: Endpoint, counts: dict[str, Any]) -> None:
        while not queue.empty():
            row = queue.get_nowait()
            try:
                record = await regenerate_row(client, endpoint, profile, row)
            except (*REQUEST_ERRORS, KeyError, ValueError) as err:
                log.warning("prompt %s failed on %s: %r", row.id, endpoint.base_url, err)
                counts["failed"] += 1
                last_error[endpoint.base_url] = str(server_error(err) or repr(err))
            else:
                writer.write(record)  # skips too: they are finished, with a reason
                counts["finished"] += 1
            bar.update(1)

    stop_syncing = asyncio.Event()
    syncer = asyncio.create_task(sync_until(stop_syncing, writer, g.sync_every_s))
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for endpoint, counts in zip(endpoints, tally, strict=True):
            client = await stack.enter_async_context(
                ChatClient(
                    endpoint.v1,
                    concurrency=g.concurrency,
                    request_timeout_s=g.request_timeout_s,
                    max_retries=g.max_retries,
                )
            )
            workers += [worker(client, endpoint, counts) for _ in range(g.concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            stop_syncing.set()
            await syncer
    bar.close()
    return tally, last_error


@contextlib.contextmanager
def generation_endpoints(profile: Profile, model: str, log_path: Path) -> Iterator[list[Endpoint]]:
    """The replicas named in generate.replica_urls, else the one server vllm_server gives."""
    urls = profile.generate.replica_urls
    if urls:
        yield [attach(url, profile.server.startup_timeout_s) for url in urls]
        return
    with vllm_server(profile, model, log_path) as endpoint:
        yield [endpoint]


def load_input(profile: Profile) -> PromptSet:
    d = profile.data
    prompts = load_prompt_set(
        d.dataset,
        d.revision,
        d.split,
        d.max_samples,
        seed=d.sample_seed,
        on_malformed=d.on_malformed_row,
    )
    for bad in prompts.rejected:
        log.warning("generate: skipping %s (%s): %s", bad.where, bad.reason, bad.detail)
    return prompts


def in_shard(prompts: PromptSet, shard: Shard | None) -> PromptSet:
    """The prompts of ``shard`` (all of them unsharded); malformed rows, which have no id to
    hash, are shard 0's, so the merged counts hold each once."""
    if shard is None:
        return prompts
    rows = [r for r in prompts.rows if shard.holds(r.id)]
    return replace(prompts, rows=rows, rejected=prompts.rejected if shard.index == 0 else [])


def write_skipped(path: Path, prompts: PromptSet, records: list[ResponseRecord]) -> None:
    """Every skipped row, its place in the input and why, one JSON line each."""
    where = {r.id: r.where for r in prompts.rows}
    lines = [bad.record() for bad in prompts.rejected]
    lines += [
        {
            "where": where[r.id],
            "reason": r.skip_reason,
            "detail": SKIP_DETAIL.get(r.skip_reason, r.skip_reason),
            "id": r.id,
            "source": r.source,
        }
        for r in records
        if r.skip_reason
    ]
    atomic_write_bytes(
        path, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()
    )


def count_records(prompts: PromptSet, records: list[ResponseRecord]) -> dict[str, Any]:
    kept = [r for r in records if not r.skip_reason]
    reasons = [r.skip_reason for r in records if r.skip_reason]
    reasons += [bad.reason for bad in prompts.rejected]
    return {
        "input": len(prompts.rows) + len(prompts.rejected),
        "succeeded": len(kept),
        "skipped": len(reasons),
        "failed": len(prompts.rows) - len(records),
        "skip_reasons": {why: reasons.count(why) for why in sorted(set(reasons))},
        "truncated": sum("length" in r.finish_reasons for r in kept),
        # Replies cut at generate.max_tokens, per source: where max_tokens is too short
        "truncated_by_source": dict(
            sorted(Counter(r.source for r in kept if "length" in r.finish_reasons).items())
        ),
        "with_reasoning": sum(any("reasoning_content" in t for t in r.conversations) for r in kept),
        "prompt_tokens": sum(r.usage["prompt_tokens"] for r in kept),
        "completion_tokens": sum(r.usage["completion_tokens"] for r in kept),
    }


def finished_replicas(profile: Profile) -> list[dict[str, Any]]:
    """What the replicas did in the run that wrote the current manifest; [] without one."""
    try:
        return read_manifest(profile, "generate")["outputs"].get("replicas", [])
    except StageInputError:
        return []


def with_self_written(prompts: PromptSet, path: Path) -> PromptSet:
    """The prompt set and all the prompts the verifier wrote (after any sampling of the set)."""
    own = load_prompt_set(str(path), None, "train", None)
    by_source = prompts.sampling.by_source | {
        SELF_WRITTEN_SOURCE: {"available": len(own.rows), "sampled": len(own.rows)}
    }
    sampling = replace(prompts.sampling, by_source=by_source)
    return PromptSet([*prompts.rows, *own.rows], [*prompts.rejected, *own.rejected], sampling)


def write_self_written(
    profile: Profile, endpoint: Endpoint, frame: UserTurnFrame, path: Path
) -> dict[str, Any]:
    spec = profile.data.self_written
    assert spec is not None
    with progress(total=spec.count, desc="self-written prompts", unit="prompt") as bar:
        return ensure_prompts(profile, endpoint, frame, path, bar)


def selection(folder: Path, prompts: PromptSet) -> list[PromptRow]:
    """The prompts still to do; finished records of prompts not selected are set aside."""
    done = select_records(folder, {r.id for r in prompts.rows})
    todo = [r for r in prompts.rows if r.id not in done]
    log.info(
        "generate: %d prompts, %d already finished, %d to do",
        len(prompts.rows),
        len(done),
        len(todo),
    )
    return todo


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    verifier = read_input(profile, "generate", "verifier").outputs
    folder = stage_dir(profile, "generate")
    folder.mkdir(parents=True, exist_ok=True)
    prompts = in_shard(load_input(profile), profile.run.shard_spec)
    out = folder / RESPONSES
    own_path, frame, own = folder / SELF_WRITTEN, None, None
    if spec := profile.data.self_written:
        trust = profile.verifier.trust_remote_code
        frame = user_turn_frame(verifier.model, verifier.revision, trust)
        own = finished(own_path, settings_record(spec, profile.run.seed, frame))
        if own is not None:  # written by an earlier run of this recipe
            prompts = with_self_written(prompts, own_path)
    # None: the verifier writes its prompts first, on the server that then answers them.
    todo = None if spec and own is None else selection(folder, prompts)
    replicas: list[dict[str, Any]] = []
    last_error: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        endpoints = None
        if todo is None:
            assert frame is not None
            endpoints = stack.enter_context(
                generation_endpoints(profile, verifier.model, folder / "vllm.log")
            )
            own = write_self_written(profile, endpoints[0], frame, own_path)
            prompts = with_self_written(prompts, own_path)
            todo = selection(folder, prompts)
        if todo:
            if endpoints is None:
                endpoints = stack.enter_context(
                    generation_endpoints(profile, verifier.model, folder / "vllm.log")
                )
            writer = ResponseWriter(out)
            try:
                replicas, last_error = asyncio.run(regenerate_all(profile, endpoints, todo, writer))
            finally:
                writer.close()
        else:  # nothing asked: the shares are the finished run's, whose manifest then stands
            replicas = finished_replicas(profile)
    # Counts come from the file, so they are the same whether this run or an earlier one wrote it.
    records = list(read_responses(out, repair=True))
    write_skipped(folder / SKIPPED, prompts, records)
    counts = count_records(prompts, records)
    if counts["failed"]:
        # No manifest: the stage is unfinished, so later stages refuse to read a partial set.
        (folder / "manifest.json").unlink(missing_ok=True)
        raise PipelineError(
            f"generate: {counts['failed']} of {counts['input']} prompts failed after retries "
            f"(server log: {folder / 'vllm.log'} when started here); the "
            f"{len(records)} finished records are kept; rerun `make generate` to do the rest"
            + "".join(f"; last error from {url}: {why}" for url, why in last_error.items())
        )
    d = profile.data
    return write_manifest(
        profile,
        "generate",
        started_at=started,
        counts=counts,
        outputs=GenerateOutputs(
            responses=RESPONSES,
            skipped=SKIPPED,
            sampling=prompts.sampling.record(),
            replicas=replicas,  # this run's share of each
            self_written=own,
            shard=shard_record(profile, verifier),
        ),
        data_revision=data_revision(d.dataset, d.revision),
    )


def merged_before(profile: Profile) -> bool:
    """Whether the finished generate in the stage folder is a merge of shards."""
    try:
        return read_manifest(profile, "generate")["outputs"].get("shards") is not None
    except StageInputError:
        return False


def merge(profile: Profile) -> dict[str, Any]:
    """``--merge``: the finished shards (run.shard=k/S) as one generate folder: responses and
    skipped rows concatenated in shard order, counts summed; refused unless every shard is
    there, fresh, made alike, and holds only its own prompt ids, each once."""
    started = now()
    verifier = read_input(profile, "generate", "verifier").outputs
    shards = finished_shards(profile, "generate", verifier)
    folder = stage_dir(profile, "generate")
    responses: list[bytes] = []
    skipped: list[bytes] = []
    replicas: list[dict[str, Any]] = []
    seen: dict[str, Shard] = {}
    for shard, manifest in shards.manifests.items():
        own = shards.folder(profile, "generate", shard)
        lines = complete_records(own / manifest.outputs.responses)
        check_ids("generate", shard, [json.loads(line)["id"] for line in lines], seen)
        responses += lines
        skipped += complete_records(own / manifest.outputs.skipped)
        replicas += [{**r, "shard": str(shard)} for r in manifest.outputs.replicas]
    merged = b"".join(line + b"\n" for line in responses)
    present = folder / RESPONSES
    # An earlier merge that stopped before its manifest wrote these same bytes.
    if present.exists() and present.read_bytes() != merged and not merged_before(profile):
        raise ShardError(
            f"generate --merge: {present} holds an unsharded run's responses, which a merge "
            "would replace; move them away (or delete them) first"
        )
    for path, lines in ((folder / RESPONSES, responses), (folder / SKIPPED, skipped)):
        atomic_write_bytes(path, b"".join(line + b"\n" for line in lines))
    first = shards.manifests[Shard(0, shards.count)]
    log.info("generate: merged %d shards, %d records", shards.count, len(responses))
    return write_manifest(
        profile,
        "generate",
        started_at=started,
        counts=sum_counts([m.counts for m in shards.manifests.values()]),
        outputs=GenerateOutputs(
            responses=RESPONSES,
            skipped=SKIPPED,
            sampling=first.outputs.sampling,  # the whole set's: every shard samples it alike
            replicas=replicas,
            shards=shards.record(profile, "generate"),
        ),
        data_revision=first.data_revision,
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("generate", run, argv, merge=merge)


if __name__ == "__main__":
    main()
