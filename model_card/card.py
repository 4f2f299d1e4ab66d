"""Stage `card`: render the drafter's model card from the run's manifests and eval results.

Run as: python -m model_card.card --config configs/tiny.yaml   (make card)

Reads the manifests of `verifier`, `generate`, `licenses`, `extract`, `train` and `eval`, eval's
results and plots, the license check's report, and the points and plots of `data_curve` and
`tune` when the profile asks for them; writes ``<run>/card/README.md`` with the
plots beside it, and ``manifest.json``.

Invariants:
- every number on the card comes from a file the pipeline wrote; the template types none;
- metadata go through huggingface_hub's ModelCardData: the license derived by the license check
  (the verifier's, never typed here), base_model, the Hub datasets the rows came from, tags,
  and the headline eval results as model-index entries;
- the card refuses to render from a failed license check, from any stale input (a license
  check of other data, an eval of another training run: ``pipeline.core.contracts``), and from
  eval results of other drafter files than those in train's folder (sha256 of its files);
- it names no path of the machine that built it: the verifier by its Hub id, or, when the
  verifier is local (the tiny profile builds its own), says so and serves it from the run folder;
- the data section shows how the prompts were sampled, as generate recorded it;
- the rendered card must reload with ``ModelCard.load`` to the same metadata;
- the manifest records the drafter checkpoint (sha256) and repo id the card describes; publish
  refuses a card made from another eval (stale) or for another repository.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from pipeline.core.atomic_files import atomic_write_bytes
from pipeline.core.config import Profile
from pipeline.core.contracts import (
    CONTRACTS,
    CardOutputs,
    DataCurveOutputs,
    Manifest,
    TuneOutputs,
)
from pipeline.core.drafter import drafter_digest
from pipeline.core.errors import PipelineError
from pipeline.core.manifest import (
    all_succeeded,
    now,
    passed_license_report,
    read_input,
    stage_dir,
    write_manifest,
)
from pipeline.core.model_names import drafter_repo_id, is_hub_id, verifier_path
from pipeline.core.portable import relative_path
from pipeline.serving.speculative import speculative_config

TEMPLATE = Path(__file__).with_name("drafter_card.md.j2")
TAGS = ["eagle3", "speculative-decoding", "speculators", "vllm"]


class CardError(PipelineError):
    """The card cannot be rendered from this run's outputs, or does not reload."""


def serve_command(profile: Profile, verifier: str, drafter_repo: str, k: int) -> str:
    """The `vllm serve` line a reader runs: the speculative config eval measured with."""
    spec = json.dumps(speculative_config(profile, "eagle3", k, drafter_repo))
    parts = ["vllm", "serve", verifier, "--tensor-parallel-size"]
    parts.append(str(profile.server.tensor_parallel_size))
    if profile.verifier.trust_remote_code:
        parts.append("--trust-remote-code")
    if profile.server.attention_backend:  # the verifier's, as eval served it
        parts += ["--attention-backend", profile.server.attention_backend]
    parts += ["--speculative-config", spec]
    return " ".join(shlex.quote(p) for p in parts)


def verifier_view(profile: Profile, recorded: dict[str, Any]) -> dict[str, Any]:
    """How the card names the verifier and what its `vllm serve` line serves: the Hub id, or,
    for a local verifier, a path a reader can recreate and a plain note that it is local."""
    model = profile.verifier.model
    view = {**recorded, "hub": is_hub_id(model), "built": profile.verifier.build is not None}
    if package := profile.verifier.package:
        return view | {
            "name": f"{package.model_name} (dequantised from {package.gguf.rsplit('/', 1)[-1]} "
            f"in {package.distribution} {package.version})",
            "title": package.model_name,
            "serve": relative_path(profile, verifier_path(profile)),  # verifier/model, in the run
            "model": relative_path(profile, verifier_path(profile)),
        }
    if view["hub"]:
        return view | {"name": model, "title": model, "serve": model, "model": model}
    if view["built"]:
        return view | {
            "name": f"{profile.run.name} verifier (built locally)",
            "title": f"the {profile.run.name} profile's built verifier",
            "serve": relative_path(profile, verifier_path(profile)),  # verifier/model, in the run
            "model": relative_path(profile, verifier_path(profile)),
        }
    folder = Path(str(model)).name
    return view | {
        "name": f"{folder} (a local folder)",
        "title": f"`{folder}` (a local verifier)",
        "serve": f"<path to {folder}>",
        "model": folder,  # its name only: no path of the machine that built it
    }


def sampling_view(sampling: dict[str, Any]) -> dict[str, Any] | None:
    """What generate recorded about sampling the prompts, totalled; None before it did."""
    if not sampling:
        return None
    by_source = sorted((sampling.get("by_source") or {}).items())
    return {
        **sampling,
        "sampled": sum(n["sampled"] for _, n in by_source),
        "available": sum(n["available"] for _, n in by_source),
        "by_source": [{"source": source, **n} for source, n in by_source],
    }


def eval_tables(results_md: str) -> str:
    """eval's ``results.md`` from its tables on: its headline lines repeat the card's own."""
    lines = results_md.splitlines(True)
    first = next(
        (i for i, line in enumerate(lines) if line.startswith(("| arm |", "Reference drafters"))),
        0,
    )
    return "".join(lines[first:]).strip()


def eval_results(summary: dict[str, Any], dataset: str) -> list[EvalResult]:
    k = summary["num_speculative_tokens"]
    where = f"k={k}, batch size {summary['concurrency']}, greedy, vLLM"
    metrics = [
        ("mean_acceptance_length", summary["mean_acceptance_length"], "Mean acceptance length"),
        ("acceptance_rate", summary["acceptance_rate"], "Acceptance rate"),
    ]
    if summary.get("speedup") is not None:
        metrics.append(("speedup", summary["speedup"], "Speedup in time per output token"))
    return [
        EvalResult(
            task_type="text-generation",
            task_name="speculative decoding",
            dataset_type="json" if not is_hub_id(dataset) else dataset,
            dataset_name=Path(dataset).stem if not is_hub_id(dataset) else dataset,
            metric_type=metric,
            metric_value=round(float(value), 4),
            metric_name=f"{label} ({where})",
        )
        for metric, value, label in metrics
    ]


def card_metadata(
    profile: Profile, licenses: dict[str, Any], summary: dict[str, Any], model_name: str
) -> ModelCardData:
    drafter_license = licenses["drafter_license"]
    hub_datasets = sorted(
        {s["dataset"] for s in licenses["sources"] if is_hub_id(s.get("dataset"))}
        | ({profile.data.dataset} if is_hub_id(profile.data.dataset) else set())
    )
    tags = [*TAGS, *(["non-commercial"] if drafter_license["non_commercial"] else [])]
    return ModelCardData(
        license=drafter_license["license"],
        license_name=drafter_license.get("license_name"),
        license_link=drafter_license.get("license_link"),
        base_model=profile.verifier.model if is_hub_id(profile.verifier.model) else None,
        datasets=hub_datasets or None,
        library_name="speculators",
        tags=tags,
        model_name=model_name,
        eval_results=eval_results(summary, profile.data.eval_dataset),
    )


def render_body(
    profile: Profile,
    m: dict[str, Manifest[Any]],
    licenses: dict[str, Any],
    summary: dict[str, Any],
    plots: list[dict[str, Any]],
    card_data: ModelCardData,
    curve: dict[str, Any] | None = None,
    tune: dict[str, Any] | None = None,
) -> str:
    """The card's text: ``drafter_card.md.j2`` over the input manifests (``m``), the license
    report, eval's summary, table and plots, and the metadata block."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    verifier = verifier_view(profile, m["verifier"].outputs.model_dump(exclude_unset=True))
    k = summary["num_speculative_tokens"]
    train, generate = m["train"], m["generate"]
    return env.get_template(TEMPLATE.name).render(
        card_data=card_data.to_yaml(),
        verifier=verifier,
        run_name=profile.run.name,
        git=train.git,
        serve_command=serve_command(profile, verifier["serve"], drafter_repo_id(profile), k),
        packages=m["eval"].packages,
        eval=summary,
        eval_dataset=relative_path(profile, str(profile.data.eval_dataset)),
        eval_table=eval_tables((stage_dir(profile, "eval") / "results.md").read_text()),
        plots=plots,
        data={
            **generate.data_revision,
            "dataset": relative_path(profile, str(generate.data_revision["dataset"])),
        },
        generate=generate.counts,
        sampling=sampling_view(generate.outputs.sampling),
        licenses=licenses,
        extract=m["extract"].outputs.model_dump(exclude_unset=True),
        train=train.outputs.model_dump(exclude_unset=True),
        train_cfg=profile.train,
        hardware=train.hardware,
        wall={s: round(m[s].wall_time_s) for s in ("generate", "extract", "train", "eval")},
        curve=curve,
        tune=tune,
    )


def data_curve_view(outputs: DataCurveOutputs) -> dict[str, Any]:
    """The curve's points, each beside ngram's line and the verifier alone (speedup 1.0)."""
    ngram = outputs.ngram or {}
    points = [
        {
            **p,
            "over_ngram": p["mean_acceptance_length"] / ngram["mean_acceptance_length"]
            if ngram.get("mean_acceptance_length")
            else None,
        }
        for p in outputs.points
    ]
    return {"plot": outputs.plot, "k": outputs.k, "points": points,
            "not_reached": outputs.not_reached, "ngram": outputs.ngram}  # fmt: skip


def tune_view(outputs: TuneOutputs) -> dict[str, Any]:
    """This run's recipe first, then each variant with the field it changed."""
    rows = [{**outputs.base, "label": "this recipe", "delta": {}}] + [
        {**v, "label": f"`{v['field']}` {v['value']}"} for v in outputs.variants
    ]
    return {"plot": outputs.plot, "k": outputs.k, "rows": rows, "recipe": outputs.recipe}


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "card")
    folder.mkdir(parents=True, exist_ok=True)
    # Each input typed and fresh: an eval of another checkpoint, a license check of other
    # data, is stale (contracts), and refused here with the target to rerun.
    contract = CONTRACTS["card"]
    m = {stage: read_input(profile, "card", stage) for stage in contract.inputs
         if stage not in contract.optional}  # fmt: skip
    for measurement in contract.optional:  # the profile asks for it: the card must show it
        if getattr(profile, measurement):
            m[measurement] = read_input(profile, "card", measurement)
    licenses = passed_license_report(profile, "card")
    results = json.loads((stage_dir(profile, "eval") / m["eval"].outputs.results).read_text())
    evaluated = m["eval"].outputs.drafter_sha256
    if evaluated is None:
        raise CardError(
            "eval measured a running deployment (server.base_url) or reference drafters alone, "
            "not this run's drafter; run `make eval` without BASE_URL, with eagle3 in "
            "eval.methods, before `make card`"
        )
    if evaluated != drafter_digest(Path(m["train"].outputs.drafter)):
        raise CardError(
            "the eval results belong to another drafter checkpoint than the one in train's "
            "folder (its files changed since): rerun `make eval`, then `make card`"
        )
    plots = results.get("plots", [])
    for plot in plots:
        shutil.copy2(stage_dir(profile, "eval") / plot["file"], folder / plot["file"])
    curve = data_curve_view(m["data_curve"].outputs) if "data_curve" in m else None
    tune = tune_view(m["tune"].outputs) if "tune" in m else None
    for stage, view in (("data_curve", curve), ("tune", tune)):
        if view:
            shutil.copy2(stage_dir(profile, stage) / view["plot"], folder / view["plot"])
    summary = results["summary"]
    card_data = card_metadata(profile, licenses, summary, f"{profile.run.name}-eagle3")
    body = render_body(profile, m, licenses, summary, plots, card_data, curve, tune)
    atomic_write_bytes(folder / "README.md", body.encode())
    reloaded = ModelCard.load(folder / "README.md")
    if reloaded.data.to_dict() != card_data.to_dict():
        raise CardError(f"{folder / 'README.md'} does not reload to the metadata it was given")
    return write_manifest(
        profile,
        "card",
        started_at=started,
        counts=all_succeeded(1),
        outputs=CardOutputs(
            card="README.md",
            repo_id=drafter_repo_id(profile),
            license=licenses["drafter_license"],
            drafter_sha256=evaluated,
            plots=[p["file"] for p in plots] + [v["plot"] for v in (curve, tune) if v],
        ),
        data_revision=m["generate"].data_revision,
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.core.cli import run_stage

    run_stage("card", run, argv)


if __name__ == "__main__":
    main()
