"""`make bench`: the pipeline's hot parts against bare baselines, measured side by side.

Run as: python -m pipeline.tools.bench --config configs/tiny.yaml

Writes ``<run>/bench/results.json``, ``results.md`` and ``manifest.json``. Each ratio is
baseline time / our time over the same work in the same round, above 1 when ours is faster;
``--repeats`` rounds alternate the order, and every time and ratio is reported as min / median /
max with its target and whether the range meets it, misses it or straddles it (the machine's
noise then exceeds the difference, and one run would have said either):

- **client**: our generation client (``pipeline.generate.regenerate_all``: retries, turn
  handling, records fsynced in groups) against a bare ``aiohttp`` loop with a semaphore, on the
  same local endpoint at ``--concurrency``. The endpoint is ``pipeline.tools.bench_endpoint``, a
  stand-in with a fixed latency that is never the bottleneck, so client overhead shows. A bare
  ``httpx`` loop is timed once as a reference row: it is why the client is built on aiohttp.
- **generate stage as a process**: ``python -m pipeline.generate`` against the same endpoint
  (import, profile, dataset loading, manifest included) against a bare-loop script run as a
  process.
- **shard writer**: ``pipeline.core.atomic_files.save_tensors_atomically`` (safetensors
  serialisation, temporary file, fsync, rename) against ``dd conv=fsync`` writing the same bytes
  to the same number of files on the same disk; shards have the hero profile's shape by default.
  The same rounds time where the difference goes: dd of zeros (the first baseline, which storage
  can write faster than real data), dd without fsync (the page cache alone) and our writes into
  tmpfs (serialisation and a memory copy, no disk).
- **bytes per token**: the shard files' bytes against the planner's formula (captured layers x
  hidden size x dtype bytes); the rest is 8 bytes of token id per token (the formula counts
  hidden states only) and the safetensors header, reported with and without the token ids.

No timing here is asserted by a test; the numbers go in the README.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from pipeline.core.atomic_files import atomic_write_bytes, save_tensors_atomically
from pipeline.core.config import Profile, load_profile
from pipeline.core.contracts import BenchOutputs
from pipeline.core.manifest import all_succeeded, now, stage_dir, write_manifest
from pipeline.core.portable import REPO_ROOT
from pipeline.core.prompts import PromptRow
from pipeline.generate import ResponseWriter, regenerate_all
from pipeline.serving.extraction import DTYPE_BYTES, bytes_per_token, captured_layer_ids
from pipeline.serving.vllm_api import LOOPBACK, Endpoint, free_port, wait_until_healthy
from pipeline.serving.vllm_server import process_exit

PROMPT = "Say something short about benchmarks."


def prompt_rows(n: int) -> list[PromptRow]:
    msg = ({"role": "user", "content": PROMPT},)
    return [PromptRow(id=f"bench-{i}", source="bench", messages=msg) for i in range(n)]


def write_prompt_file(path: Path, n: int) -> None:
    row = {"source": "bench", "conversations": [{"from": "human", "value": PROMPT}]}
    lines = (json.dumps({"id": f"bench-{i}", **row}) for i in range(n))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())


@contextlib.contextmanager
def stand_in_endpoint(delay_ms: float, log_path: Path) -> Iterator[str]:
    port = free_port(LOOPBACK)
    cmd = [sys.executable, "-m", "pipeline.tools.bench_endpoint", "--port", str(port)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*cmd, "--delay-ms", str(delay_ms)], stdout=log, stderr=subprocess.STDOUT
        )
    base = f"http://{LOOPBACK}:{port}"
    try:
        wait_until_healthy(base, 60, process_exit(proc, "the stand-in"), log_path)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def bare_loop(v1: str, n: int, concurrency: int, max_tokens: int) -> None:
    """The baseline: the least an aiohttp client can do to send ``n`` chat requests."""
    sem = asyncio.Semaphore(concurrency)
    body = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}]}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with (
                sem,
                session.post(
                    f"{v1}/chat/completions", json={**body, "max_tokens": max_tokens}
                ) as resp,
            ):
                resp.raise_for_status()
                await resp.json()

        await asyncio.gather(*(one() for _ in range(n)))


async def bare_httpx_loop(v1: str, n: int, concurrency: int, max_tokens: int) -> None:
    """A reference row: the same loop on httpx, the client the stages used before aiohttp."""
    sem = asyncio.Semaphore(concurrency)
    body = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}]}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one() -> None:
            async with sem:
                resp = await client.post(
                    f"{v1}/chat/completions", json={**body, "max_tokens": max_tokens}
                )
                resp.raise_for_status()
                resp.json()

        await asyncio.gather(*(one() for _ in range(n)))


def seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spread(values: list[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 4),
        "median": round(statistics.median(values), 4),
        "max": round(max(values), 4),
    }


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Each of ``fns`` timed ``repeats`` times in rounds, the order rotated every round, so
    drift (page cache, a neighbour's load, thermal) falls on all of them alike."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(seconds(fns[name]))
    return times


def verdict(ratio: dict[str, float], target: float) -> str:
    if ratio["min"] >= target:
        return "meets target"
    if ratio["max"] < target:
        return "misses target"
    return "straddles target"


def compared(base_s: list[float], ours_s: list[float], target: float) -> dict[str, Any]:
    """Times and round-by-round ratios baseline/ours (above 1: ours faster) as min / median /
    max, and where the ratios lie against ``target``: a range that straddles it says the
    machine's noise is larger than the difference, and no single run decides."""
    ratio = spread([b / o for b, o in zip(base_s, ours_s, strict=True)])
    return {
        "repeats": len(base_s),
        "baseline_s": spread(base_s),
        "ours_s": spread(ours_s),
        "ratio": ratio,
        "target": target,
        "verdict": verdict(ratio, target),
    }


def side_by_side(
    baseline: Callable[[], Any], ours: Callable[[], Any], repeats: int, target: float
) -> dict[str, Any]:
    times = interleaved({"baseline": baseline, "ours": ours}, repeats)
    return compared(times["baseline"], times["ours"], target)


def bench_client(profile: Profile, base: str, folder: Path, args: argparse.Namespace) -> dict:
    rows = prompt_rows(args.requests)
    endpoint = Endpoint(base_url=base, model="bench", started_here=False)
    out = folder / "client-responses.jsonl"

    def ours() -> None:
        out.unlink(missing_ok=True)
        writer = ResponseWriter(out)
        try:
            (tally,), _ = asyncio.run(regenerate_all(profile, [endpoint], rows, writer))
            failed = tally["failed"]
        finally:
            writer.close()
        assert failed == 0, f"{failed} requests failed against the stand-in endpoint"

    def baseline() -> None:
        asyncio.run(bare_loop(endpoint.v1, args.requests, args.concurrency, args.max_tokens))

    def httpx_reference() -> None:
        asyncio.run(bare_httpx_loop(endpoint.v1, args.requests, args.concurrency, args.max_tokens))

    result = side_by_side(baseline, ours, args.repeats, args.client_target)
    result["requests_per_s_ours"] = round(args.requests / result["ours_s"]["median"], 1)
    result["requests_per_s_bare"] = round(args.requests / result["baseline_s"]["median"], 1)
    httpx_s = seconds(httpx_reference)
    result["requests_per_s_bare_httpx"] = round(args.requests / httpx_s, 1)
    return result


def bench_stage_process(profile: Profile, base: str, folder: Path, args) -> dict:
    prompts = folder / "prompts.jsonl"
    write_prompt_file(prompts, args.requests)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PROGRESS": "0"}
    verifier_manifest = stage_dir(profile, "verifier") / "manifest.json"
    runs = folder / "stage-runs"

    def ours() -> None:
        shutil.rmtree(runs, ignore_errors=True)
        target = runs / profile.run.name / "verifier"
        target.mkdir(parents=True)
        shutil.copy(verifier_manifest, target)  # generate reads the verifier's manifest
        cmd = [sys.executable, "-m", "pipeline.generate", "--config", args.config,
               f"run.output_dir={runs}", f"server.base_url={base}", f"data.dataset={prompts}",
               f"generate.concurrency={args.concurrency}",
               f"generate.max_tokens={args.max_tokens}"]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, capture_output=True)

    def baseline() -> None:
        cmd = [sys.executable, "-m", "pipeline.tools.bench", "--bare-loop", f"{base}/v1",
               str(args.requests), str(args.concurrency), str(args.max_tokens)]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, capture_output=True)

    return side_by_side(baseline, ours, args.repeats, args.stage_target)


def bench_shards(shape_profile: Profile, folder: Path, args: argparse.Namespace) -> dict:
    import torch
    from safetensors.torch import save, save_file

    v = shape_profile.verifier
    layers = len(captured_layer_ids(shape_profile))
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    tensors = {
        "hidden_states": torch.randn(args.shard_tokens, layers, v.hidden_size).to(dtype[v.dtype]),
        "token_ids": torch.arange(args.shard_tokens, dtype=torch.int64),
    }
    shard_dir = folder / "shards"
    same_bytes = folder / "dd-source.safetensors"  # dd's input: the very bytes we write
    nbytes = 0

    def fresh() -> None:
        shutil.rmtree(shard_dir, ignore_errors=True)
        shard_dir.mkdir(parents=True)

    def ours() -> None:
        nonlocal nbytes
        fresh()
        for i in range(args.shards):
            nbytes = save_tensors_atomically(tensors, shard_dir / f"hs_{i}.safetensors")

    def dd(source: str, fsync: bool) -> Callable[[], None]:
        def write_all() -> None:
            fresh()
            for i in range(args.shards):
                subprocess.run(
                    ["dd", f"if={source}", f"of={shard_dir / f'dd_{i}'}", f"bs={nbytes}",
                     "count=1", "status=none", *(["conv=fsync"] if fsync else [])],
                    check=True,
                )  # fmt: skip

        return write_all

    memory = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else folder))

    def into_memory() -> None:  # the same safetensors writes into tmpfs: no disk, no fsync
        for _ in range(args.shards):
            save_file(tensors, memory / "shard.safetensors")

    ours()  # sizes the dd blocks and warms the page cache's allocator for all
    atomic_write_bytes(same_bytes, save(tensors))
    times = interleaved(
        {
            "dd": dd(str(same_bytes), fsync=True),
            "ours": ours,
            "dd_zeros": dd("/dev/zero", fsync=True),
            "dd_no_fsync": dd(str(same_bytes), fsync=False),
            "into_memory": into_memory,
        },
        args.repeats,
    )
    result = compared(times["dd"], times["ours"], args.shard_target)
    ours()  # leave our shards on disk to measure them
    file_bytes = sum(p.stat().st_size for p in shard_dir.glob("hs_*.safetensors"))
    tokens = args.shards * args.shard_tokens
    formula = bytes_per_token(shape_profile)
    payload = tokens * formula
    token_id_bytes = tokens * 8
    shutil.rmtree(shard_dir)
    shutil.rmtree(memory)
    same_bytes.unlink()
    mb = args.shards * nbytes / 1e6
    return {
        **result,
        "shape": [args.shard_tokens, layers, v.hidden_size],
        "dtype": v.dtype,
        "shards": args.shards,
        "shard_bytes": nbytes,
        "dd_mb_per_s": round(mb / result["baseline_s"]["median"], 1),
        "ours_mb_per_s": round(mb / result["ours_s"]["median"], 1),
        # Where the time goes, from the same rounds: dd of zeros (the baseline before; storage
        # may treat zero pages specially), dd without fsync (the page cache alone), and our
        # writes into tmpfs (serialisation and a memory copy, no disk).
        "breakdown": {
            "dd_zeros": compared(times["dd_zeros"], times["ours"], args.shard_target),
            "dd_no_fsync_s": spread(times["dd_no_fsync"]),
            "fsync_share_of_dd": round(
                1 - statistics.median(times["dd_no_fsync"]) / statistics.median(times["dd"]), 3
            ),
            "into_memory_s": spread(times["into_memory"]),
            "into_memory_share_of_ours": round(
                statistics.median(times["into_memory"]) / statistics.median(times["ours"]), 3
            ),
        },
        "bytes_per_token": {
            "formula": formula,
            "formula_terms": f"{layers} layers x {v.hidden_size} x {DTYPE_BYTES[v.dtype]} B",
            "file": round(file_bytes / tokens, 3),
            "file_over_formula": round(file_bytes / payload - 1, 8),
            # Without the token ids (a tensor the formula leaves out): headers alone.
            "file_without_token_ids_over_formula": round(
                (file_bytes - token_id_bytes) / payload - 1, 8
            ),
            "header_bytes_per_file": (file_bytes - payload - token_id_bytes) // args.shards,
            "token_id_bytes_per_token": 8,
        },
    }


def span(times: dict[str, float], unit: str = "") -> str:
    return f"{times['min']} / {times['median']} / {times['max']}{unit}"


def results_markdown(results: dict[str, Any]) -> str:
    c, p, s = results["client"], results["generate_stage_process"], results["shard_writer"]
    bpt, parts = s["bytes_per_token"], s["breakdown"]
    a = results["settings"]

    def row(what: str, r: dict[str, Any]) -> str:
        return (
            f"| {what} | {span(r['baseline_s'], ' s')} | {span(r['ours_s'], ' s')} | "
            f"{span(r['ratio'])} | {r['target']} | {r['verdict']} |"
        )

    zeros = parts["dd_zeros"]
    return "\n".join(
        [
            f"Each figure is min / median / max over {a['repeats']} rounds in which baseline and "
            "ours run one after the other (the order alternating); a ratio is baseline / ours "
            "within one round (above 1: ours faster).",
            "",
            "| measurement | baseline | ours | ratio | target | verdict |",
            "|---|---|---|---|---|---|",
            row(
                f"generation client, {a['requests']} requests at concurrency "
                f"{a['concurrency']} vs bare aiohttp loop",
                c,
            ),
            row("generate stage as a process vs bare-loop process", p),
            row(
                f"shard writer vs `dd conv=fsync` of the same bytes, {s['shards']} x "
                f"{s['shard_bytes']:,} B {s['shape']} {s['dtype']}",
                s,
            ),
            "",
            f"Requests per second (medians): ours {c['requests_per_s_ours']}, bare aiohttp loop "
            f"{c['requests_per_s_bare']}, bare httpx loop {c['requests_per_s_bare_httpx']} "
            f"(stand-in endpoint, {a['delay_ms']} ms per request).",
            "",
            f"Shard writer, where the time goes (medians): dd {s['dd_mb_per_s']} MB/s, ours "
            f"{s['ours_mb_per_s']} MB/s; fsync is {parts['fsync_share_of_dd']:.0%} of dd's time "
            f"(without it {span(parts['dd_no_fsync_s'], ' s')}); our writes into tmpfs (no disk) "
            f"{span(parts['into_memory_s'], ' s')}, {parts['into_memory_share_of_ours']:.0%} of "
            "ours. "
            f"Against `dd` of zeros (the baseline before): ratio {span(zeros['ratio'])}, "
            f"{zeros['verdict']}.",
            "",
            f"Bytes per token: formula {bpt['formula']:,} ({bpt['formula_terms']}); files "
            f"{bpt['file']:,}, {bpt['file_over_formula']:.4%} over: "
            f"{bpt['token_id_bytes_per_token']} B of token id per token and a "
            f"{bpt['header_bytes_per_file']} B header per file; without the token ids, "
            f"{bpt['file_without_token_ids_over_formula']:.4%} over.",
            "",
        ]
    )


def run(profile: Profile, args: argparse.Namespace) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "bench")
    folder.mkdir(parents=True, exist_ok=True)
    client_profile = load_profile(
        args.config,
        [*args.overrides, f"generate.concurrency={args.concurrency}",
         f"generate.max_tokens={args.max_tokens}"],
    )  # fmt: skip
    with stand_in_endpoint(args.delay_ms, folder / "endpoint.log") as base:
        client = bench_client(client_profile, base, folder, args)
        stage = bench_stage_process(profile, base, folder, args)
    shards = bench_shards(load_profile(args.shard_profile), folder, args)
    results = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("overrides", "bare_loop")},
        "client": client,
        "generate_stage_process": stage,
        "shard_writer": shards,
    }
    atomic_write_bytes(folder / "results.json", (json.dumps(results, indent=2) + "\n").encode())
    atomic_write_bytes(folder / "results.md", results_markdown(results).encode())
    print(results_markdown(results))
    return write_manifest(
        profile,
        "bench",
        started_at=started,
        counts=all_succeeded(3),
        outputs=BenchOutputs(results="results.json", table="results.md"),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--delay-ms", type=float, default=50, help="stand-in endpoint latency")
    parser.add_argument("--repeats", type=int, default=9, help="alternating rounds per ratio")
    # Targets, as baseline / ours: the client within 5% of a bare loop; the stage's start-up
    # (imports, profile, manifest) within a third of a bare-loop process over the default
    # requests; the shard writer within 10% of dd writing the same bytes with fsync.
    parser.add_argument("--client-target", type=float, default=0.95)
    parser.add_argument("--stage-target", type=float, default=0.75)
    parser.add_argument("--shard-target", type=float, default=0.9)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-tokens", type=int, default=1000)
    parser.add_argument(
        "--shard-profile", default="configs/kimi-k2.5.yaml", help="profile giving shard shape"
    )
    parser.add_argument("--bare-loop", help=argparse.SUPPRESS)  # the baseline as a process
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    if args.bare_loop:
        n, concurrency, max_tokens = map(int, args.overrides)
        asyncio.run(bare_loop(args.bare_loop, n, concurrency, max_tokens))
        return
    from pipeline.core.cli import report

    report(lambda: run(load_profile(args.config, args.overrides), args))


if __name__ == "__main__":
    main()
