"""Stage `card`: render the drafter's model card from the run's manifests and eval results.

Run as: python -m model_card.render --config configs/tiny.yaml

Reads the manifests of `verifier`, `generate`, `extract`, `train` and `eval` (and eval's
results and plots); writes ``<run>/card/README.md`` and copies the plots beside it. Metadata go
through huggingface_hub's ModelCardData; the body is ``model_card/drafter_card.md.j2``. Every
number comes from a file the pipeline wrote. The rendered card must reload with ModelCard.load.
"""

from __future__ import annotations

import collections
import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import jinja2
import yaml
from huggingface_hub import ModelCard, ModelCardData

from pipeline.config import Profile
from pipeline.manifest import (
    REPO_ROOT,
    atomic_write_bytes,
    now,
    read_manifest,
    stage_dir,
    write_manifest,
)

TEMPLATE = Path(__file__).with_name("drafter_card.md.j2")
LICENSES = REPO_ROOT / "release" / "licenses.yaml"
BUILT_VERIFIER = "built-tiny-verifier"


def verifier_license(profile: Profile) -> dict[str, Any]:
    table = yaml.safe_load(LICENSES.read_text())["verifiers"]
    key = BUILT_VERIFIER if profile.verifier.build is not None else profile.verifier.model
    if key not in table:
        from pipeline.errors import PipelineError

        raise PipelineError(
            f"verifier {key!r} has no entry in {LICENSES}: add its license there "
            "(the drafter inherits it)"
        )
    return table[key]


def serve_command(verifier: str, drafter_repo: str, k: int, tp: int, remote: bool) -> str:
    spec = json.dumps({"method": "eagle3", "model": drafter_repo, "num_speculative_tokens": k})
    parts = ["vllm", "serve", verifier, "--tensor-parallel-size", str(tp)]
    if remote:
        parts.append("--trust-remote-code")
    parts += ["--speculative-config", spec]
    return " ".join(shlex.quote(p) for p in parts)


def run(profile: Profile) -> dict[str, Any]:
    started = now()
    folder = stage_dir(profile, "card")
    folder.mkdir(parents=True, exist_ok=True)
    m = {s: read_manifest(profile, s) for s in ("verifier", "generate", "extract", "train", "eval")}
    results = json.loads((stage_dir(profile, "eval") / "results.json").read_text())
    summary = results["summary"]
    verifier = m["verifier"]["outputs"]
    model_name = profile.verifier.model or "the tiny verifier built by this project"
    lic = verifier_license(profile)
    responses = stage_dir(profile, "generate") / m["generate"]["outputs"]["responses"]
    sources = collections.Counter(
        json.loads(line)["source"] for line in responses.read_text().splitlines() if line
    )
    plots = []
    for plot in results.get("plots", []):
        shutil.copy2(stage_dir(profile, "eval") / plot["file"], folder / plot["file"])
        plots.append(plot)
    card_data = ModelCardData(
        license=lic["license"],
        license_name=lic.get("license_name"),
        license_link=lic.get("license_link"),
        base_model=profile.verifier.model,
        datasets=[profile.data.dataset] if profile.verifier.model else None,
        library_name="speculators",
        tags=["eagle3", "speculative-decoding", "speculators", "vllm"],
    )
    drafter_repo = f"<your-namespace>/{profile.run.name}"
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    body = env.get_template(TEMPLATE.name).render(
        card_data=card_data.to_yaml(),
        verifier={**verifier, "model_name": model_name},
        run_name=profile.run.name,
        git_sha=m["train"]["git"]["sha"],
        serve_command=serve_command(
            profile.verifier.model or verifier["model"],
            drafter_repo,
            summary["num_speculative_tokens"],
            profile.server.tensor_parallel_size,
            profile.verifier.trust_remote_code,
        ),
        packages=m["eval"]["packages"],
        eval=summary,
        eval_dataset=profile.data.eval_dataset,
        eval_concurrency=summary["concurrency"],
        eval_table=(stage_dir(profile, "eval") / "results.md").read_text(),
        plots=plots,
        data={"dataset": profile.data.dataset, "revision": profile.data.revision},
        generate=m["generate"]["counts"],
        sources=sorted(sources.items()),
        extract=m["extract"]["outputs"],
        train=m["train"]["outputs"],
        train_cfg=profile.train,
        wall={s: round(m[s]["wall_time_s"]) for s in ("generate", "extract", "train")},
    )
    atomic_write_bytes(folder / "README.md", body.encode())
    ModelCard.load(folder / "README.md")  # fails loudly if the metadata block is malformed
    return write_manifest(
        profile,
        "card",
        started_at=started,
        counts={"input": 1, "succeeded": 1, "skipped": 0, "failed": 0},
        outputs={
            "card": "README.md",
            "license": lic["license"],
            "plots": [p["file"] for p in plots],
        },
        inputs=("verifier", "generate", "extract", "train", "eval"),
    )


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import run_stage

    run_stage("card", run, argv)


if __name__ == "__main__":
    main()
