"""Stage `extract`: capture the verifier's hidden states at the EAGLE-3 layers, with vLLM.

Run as: python -m pipeline.extract --config configs/tiny.yaml

Reads `generate`'s responses and the `verifier` stage. Serves the verifier with vLLM's
``extract_hidden_states`` speculative method and a hidden-state KV connector, and drives it with
speculators' own data generation:

1. ``speculators prepare-data`` tokenises each conversation through the server's chat-template
   render endpoint (so training sees exactly the served template) and writes ``prepared/``
   (``input_ids``, ``loss_mask`` = 1 on assistant tokens only, and ``token_freq.pt`` for the
   draft vocabulary);
2. ``speculators generate-offline-data`` sends every row through the verifier and stores
   ``prepared/hidden_states/hs_<row>.safetensors``: ``hidden_states`` [tokens, layers, hidden]
   for the capture layers plus the last layer (pre-final-norm), and ``token_ids``.

Two profile switches change what is stored (the planner's remedies when hidden states would
not fit): ``extract.hidden_states_format: fp8`` stores float8_e4m3fn with one float32 scale per
token (half of bf16; speculators' fp8 backend reads it), and ``extract.mode: online`` stops
after step 1: training then generates each row's hidden states on demand and stores none.

Invariants:
- captured layer ids are ``verifier.capture_layer_ids + [num_hidden_layers]``, the same ids
  that training and the drafter config receive (recorded in the manifest);
- hidden-state bytes written equal tokens x layers x hidden size x element bytes (checked);
  shards of one format are never added to shards of another;
- every shard is written atomically (temporary file, fsync, rename) by the connector in
  ``pipeline/serving/hidden_states_connector.py``, which writes no shard that would leave less than
  ``extract.disk_reserve_gib`` free; a crash or a full disk leaves no short shard under a real
  name, and the stage then fails naming the space to free;
- before anything is written, free space is checked against the whole estimate plus the reserve;
- speculators skips rows whose shard already exists and is readable, so a rerun resumes;
- counts: ``succeeded + skipped + failed == input``, in assistant turns of the conversations
  `generate` kept: speculators makes one training row per assistant turn.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open

from pipeline.core.atomic_files import atomic_write_bytes, free_bytes, remove_temporaries
from pipeline.core.config import Profile
from pipeline.core.contracts import ExtractOutputs
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import (
    finished_shards,
    now,
    read_input,
    shard_record,
    stage_dir,
    write_manifest,
)
from pipeline.core.progress import watch
from pipeline.core.responses import read_responses
from pipeline.core.server_errors import ServerRejectedError
from pipeline.core.shards import ShardError, sum_counts
from pipeline.serving.extraction import (
    bytes_per_token,
    captured_layer_ids,
    clear_staging,
    reserve_bytes,
    server_flags,
    stored_dtype,
)
from pipeline.serving.logged_process import run_logged
from pipeline.serving.vllm_api import Endpoint
from pipeline.serving.vllm_server import vllm_server
from pipeline.training.text_view import text_view

log = logging.getLogger(__name__)
SAFETENSORS_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8}


class ExtractError(PipelineError):
    """Hidden-state extraction cannot proceed; the message says why and what to do."""


def write_conversations(responses: Path, out: Path) -> dict[str, int]:
    """The kept conversations, in the schema prepare-data reads; returns their counts."""
    lines = []
    turns = 0
    for record in read_responses(responses):
        if record.skip_reason:
            continue
        lines.append(json.dumps({"id": record.id, "conversations": record.conversations}))
        turns += len(record.turns("gpt"))
    atomic_write_bytes(out, ("\n".join(lines) + "\n").encode())
    return {"conversations": len(lines), "assistant_turns": turns}


# How speculators' HTTP clients log a server's error answer: its render client, and openai's.
SERVER_ANSWER = re.compile(r"(?:endpoint returned|Error code:) (\d{3})(?::| -) (.*)")


def speculators_cli(*args: str, log_path: Path, server: str, **bounds: Any) -> None:
    """Run a speculators command (``bounds``: run_logged's ``progress`` and ``stall_s``); when
    it failed because ``server`` answered with an HTTP error (found in its log), say that on one
    line instead of quoting its traceback."""
    cmd = [sys.executable, "-m", "speculators", *args]
    start = log_path.stat().st_size if log_path.exists() else 0  # the log is appended to
    try:
        run_logged(cmd, log_path, ExtractError, f"speculators {args[0]}", **bounds)
    except ExtractError:
        with open(log_path, "rb") as fh:
            fh.seek(start)
            answers = SERVER_ANSWER.findall(fh.read().decode(errors="replace"))
        if not answers:
            raise
        status, body = answers[-1]
        said = ServerRejectedError(int(status), body, server)
        raise ExtractError(f"speculators {args[0]} failed: {said}; log {log_path}") from None


def prepared_stats(prepared: Path, max_seq_len: int) -> dict[str, int]:
    import datasets

    table = datasets.load_from_disk(str(prepared))
    return {
        "rows": len(table),
        "tokens": int(sum(table["seq_len"])),
        "loss_tokens": int(sum(sum(m) for m in table["loss_mask"])),
        "truncated": int(sum(int(n) >= max_seq_len for n in table["seq_len"])),
    }


def check_free_space(folder: Path, needed: int, reserve: int, done: str = "") -> None:
    """Raise, naming the volume and the bytes to free, if ``needed`` would cross the reserve."""
    free = free_bytes(folder)
    if free - needed >= reserve:
        return
    short = needed + reserve - free
    raise ExtractError(
        f"not enough disk for hidden states on {folder}: {done}the rest needs "
        f"{needed / 2**30:.2f} GiB plus the reserve of {reserve / 2**30:.2f} GiB "
        f"(extract.disk_reserve_gib), but {free / 2**30:.2f} GiB is free; free at least "
        f"{short / 2**30:.2f} GiB, or move run.output_dir to a larger volume, or lower "
        "extract.max_seq_len / data.max_samples (see `make plan`). Finished shards are kept; "
        "rerun `make extract` to resume"
    )


def hidden_state_bytes(hs_dir: Path) -> dict[str, int]:
    """Payload bytes of the hidden_states tensors, file bytes, and token count."""
    payload = files = tokens = count = 0
    for path in sorted(hs_dir.glob("hs_*.safetensors")):
        with safe_open(path, framework="pt") as f:
            sl = f.get_slice("hidden_states")
            shape = sl.get_shape()
            payload += SAFETENSORS_DTYPE_BYTES[sl.get_dtype()] * shape[0] * shape[1] * shape[2]
            tokens += shape[0]
        files += path.stat().st_size
        count += 1
    return {"files": count, "tokens": tokens, "hidden_state_bytes": payload, "file_bytes": files}


NO_SHARDS = {"files": 0, "tokens": 0, "hidden_state_bytes": 0, "file_bytes": 0}


def check_shard_format(hs_dir: Path, profile: Profile) -> None:
    """Refuse to add shards of one format to shards of another (a changed profile)."""
    first = next(hs_dir.glob("hs_*.safetensors"), None) if hs_dir.exists() else None
    if first is None:
        return
    with safe_open(first, framework="pt") as f:
        found = f.get_slice("hidden_states").get_dtype()
    if (found == "F8_E4M3") != (profile.extract.hidden_states_format == "fp8"):
        raise ExtractError(
            f"{hs_dir} holds {found} shards from an earlier run, but the profile asks for "
            f"extract.hidden_states_format={profile.extract.hidden_states_format}; delete "
            f"{hs_dir} to extract again in the new format, or set the format back"
        )


def count_shards(hs_dir: Path) -> int:
    return sum(1 for _ in hs_dir.glob("hs_*.safetensors")) if hs_dir.exists() else 0


def stall_bound(profile: Profile) -> float:
    """How long generate-offline-data may go without a new shard before it counts as hung
    (seen once the volume filled: speculators' workers stopped, its event loop idle): every
    attempt of a request timing out, and a minute more."""
    g = profile.generate
    return g.request_timeout_s * (g.max_retries + 1) + 60


def store_hidden_states(
    profile: Profile, endpoint: Endpoint, folder: Path, stats: dict[str, int], expected: int
) -> dict[str, int]:
    """Run speculators' offline generation into ``prepared/hidden_states``; check it is whole."""
    hs_dir = folder / "prepared" / "hidden_states"
    reserve = reserve_bytes(profile)
    check_shard_format(hs_dir, profile)
    done = hidden_state_bytes(hs_dir) if hs_dir.exists() else NO_SHARDS
    check_free_space(folder, expected - done["hidden_state_bytes"], reserve)
    # speculators' output check cannot read fp8 on CPU (no aminmax kernel); our connector
    # checks finiteness before quantising instead.
    validate = [] if profile.extract.hidden_states_format == "fp8" else ["--validate-outputs"]
    try:
        with watch(lambda: count_shards(hs_dir), stats["rows"], desc="extract", unit="shard"):
            speculators_cli(
                "generate-offline-data",
                "--endpoint", endpoint.v1,
                "--preprocessed-data", str(folder / "prepared"),
                "--concurrency", str(profile.extract.concurrency),
                "--max-consecutive-errors", str(profile.extract.concurrency),
                "--request-timeout", str(profile.generate.request_timeout_s),
                "--max-retries", str(profile.generate.max_retries),
                *validate,
                log_path=folder / "generate-offline-data.log",
                server=endpoint.v1,
                progress=lambda: count_shards(hs_dir),
                stall_s=stall_bound(profile),
            )  # fmt: skip
    except ExtractError as err:
        failure: ExtractError | None = err
    else:
        failure = None
    written = hidden_state_bytes(hs_dir)
    if written["hidden_state_bytes"] != expected or written["files"] != stats["rows"]:
        progress_note = f"{written['files']} of {stats['rows']} shards are written and kept; "
        # Shards the connector refused for the reserve leave no file: say how much to free.
        check_free_space(
            folder, expected - written["hidden_state_bytes"], reserve, done=progress_note
        )
        raise ExtractError(
            f"hidden states incomplete: {written['files']} of {stats['rows']} shards, "
            f"{written['hidden_state_bytes']} of {expected} bytes; see "
            f"{folder / 'generate-offline-data.log'} and {folder / 'vllm.log'}; "
            "rerun `make extract` to resume"
        ) from failure
    return written


def prepare_data(
    profile: Profile, model: str, conversations: Path, folder: Path, server: str
) -> None:
    """speculators' tokenisation (through the server's chat-template render endpoint) into
    ``prepared/``; a finished one is kept."""
    prepared = folder / "prepared"
    if (prepared / "dataset_info.json").exists():
        return
    speculators_cli(
        "prepare-data",
        "--model", model,
        "--data", str(conversations),
        "--output", str(prepared),
        "--render-endpoint", server,
        "--seq-length", str(profile.extract.max_seq_len),
        "--seed", str(profile.run.seed),
        "--num-preprocessing-workers", "1",
        "--no-skip-token-freq",
        *(["--trust-remote-code"] if profile.verifier.trust_remote_code else []),
        log_path=folder / "prepare-data.log",
        server=server,
    )  # fmt: skip


def extract_counts(kept: dict[str, int], stats: dict[str, int]) -> dict[str, Any]:
    """In assistant turns: prepare-data makes one row per assistant turn, and skips a turn
    whose context alone fills extract.max_seq_len."""
    skipped = kept["assistant_turns"] - stats["rows"]
    return {
        "input": kept["assistant_turns"],
        "succeeded": stats["rows"],
        "skipped": skipped,
        "failed": 0,
        "skip_reasons": {"context_fills_max_seq_len": skipped} if skipped else {},
        "conversations": kept["conversations"],
        "truncated_to_max_seq_len": stats["truncated"],
    }


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    verifier = read_input(profile, "extract", "verifier").outputs
    generate = read_input(profile, "extract", "generate")
    folder = stage_dir(profile, "extract")
    folder.mkdir(parents=True, exist_ok=True)
    conversations = folder / "conversations.jsonl"
    kept = write_conversations(
        stage_dir(profile, "generate") / generate.outputs.responses, conversations
    )
    if kept["conversations"] == 0:
        raise ExtractError("generate kept no conversation; nothing to extract (see its manifest)")
    prepared = folder / "prepared"
    hs_dir = prepared / "hidden_states"
    clear_staging(folder / "staging")
    if hs_dir.exists():
        remove_temporaries(hs_dir)
    with vllm_server(
        profile,
        verifier.model,
        folder / "vllm.log",
        extra_args=["--enable-scale-out"],  # serves the chat-template render endpoint
        **server_flags(profile, folder / "staging"),
    ) as endpoint:
        # speculators gets the verifier's text model when it is a multimodal wrapper (Kimi-K2.5)
        as_text = text_view(verifier.model, verifier.revision, folder / "verifier-text")
        prepare_data(profile, as_text, conversations, folder, endpoint.base_url)
        stats = prepared_stats(prepared, profile.extract.max_seq_len)
        expected = stats["tokens"] * bytes_per_token(profile)
        if profile.extract.mode == "online":
            # Training generates the missing rows' hidden states on demand; shards an earlier
            # offline run stored are used as they are (speculators' hybrid mode).
            written = hidden_state_bytes(hs_dir) if hs_dir.exists() else NO_SHARDS
            expected = written["hidden_state_bytes"]
        else:
            written = store_hidden_states(profile, endpoint, folder, stats, expected)
    outputs = ExtractOutputs(
        mode=profile.extract.mode,
        prepared="prepared",
        hidden_states="prepared/hidden_states",
        token_freq="prepared/token_freq.pt",
        captured_layer_ids=captured_layer_ids(profile),
        hidden_size=profile.verifier.hidden_size,
        dtype=stored_dtype(profile),
        bytes_per_token=bytes_per_token(profile),
        **{**stats, **written},
        expected_hidden_state_bytes=expected,
        shard=shard_record(profile, verifier),
    )
    return write_manifest(
        profile,
        "extract",
        started_at=started,
        counts=extract_counts(kept, stats),
        outputs=outputs,
        data_revision=generate.data_revision,
    )


def link_shards(parts: list[Path], prepared: Path) -> None:
    """One ``prepared`` folder over the shards' ``parts``: their datasets concatenated in order,
    token frequencies summed, and each shard's hidden states linked (relative symlinks, never
    copied) under the row numbers of the whole: ``hs_<offset + i>`` -> the shard's ``hs_<i>``.
    Built beside ``prepared``; the old one is renamed aside before the new one takes its name,
    so a crash leaves one of them (``prepared`` or ``prepared.old``) whole."""
    import datasets
    from speculators.train.vocab_mapping import combine_token_frequency_distributions

    stored = prepared / "hidden_states"
    if stored.is_dir() and any(not p.is_symlink() for p in stored.iterdir()):
        raise ShardError(
            f"extract --merge: {stored} holds an unsharded extraction's hidden states, which a "
            "merge would replace; move them away (or delete them) first"
        )
    staging = prepared.with_name(prepared.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tables = [datasets.load_from_disk(str(part)) for part in parts]
    datasets.concatenate_datasets(tables).save_to_disk(str(staging))
    combine_token_frequency_distributions(
        [part / "token_freq.pt" for part in parts], staging / "token_freq.pt"
    )
    links = staging / "hidden_states"
    links.mkdir()
    offset = 0
    for part, table in zip(parts, tables, strict=True):
        for i in range(len(table)):
            shard_file = part / "hidden_states" / f"hs_{i}.safetensors"
            if shard_file.exists():  # online mode stores none
                target = os.path.relpath(shard_file, links)
                (links / f"hs_{offset + i}.safetensors").symlink_to(target)
        offset += len(table)
    old = prepared.with_name(prepared.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if prepared.exists():
        prepared.rename(old)
    staging.rename(prepared)
    shutil.rmtree(old, ignore_errors=True)


def merge(profile: Profile) -> dict[str, Any]:
    """``--merge``: the finished shards (run.shard=k/S) as one extract folder that train reads
    as it reads an unsharded one, without copying a hidden state; refused unless every shard is
    there, fresh, made alike, and extracted from the generate shards the merged generate was
    made of."""
    started = now()
    verifier = read_input(profile, "extract", "verifier").outputs
    generate = read_input(profile, "extract", "generate")
    if not generate.outputs.shards:
        raise ShardError(
            "extract --merge: generate was not merged from shards; run `generate --merge` "
            "first (the same shards extract read)"
        )
    shards = finished_shards(profile, "extract", verifier)
    made_from = generate.outputs.shards["manifests"]
    for shard, manifest in shards.manifests.items():
        if manifest.inputs["generate"].sha256 != made_from.get(shard.name):
            raise ShardError(
                f"extract: shard {shard} was made from a generate shard {shard} other than the "
                "one the merged generate holds (one of them was rerun since); rerun extract "
                f"shard {shard}, or merge generate again"
            )
    folder = stage_dir(profile, "extract")
    parts = [
        shards.folder(profile, "extract", s) / m.outputs.prepared
        for s, m in shards.manifests.items()
    ]
    link_shards(parts, folder / "prepared")
    first = next(iter(shards.manifests.values())).outputs
    summed = ("rows", "tokens", "loss_tokens", "truncated", "expected_hidden_state_bytes")
    stats = {k: sum(getattr(m.outputs, k) for m in shards.manifests.values()) for k in summed}
    written = hidden_state_bytes(folder / "prepared" / "hidden_states")  # read through the links
    if first.mode == "offline" and written["hidden_state_bytes"] != stats[summed[-1]]:
        raise ShardError(
            f"extract --merge: the shards' hidden states hold {written['hidden_state_bytes']} "
            f"bytes, their manifests {stats[summed[-1]]}; a shard changed after it finished: "
            "rerun it"
        )
    outputs = first.model_copy(
        update={**stats, **written, "shard": None, "shards": shards.record(profile, "extract")}
    )
    log.info("extract: merged %d shards, %d rows", shards.count, stats["rows"])
    return write_manifest(
        profile,
        "extract",
        started_at=started,
        counts=sum_counts([m.counts for m in shards.manifests.values()]),
        outputs=outputs,
        data_revision=generate.data_revision,
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("extract", run, argv, merge=merge)


if __name__ == "__main__":
    main()
