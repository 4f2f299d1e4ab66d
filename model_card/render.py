"""Stage `card`: render the drafter's model card from the run's manifests and eval results.

Run as: python -m model_card.render --config configs/tiny.yaml   (make card)

Reads the manifests of `verifier`, `generate`, `licenses`, `extract`, `train` and `eval`, eval's
results and plots, and the license check's report; writes ``<run>/card/README.md`` with the
plots beside it, and ``manifest.json``.

Invariants:
- every number on the card comes from a file the pipeline wrote; the template types none;
- metadata go through huggingface_hub's ModelCardData: the license derived by the license check
  (the verifier's, never typed here), base_model, the Hub datasets the rows came from, tags,
  and the headline eval results as model-index entries;
- the card refuses to render from a failed or stale license check, or from eval results of
  another drafter checkpoint than train's (sha256 of its files);
- it names no path of the machine that built it: the verifier by its Hub id, or, when the
  verifier is local (the tiny profile builds its own), says so and serves it from the run folder;
- the data section shows how the prompts were sampled when generate recorded it (manifests
  written before that have no ``sampling`` and get no sampling lines);
- the rendered card must reload with ``ModelCard.load`` to the same metadata;
- the manifest records the drafter checkpoint (sha256) and repo id the card describes, so that
  publish can refuse a card that belongs to another checkpoint or repository.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from pipeline.build_verifier import verifier_path
from pipeline.config import HUB_REPO_ID, Profile
from pipeline.errors import PipelineError
from pipeline.manifest import (
    REPO_ROOT,
    all_succeeded,
    atomic_write_bytes,
    drafter_digest,
    now,
    read_manifest,
    relative_path,
    stage_dir,
    write_manifest,
)
from release.check_licenses import read_passed_check

TEMPLATE = Path(__file__).with_name("drafter_card.md.j2")
TAGS = ["eagle3", "speculative-decoding", "speculators", "vllm"]
INPUTS = ("verifier", "generate", "licenses", "extract", "train", "eval")


class CardError(PipelineError):
    """The card cannot be rendered from this run's outputs, or does not reload."""


def drafter_repo_id(profile: Profile) -> str:
    """The repository the card describes: release.repo_id, or a placeholder to replace."""
    return profile.release.repo_id or f"<namespace>/{profile.run.name}"


def serve_command(verifier: str, drafter_repo: str, k: int, tp: int, remote: bool) -> str:
    spec = json.dumps({"method": "eagle3", "model": drafter_repo, "num_speculative_tokens": k})
    parts = ["vllm", "serve", verifier, "--tensor-parallel-size", str(tp)]
    if remote:
        parts.append("--trust-remote-code")
    parts += ["--speculative-config", spec]
    return " ".join(shlex.quote(p) for p in parts)


def verifier_view(profile: Profile, recorded: dict[str, Any]) -> dict[str, Any]:
    """How the card names the verifier and what its `vllm serve` line serves: the Hub id, or,
    for a local verifier, a path a reader can recreate and a plain note that it is local."""
    model = profile.verifier.model
    view = {**recorded, "hub": is_hub_id(model), "built": profile.verifier.build is not None}
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


def sampling_view(generate_outputs: dict[str, Any]) -> dict[str, Any] | None:
    """What generate recorded about sampling the prompts, totalled; None before it did."""
    sampling = generate_outputs.get("sampling")
    if not sampling:
        return None
    by_source = sorted((sampling.get("by_source") or {}).items())
    return {
        **sampling,
        "sampled": sum(n["sampled"] for _, n in by_source),
        "available": sum(n["available"] for _, n in by_source),
        "by_source": [{"source": source, **n} for source, n in by_source],
    }


def is_hub_id(name: str | None) -> bool:
    """A Hub repository id ("owner/name"), as opposed to a local file or folder."""
    if not name or not re.match(HUB_REPO_ID, name):
        return False
    return not (Path(name).exists() or (REPO_ROOT / name).exists())


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


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "card")
    folder.mkdir(parents=True, exist_ok=True)
    m = {stage: read_manifest(profile, stage) for stage in INPUTS}
    licenses = read_passed_check(profile)
    results = json.loads((stage_dir(profile, "eval") / "results.json").read_text())
    if m["eval"]["outputs"].get("drafter_sha256") is None:
        raise CardError(
            "eval measured a running deployment (server.base_url), not this run's drafter; "
            "run `make eval` without BASE_URL before `make card`"
        )
    evaluated = m["eval"]["outputs"]["drafter_sha256"]
    if evaluated != drafter_digest(Path(m["train"]["outputs"]["drafter"])):
        raise CardError(
            "the eval results belong to another drafter checkpoint than train's: rerun "
            "`make eval`, then `make card`"
        )
    summary = results["summary"]
    verifier = verifier_view(profile, m["verifier"]["outputs"])
    model_name = f"{profile.run.name}-eagle3"
    plots = []
    for plot in results.get("plots", []):
        shutil.copy2(stage_dir(profile, "eval") / plot["file"], folder / plot["file"])
        plots.append(plot)
    card_data = card_metadata(profile, licenses, summary, model_name)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    train_manifest = m["train"]
    body = env.get_template(TEMPLATE.name).render(
        card_data=card_data.to_yaml(),
        verifier=verifier,
        run_name=profile.run.name,
        git=train_manifest["git"],
        serve_command=serve_command(
            verifier["serve"],
            drafter_repo_id(profile),
            summary["num_speculative_tokens"],
            profile.server.tensor_parallel_size,
            profile.verifier.trust_remote_code,
        ),
        packages=m["eval"]["packages"],
        eval=summary,
        eval_dataset=relative_path(profile, str(profile.data.eval_dataset)),
        eval_table="".join(  # its headline line repeats the table above it
            line
            for line in (stage_dir(profile, "eval") / "results.md").read_text().splitlines(True)
            if not line.startswith("Headline:")
        ).strip(),
        plots=plots,
        data={
            **m["generate"]["data_revision"],
            "dataset": relative_path(profile, str(m["generate"]["data_revision"]["dataset"])),
        },
        generate=m["generate"]["counts"],
        sampling=sampling_view(m["generate"]["outputs"]),
        licenses=licenses,
        extract=m["extract"]["outputs"],
        train=train_manifest["outputs"],
        train_cfg=profile.train,
        hardware=train_manifest["hardware"],
        wall={s: round(m[s]["wall_time_s"]) for s in ("generate", "extract", "train", "eval")},
    )
    atomic_write_bytes(folder / "README.md", body.encode())
    reloaded = ModelCard.load(folder / "README.md")
    if reloaded.data.to_dict() != card_data.to_dict():
        raise CardError(f"{folder / 'README.md'} does not reload to the metadata it was given")
    return write_manifest(
        profile,
        "card",
        started_at=started,
        counts=all_succeeded(1),
        outputs={
            "card": "README.md",
            "repo_id": drafter_repo_id(profile),
            "license": licenses["drafter_license"],
            "drafter_sha256": evaluated,
            "plots": [p["file"] for p in plots],
        },
        inputs=INPUTS,
        data_revision=m["generate"]["data_revision"],
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import run_stage

    run_stage("card", run, argv)


if __name__ == "__main__":
    main()
