"""Write the run's trained drafter in the original EAGLE layout, as published drafters come.

Run as: make export-drafter [OUT=folder]
   or:  python -m pipeline.tools.export_drafter --config configs/tiny.yaml [--out folder]

Reads the `train` stage's drafter (speculators' format) and writes ``config.json``
(``LlamaForCausalLMEagle3``, the capture-layer ids and norms in the config) and
``model.safetensors`` (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``/``t2d``, no
embedding) to ``--out`` (default ``<run>/export/eagle-layout``): the layout SpecForge and the
EAGLE authors publish, which vLLM serves as it is, and which ``train.from_pretrained`` and
``eval.reference_drafters`` convert back (:mod:`pipeline.training.pretrained_drafter`). The
layer ids are vLLM's; SGLang counts a layer one lower (subtract 1 for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.cli import report, stage_parser
from pipeline.core.config import load_profile
from pipeline.core.manifest import stage_manifest
from pipeline.training.pretrained_drafter import write_eagle_layout


def export(config: str, overrides: list[str], out: Path | None) -> dict[str, Any]:
    profile = load_profile(config, overrides)
    drafter = Path(stage_manifest(profile, "train").outputs.drafter)
    out = out or profile.run.run_dir / "export" / "eagle-layout"
    write_eagle_layout(drafter, out)
    print(f"export-drafter: {drafter.name} -> {out} (original EAGLE layout)")
    files = [out / "config.json", out / "model.safetensors"]
    return {
        "stage": "export-drafter",
        "counts": {"files": len(files)},
        "bytes": sum(f.stat().st_size for f in files),
    }


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser("export-drafter")
    parser.add_argument("--out", type=Path, default=None, help="default <run>/export/eagle-layout")
    args = parser.parse_intermixed_args(argv)
    report(lambda: export(args.config, args.overrides, args.out))


if __name__ == "__main__":
    main()
