"""`make plan`: will this run fit, how long will each phase take, and what will it cost?

Run as: python -m pipeline.tools.plan --config configs/kimi-k2.5.yaml [--check]

Plans in tokens, not samples: reasoning responses vary from hundreds to thousands of tokens,
so every figure derives from tokens per sample. Inputs come from the profile (verifier
dimensions, captured layers, dtype, sample count, max sequence length, ``plan`` section with
the expected tokens per sample and the machine profiles). Where a pilot or partial run of the
same profile has finished stages, their manifests replace the guesses: measured tokens per
sample and measured rates. Each figure says whether it was measured or assumed.

A sample is one prompt that `generate` reads (``planned_samples``), and every per-sample figure
is measured per such prompt: extracted tokens and generated tokens are divided by the prompts
generate read, not by the conversations it kept nor by the training rows extract made (one per
assistant turn, so a multi-turn conversation is several rows). So samples x tokens per sample x
bytes per token is what a run of that many prompts writes, skips and multi-turn rows included.

With ``--check`` (what ``make hero-run`` runs first) a run whose hidden states would not fit on
the target volume is refused before anything starts, with the remedies and their figures.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from pipeline.core.atomic_files import existing_folder, free_bytes
from pipeline.core.config import MachineProfile, Profile, load_profile
from pipeline.core.contracts import GenerateOutputs, Manifest
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import StageInputError, stage_manifest
from pipeline.core.progress import byte_size as size
from pipeline.core.prompts import count_rows, resolve_local
from pipeline.core.serving_platform import check_build_matches_machine
from pipeline.serving.extraction import bytes_per_token, captured_layer_ids, element_bytes

TB = 10**12


class PlanError(PipelineError):
    """The run as configured cannot complete; the message lists the remedies."""


@dataclass(frozen=True)
class Figure:
    value: float
    source: str  # "measured (<stage>, ...)" or "assumed (plan.<field>)"


def _manifest(profile: Profile, stage: str) -> Manifest[Any] | None:
    """A finished, current stage's manifest; None for a stage to (re)run."""
    try:
        return stage_manifest(profile, stage)
    except StageInputError:
        return None


def prompts_read(generate: Manifest[GenerateOutputs]) -> int:
    """The prompts a finished generate read: what data.max_samples drew (its sampling record),
    the same number ``planned_samples`` plans."""
    return sum(s["sampled"] for s in generate.outputs.sampling["by_source"].values())


def measured_or_assumed(profile: Profile) -> dict[str, Figure]:
    """Per-sample figures and local rates: from finished stages where they exist.

    A sample is a prompt generate read (kept, skipped or malformed alike), so the measured
    figures are totals divided by the prompts generate read.
    """
    p = profile.plan
    figures = {
        "tokens_per_sample": Figure(p.tokens_per_sample, "assumed (plan.tokens_per_sample)"),
        "completion_tokens_per_sample": Figure(
            p.completion_tokens_per_sample, "assumed (plan.completion_tokens_per_sample)"
        ),
        # Training rows per sample: one per assistant turn (extract.max_seq_len caps each row).
        "rows_per_sample": Figure(1, "assumed (one row per sample)"),
    }
    gen, ext = _manifest(profile, "generate"), _manifest(profile, "extract")
    prompts = prompts_read(gen) if gen else 0
    if prompts and gen.counts["succeeded"]:
        counts = gen.counts
        figures["completion_tokens_per_sample"] = Figure(
            counts["completion_tokens"] / prompts, f"measured (generate, {prompts} prompts)"
        )
        # Counts cover every record in the file, the wall time only the last invocation: rate
        # its share (the prompts its replicas finished), none when a rerun found all done.
        here = sum(r["finished"] for r in gen.outputs.replicas)
        share = min(here / counts["succeeded"], 1.0)
        if share and gen.wall_time_s > 0:
            figures["generate_tokens_per_s"] = Figure(
                counts["completion_tokens"] * share / gen.wall_time_s, "measured (generate)"
            )
    if prompts and ext and ext.outputs.rows:
        out = ext.outputs
        source = f"measured (extract, {out.rows} rows of {prompts} prompts)"
        figures["tokens_per_sample"] = Figure(out.tokens / prompts, source)
        figures["rows_per_sample"] = Figure(out.rows / prompts, source)
        figures["extract_tokens_per_s"] = Figure(out.tokens / ext.wall_time_s, "measured (extract)")
    return figures


def planned_samples(profile: Profile) -> int:
    """How many prompts generate will read: data.max_samples, at most the rows of a local set,
    and the prompts the verifier writes itself (data.self_written.count)."""
    d = profile.data
    own = d.self_written.count if d.self_written else 0
    if resolve_local(d.dataset) is None:
        if d.max_samples is None:
            raise PlanError(f"set data.max_samples: the planner does not download {d.dataset!r}")
        return d.max_samples + own
    rows = count_rows(d.dataset, d.revision, d.split)
    return (rows if d.max_samples is None else min(d.max_samples, rows)) + own


def phase_hours(
    profile: Profile,
    machine: MachineProfile,
    figures: dict[str, Figure],
    tokens: float,
    completion_tokens: float,
    local: bool,
) -> dict[str, float]:
    """Hours per phase on ``machine``; measured rates replace the local machine's assumed ones."""
    gen_rate = machine.generate_tokens_per_s
    ext_rate = machine.extract_tokens_per_s
    if local and "generate_tokens_per_s" in figures:
        gen_rate = figures["generate_tokens_per_s"].value
    if local and "extract_tokens_per_s" in figures:
        ext_rate = figures["extract_tokens_per_s"].value
    steps = tokens * profile.train.epochs / profile.plan.train_tokens_per_step
    # Online, hidden states are generated again for every epoch, alongside training.
    passes = profile.train.epochs if profile.extract.mode == "online" else 1
    return {
        "inference": completion_tokens / gen_rate / 3600,
        "extraction": passes * tokens / ext_rate / 3600,
        "training": steps / machine.train_steps_per_s / 3600,
    }


def remedies_for(
    profile: Profile,
    samples: int,
    per_sample: float,
    rows_per_sample: float,
    budget: float,
    local: dict[str, Any],
) -> list[dict[str, Any]]:
    """Each profile switch that shrinks the stored hidden states, with its figures."""
    if budget <= 0:  # below the reserve already: no switch can make room
        return [
            {
                "remedy": "make room: the free space is below extract.disk_reserve_gib, so "
                "nothing can be stored",
                "hidden_state_bytes": None,
                "fits": False,
                "switch": "free space there, point run.output_dir at a larger volume, or lower "
                "extract.disk_reserve_gib",
            }
        ]
    bpt = bytes_per_token(profile)
    tokens = samples * per_sample
    # extract.max_seq_len caps each row, and a sample is rows_per_sample rows.
    fit_len = max(0, int(budget / bpt / samples / rows_per_sample)) if samples else 0
    fit_samples = max(0, int(budget / bpt / per_sample)) if per_sample else 0
    extraction = local["hours"]["extraction"]
    remedies = []
    if profile.extract.mode != "online":
        remedies.append(
            {
                "remedy": "online training: hidden states generated on demand each epoch, none "
                f"stored; extraction {duration(extraction * profile.train.epochs)} on "
                f"{local['name']} instead of {duration(extraction)}",
                "hidden_state_bytes": 0,
                "fits": budget >= 0,
                "switch": "extract.mode=online",
            }
        )
    if profile.extract.hidden_states_format != "fp8":
        fp8 = tokens * bytes_per_token(profile, dtype_bytes=1)
        remedies.append(
            {
                "remedy": "fp8 hidden states (e4m3 with a per-token scale; half of bf16)",
                "hidden_state_bytes": fp8,
                "fits": fp8 <= budget,
                "switch": "extract.hidden_states_format=fp8",
            }
        )
    return [
        *remedies,
        {
            "remedy": f"shorter sequences: at most {fit_len} tokens per row",
            "hidden_state_bytes": samples * min(per_sample, rows_per_sample * fit_len) * bpt,
            "fits": fit_len > 0,
            "switch": f"extract.max_seq_len={fit_len}",
        },
        {
            "remedy": f"fewer samples: {fit_samples}",
            "hidden_state_bytes": fit_samples * per_sample * bpt,
            "fits": fit_samples > 0,
            "switch": f"data.max_samples={fit_samples}",
        },
    ]


def build_plan(profile: Profile) -> dict[str, Any]:
    figures = measured_or_assumed(profile)
    samples = planned_samples(profile)
    rows_per_sample = figures["rows_per_sample"].value
    per_sample = min(
        figures["tokens_per_sample"].value, rows_per_sample * profile.extract.max_seq_len
    )
    tokens = samples * per_sample
    bpt = bytes_per_token(profile)
    hidden = tokens * bpt if profile.extract.mode == "offline" else 0
    volume = existing_folder(profile.run.output_dir)
    free = free_bytes(volume)
    volume_name = f"{volume} (measured)"
    if profile.plan.target_volume_free_tb is not None:
        free = int(profile.plan.target_volume_free_tb * TB)
        volume_name = f"{profile.run.output_dir} (assumed, plan.target_volume_free_tb)"
    reserve = int(profile.extract.disk_reserve_gib * 2**30)
    budget = free - reserve
    link = profile.plan.link_gbps * 1e9 / 8 * profile.plan.link_efficiency  # bytes/s
    completion = samples * figures["completion_tokens_per_sample"].value
    machines = []
    for i, m in enumerate(profile.plan.machines):
        hours = phase_hours(profile, m, figures, tokens, completion, local=i == 0)
        total = sum(hours.values())
        machines.append(
            {
                "name": m.name,
                "hours": hours,
                "total_hours": total,
                "cost_usd": total * m.hourly_usd if m.hourly_usd else None,
            }
        )
    remedies = []
    if hidden > budget:
        remedies = remedies_for(profile, samples, per_sample, rows_per_sample, budget, machines[0])
    return {
        "samples": samples,
        "tokens_per_sample": figures["tokens_per_sample"],
        "completion_tokens_per_sample": figures["completion_tokens_per_sample"],
        "total_tokens": tokens,
        "bytes_per_token": bpt,
        "hidden_state_bytes": hidden,
        "volume": volume_name,
        "free_bytes": free,
        "reserve_bytes": reserve,
        "fits": hidden <= budget,
        "transfer_hours": hidden / link / 3600,
        "completion_tokens": completion,
        "machines": machines,
        "remedies": remedies,
        "cluster": cluster_plan(profile, figures, tokens, completion, hidden),
    }


PLACEMENTS = {
    "training_node": "extract on the training node",
    "shared_filesystem": "a shared filesystem",
    "node_local": "node-local disks, training on every node",
}


def cluster_plan(
    profile: Profile, figures: dict[str, Figure], tokens: float, completion: float, hidden: float
) -> dict[str, Any] | None:
    """Per node count and hidden-state placement: hours and node-hours per phase, bytes over
    the fabric, whether the hidden states fit, and why a placement is refused. Generate and
    extract run by shard on every node that holds a shard; training runs on one node unless
    the hidden states are node-local (each node's ranks read the shards it extracted)."""
    c = profile.plan.cluster
    if c is None:
        return None
    index = next((i for i, m in enumerate(profile.plan.machines) if m.name == c.machine), 0)
    machine = profile.plan.machines[index]
    hours = phase_hours(profile, machine, figures, tokens, completion, local=index == 0)
    fabric = c.fabric_gbps * 1e9 / 8 * c.fabric_efficiency  # bytes/s per node
    epochs = profile.train.epochs
    steps = tokens * epochs / profile.plan.train_tokens_per_step
    step_s = 1 / machine.train_steps_per_s
    gradient = c.drafter_parameters * c.gradient_bytes
    rows = []
    for n in c.nodes:
        for placement in PLACEMENTS if n > 1 else ["training_node"]:
            train_nodes = n if placement == "node_local" else 1
            extract_nodes = 1 if placement == "training_node" else n
            # A ring all-reduce moves 2 (T-1)/T of the gradient through each node per step.
            allreduce_s = 2 * (train_nodes - 1) / train_nodes * gradient / fabric
            wall = {
                "generate": hours["inference"] / n,
                "extract": hours["extraction"] / extract_nodes,
                "train": steps / train_nodes * max(step_s, allreduce_s) / 3600,
            }
            fabric_bytes = 0.0
            refused = None
            if placement == "shared_filesystem":
                # Written once from every node, read once per epoch by the training node.
                wall["extract"] = max(wall["extract"], hidden / n / fabric / 3600)
                wall["train"] = max(wall["train"], epochs * hidden / fabric / 3600)
                fabric_bytes = hidden * (1 + epochs)
                if hidden / fabric / 3600 > hours["extraction"]:
                    refused = (
                        f"the training node would read the hidden states over its "
                        f"{c.fabric_gbps:g} Gbps fabric in {duration(hidden / fabric / 3600)} "
                        f"per epoch, slower than extracting them on it "
                        f"({duration(hours['extraction'])})"
                    )
            if placement == "node_local" and train_nodes > 1:
                fabric_bytes = steps / train_nodes * 2 * (train_nodes - 1) * gradient
                if allreduce_s >= step_s:  # torchrun --nnodes only where the fabric keeps up
                    refused = (
                        f"training across nodes does not pay: the gradient all-reduce "
                        f"({size(2 * (train_nodes - 1) / train_nodes * gradient)} through each "
                        f"node) takes {allreduce_s * 1e3:,.0f} ms per step against a "
                        f"{step_s * 1e3:,.0f} ms step"
                    )
            per_node_disk = hidden / (n if placement == "node_local" else 1)
            fits = (
                hidden <= (c.shared_filesystem_tb or 0) * TB
                if placement == "shared_filesystem"
                else per_node_disk <= c.node_disk_tb * TB
            )
            node_hours = (
                hours["inference"] + wall["extract"] * extract_nodes + wall["train"] * train_nodes
            )
            rows.append(
                {
                    "nodes": n,
                    "placement": placement,
                    "hours": wall,
                    "wall_hours": sum(wall.values()),
                    "node_hours": node_hours,
                    "cost_usd": node_hours * machine.hourly_usd if machine.hourly_usd else None,
                    "fabric_bytes": fabric_bytes,
                    "hidden_state_bytes_per_disk": per_node_disk,
                    "fits": fits,
                    "refused": refused,
                    # Training from node-local shards needs each node's ranks to read the rows
                    # that node extracted; speculators splits the rows by rank alone.
                    "supported": placement != "node_local",
                    "allreduce_s": allreduce_s,
                    "step_s": step_s,
                }
            )
    for n in c.nodes:  # the fastest placement that fits, or the one the profile names
        mine = [r for r in rows if r["nodes"] == n]
        ok = [r for r in mine if r["fits"] and not r["refused"] and r["supported"]]
        if c.placement != "auto":
            ok = [r for r in ok if r["placement"] == c.placement or n == 1]
        if ok:
            min(ok, key=lambda r: r["wall_hours"])["chosen"] = True
    return {
        "machine": machine.name,
        "fabric_gbps": c.fabric_gbps,
        "gradient_bytes_per_step": gradient,
        "rows": rows,
    }


def duration(hours: float) -> str:
    return f"{hours:.1f}h" if hours >= 1 else f"{hours * 60:.1f}m"


def render(plan: dict[str, Any], profile: Profile) -> str:
    p = profile.plan
    lines = [
        f"plan for {profile.run.name}: {plan['samples']:,} samples of "
        f"{plan['tokens_per_sample'].value:,.0f} tokens [{plan['tokens_per_sample'].source}], "
        f"{plan['completion_tokens_per_sample'].value:,.0f} generated "
        f"[{plan['completion_tokens_per_sample'].source}]",
        f"  total tokens            {plan['total_tokens']:,.0f}",
        f"  bytes per token         {plan['bytes_per_token']:,} "
        f"({len(captured_layer_ids(profile))} layers x "
        f"{profile.verifier.hidden_size} x {element_bytes(profile)} bytes)",
        f"  hidden states           {size(plan['hidden_state_bytes'])}",
        f"  free space              {size(plan['free_bytes'])} on {plan['volume']} "
        f"(reserve {size(plan['reserve_bytes'])}): {'fits' if plan['fits'] else 'DOES NOT FIT'}",
        f"  transfer at {p.link_gbps:g} Gbps x {p.link_efficiency:g} efficiency: "
        f"{duration(plan['transfer_hours'])}",
        "",
        f"  {'machine':<28}{'inference':>10}{'extract':>10}{'train':>10}{'total':>10}{'cost':>10}",
    ]
    for m in plan["machines"]:
        h = m["hours"]
        cost = f"${m['cost_usd']:,.0f}" if m["cost_usd"] is not None else "-"
        lines.append(
            f"  {m['name']:<28}{duration(h['inference']):>10}{duration(h['extraction']):>10}"
            f"{duration(h['training']):>10}{duration(m['total_hours']):>10}{cost:>10}"
        )
    if len(plan["machines"]) > 1 and plan["hidden_state_bytes"]:
        rental = plan["machines"][1]
        lines.append(
            f"  on {rental['name']}: transfer the hidden states "
            f"{duration(plan['transfer_hours'])} vs extract in place "
            f"{duration(rental['hours']['extraction'])}"
        )
    if plan["remedies"]:
        lines += ["", "  the hidden states do not fit; remedies:"]
        for r in plan["remedies"]:
            if r["hidden_state_bytes"] is None:
                lines.append(f"  - {r['remedy']}: {r['switch']}")
                continue
            lines.append(
                f"  - {r['remedy']}: {size(r['hidden_state_bytes'])}"
                f" ({'fits' if r['fits'] else 'still too large'}); {r['switch']}"
            )
    return "\n".join(lines)


def render_cluster(plan: dict[str, Any], profile: Profile) -> str:
    cluster = plan["cluster"]
    p = profile.plan
    lines = [
        f"on N x {cluster['machine']}, {cluster['fabric_gbps']:g} Gbps between nodes, "
        f"{p.link_gbps:g} Gbps to you; generate and extract by shard on every node, "
        f"training on one node unless the hidden states are node-local:",
        f"  {'N':>3}  {'hidden states on':<42}{'generate':>9}{'extract':>9}{'train':>9}"
        f"{'wall':>9}{'node-h':>8}{'cost':>10}{'fabric':>12}{'per disk':>12}",
    ]
    for r in cluster["rows"]:
        h = r["hours"]
        cost = f"${r['cost_usd']:,.0f}" if r["cost_usd"] is not None else "-"
        mark = "*" if r.get("chosen") else " "
        lines.append(
            f" {mark}{r['nodes']:>3}  {PLACEMENTS[r['placement']]:<42}{duration(h['generate']):>9}"
            f"{duration(h['extract']):>9}{duration(h['train']):>9}"
            f"{duration(r['wall_hours']):>9}{r['node_hours']:>8,.0f}{cost:>10}"
            f"{size(r['fabric_bytes']):>12}{size(r['hidden_state_bytes_per_disk']):>12}"
        )
        if not r["fits"]:
            lines.append("        does not fit: the hidden states exceed that storage")
        if r["refused"]:
            lines.append(f"        refused: {r['refused']}")
        if not r["supported"]:
            lines.append(
                "        for comparison: not run by the pipeline yet (speculators splits the rows "
                "by rank, not by the node that holds them)"
            )
    lines.append(
        "  node-hours count the nodes each phase uses (take the others down: idle nodes cost "
        "the same)\n"
        f"  * the plan for each N; hidden states cross the link to you in none of these "
        f"(home, {duration(plan['transfer_hours'])} at {p.link_gbps:g} Gbps: refused)"
        if plan["hidden_state_bytes"]
        else "  node-hours count the nodes each phase uses\n  * the plan for each N"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="plan")
    parser.add_argument("--config", required=True)
    parser.add_argument("--check", action="store_true", help="exit 2 if the run will not fit")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.config, args.overrides)
        plan = build_plan(profile)
        if args.check and not profile.server.base_url and profile.server.runtime == "process":
            check_build_matches_machine()  # the stages' servers are this venv's vLLM
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(render(plan, profile))
    if plan["cluster"]:
        print()
        print(render_cluster(plan, profile))
        unplanned = sorted({r["nodes"] for r in plan["cluster"]["rows"]} - {
            r["nodes"] for r in plan["cluster"]["rows"] if r.get("chosen")})  # fmt: skip
        if args.check and unplanned:
            print(
                f"error: refusing to start: on {', '.join(map(str, unplanned))} nodes no "
                "placement of the hidden states is left: each does not fit (node_disk_tb, "
                "shared_filesystem_tb), is refused (see above), or is not run by the pipeline; "
                "change plan.cluster or drop those node counts",
                file=sys.stderr,
            )
            sys.exit(2)
    if args.check and not plan["fits"]:
        print(
            "error: refusing to start: the hidden states would not fit on "
            f"{plan['volume']}; apply a remedy above and rerun",
            file=sys.stderr,
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
