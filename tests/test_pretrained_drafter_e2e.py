"""Published drafters: measured beside ours, and finetuned from, on the tiny run.

The "published" drafter is the tiny run's own, written out in the original EAGLE layout by
`make export-drafter` (``LlamaForCausalLMEagle3``, ``midlayer.*``, no embedding), and pushed to
a local Hub for the reference-only eval. Real parts throughout: speculators' converter and
trainer, vLLM serving every arm, huggingface_hub downloading over HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.config import PretrainedDrafter, load_profile
from pipeline.core.manifest import read_manifest, stage_dir
from pipeline.training.pretrained_drafter import (
    PretrainedDrafterError,
    check_fits,
    prepare_drafter,
    read_drafter,
    start_from,
)
from pipeline.training.text_view import text_view, verifier_config
from tests.helpers import TEST_OVERRIDES, seed_run_dir
from tests.local_hub import LocalHub

pytestmark = pytest.mark.e2e

REPO = Path(__file__).parent.parent
HUB_ID = "tester/tiny-eagle3-published"
TOKEN = "hf_local_pretrained_drafter_test"
# One k, batch size 1, no lm-eval: each arm is a server start.
ARMS = ["eval.num_speculative_tokens=[3]", "eval.concurrency=[1]", "eval.lm_eval_tasks=[]",
        "eval.sampled=null"]  # fmt: skip
# A handful of steps at a small rate: where a finetune starts, not where it ends.
HANDFUL = ["train.epochs=1", "train.max_steps=10", "train.learning_rate=0.0001"]


def run_module(module: str, out: Path, *overrides: str, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", module, "--config", "configs/tiny.yaml",
         f"run.output_dir={out}", *TEST_OVERRIDES, *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
        env={**(env or os.environ), "PROGRESS": "0"},
    )  # fmt: skip
    return proc


@pytest.fixture(scope="module")
def published(tiny_run, tmp_path_factory) -> Path:
    """The tiny run's drafter in the original EAGLE layout, as `make export-drafter` writes it."""
    out = tmp_path_factory.mktemp("published") / "tiny-eagle3"
    proc = run_module("pipeline.tools.export_drafter", tiny_run.run.output_dir, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def at(out: Path):
    """The tiny profile as these tests run it, its run folder under ``out``."""
    return load_profile(REPO / "configs/tiny.yaml", [f"run.output_dir={out}", *TEST_OVERRIDES])


def trained(profile) -> Path:
    return Path(read_manifest(profile, "train")["outputs"]["drafter"])


def test_export_writes_the_original_layout(tiny_run, published):
    config = json.loads((published / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "speculators_config" not in config
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    keys = set(load_file(published / "model.safetensors"))
    assert {"midlayer.self_attn.q_proj.weight", "fc.weight", "d2t", "t2d"} <= keys
    assert "embed_tokens.weight" not in keys and not any(k.startswith("layers.") for k in keys)
    assert read_drafter(published).kind == "eagle"


def test_conversion_gives_back_the_trained_drafter_exactly(tiny_run, published, tmp_path):
    """speculators' converter, with what it drops put back: every tensor and every field the
    trainer wrote, the embedding the verifier's (the trainer froze it)."""
    model = stage_dir(tiny_run, "verifier") / "model"
    view = text_view(str(model), None, tmp_path / "view")
    drafter = read_drafter(published)
    ids = check_fits(drafter, verifier_config(str(model), None), "published", [1, 3, 4])
    prepared = prepare_drafter(drafter, tmp_path / "prepared", view, ids)
    original, back = (
        load_file(trained(tiny_run) / "model.safetensors"),
        load_file(prepared / "model.safetensors"),
    )
    assert set(back) == set(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    want = json.loads((trained(tiny_run) / "config.json").read_text())
    got = json.loads((prepared / "config.json").read_text())
    for field in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
                  "norm_before_residual", "norm_output", "fc_norm"):  # fmt: skip
        assert got[field] == want[field], field
    layer_fields = ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                    "rms_norm_eps", "rope_parameters", "sliding_window", "layer_types")  # fmt: skip
    for field in layer_fields:
        assert got["transformer_layer_config"][field] == want["transformer_layer_config"][field]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 256}, "its fc reads 384 features, but 3 layers of this verifier give 768"),
        ({"vocab_size": 4096}, "made for a 2048-token vocabulary, the verifier has 4096"),
        ({"num_hidden_layers": 4}, "reads layers [1, 3, 4], not distinct layers of a 4-layer"),
    ],
)
def test_a_drafter_for_another_verifier_is_refused_by_name(tiny_run, published, change, message):
    config = verifier_config(str(stage_dir(tiny_run, "verifier") / "model"), None)
    config["text_config"] = {**config["text_config"], **change}
    with pytest.raises(PretrainedDrafterError, match="published") as info:
        check_fits(read_drafter(published), config, "published")
    assert message in str(info.value)


def test_layer_ids_follow_the_engine_that_trained_the_drafter(tiny_run, published, tmp_path):
    """SGLang records a layer's output, one below vLLM's id: read as SGLang's, [1, 3, 4] are
    vLLM's [2, 4, 5], which the layers extraction captured are not; finetuning is refused."""
    assert read_drafter(published, layer_ids_from="sglang").layer_ids == [2, 4, 5]
    model = str(stage_dir(tiny_run, "verifier") / "model")
    source = PretrainedDrafter(path=str(published), layer_ids_from="sglang")
    with pytest.raises(PretrainedDrafterError) as info:
        start_from(source, verifier_config(model, None), model, [1, 3, 4], tmp_path)
    assert "reads layers [2, 4, 5], but extraction captured [1, 3, 4]" in str(info.value)
    assert "verifier.capture_layer_ids: [2, 4, 5]" in str(info.value)


PUSH = """
import sys
from huggingface_hub import HfApi
api = HfApi(token=sys.argv[1])
api.create_repo(sys.argv[2])
api.upload_folder(repo_id=sys.argv[2], folder_path=sys.argv[3])
"""


def push_to_local_hub(endpoint: str, folder: Path, home: Path) -> dict[str, str]:
    """``folder`` as HUB_ID on the local Hub (this process runs offline); the environment that
    reads it from there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    subprocess.run(
        [sys.executable, "-c", PUSH, TOKEN, HUB_ID, str(folder)],
        env={**env, "HF_HUB_DISABLE_XET": "1"},  # the local Hub takes git-LFS
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return env


def batch_size_one(results: dict, series: str) -> dict:
    run = next(r for r in results["runs"] if r["series"] == series)
    return run["levels"][0]


def test_reference_first_then_a_finetune_that_starts_where_it_was(tiny_run, published, tmp_path):
    """The hero's plan on the tiny run: measure the published drafter alone before any training
    (from the Hub), finetune from it for a handful of steps, and measure the finetune beside a
    fresh drafter trained for the same steps, in one eval."""
    runs, fresh_runs = tmp_path / "runs", tmp_path / "fresh"
    for out in (runs, fresh_runs):
        seed_run_dir(tiny_run, at(out), ("verifier", "generate", "licenses", "extract"))
    reference = f"{{name: published, path: {HUB_ID}}}"

    # 1. The published drafter alone, before training: no train stage exists.
    with LocalHub({TOKEN: "tester"}).running() as endpoint:
        env = push_to_local_hub(endpoint, published, tmp_path / "hf-home")
        # Two passes of every prompt on each server: figures pool them, each keeps its own.
        only = ["eval.methods=[]", f"eval.reference_drafters=[{reference}]", "eval.repeats=2"]
        alone = run_module("eval", runs, *only, *ARMS, env=env)
    assert alone.returncode == 0, alone.stderr[-3000:]
    results = json.loads((runs / "tiny" / "eval" / "results.json").read_text())
    assert results["summary"]["series"] == "published"
    assert len(results["summary"]["speedup_per_repeat"]) == 2
    repeated = batch_size_one(results, "published")
    assert [r["prompts"] for r in repeated["per_repeat"]] == [24, 24]
    assert repeated["repeat_mismatched_prompt_ids"] == []  # greedy: the same replies again
    assert sum(r["output_tokens"] for r in repeated["per_repeat"]) == repeated["output_tokens"]
    samples = json.loads((runs / "tiny" / "eval" / "samples.json").read_text())["published-k3-c1"]
    outputs = json.loads((runs / "tiny" / "eval" / "outputs.json").read_text())["published-k3-c1"]
    for pid, sample in samples.items():  # greedy: both passes gave the same reply
        assert sample["completion_tokens"] == 2 * outputs[pid]["completion_tokens"], pid
    assert sum(s["drafts"] for s in samples.values()) == repeated["acceptance"]["drafts"]
    record = results["reference_drafters"]["published"]
    assert record["source"] == HUB_ID and record["layout"] == "eagle" and record["converted"]
    assert str(tmp_path) not in json.dumps(results)  # not the Hub cache's path either
    published_alone = batch_size_one(results, "published")
    assert not published_alone["mismatched_prompt_ids"]  # lossless, as any arm
    # The same weights as the tiny run's drafter, on the same prompts and k: the same acceptance.
    ours_before = next(
        r for r in read_results(tiny_run)["runs"] if r["method"] == "eagle3" and r["k"] == 3
    )["levels"][0]["acceptance"]
    assert published_alone["acceptance"]["mean_acceptance_length"] == pytest.approx(
        ours_before["mean_acceptance_length"], abs=0.05
    )

    # 2. A handful of steps from it, and from scratch.
    finetune = run_module("pipeline.train", runs, f"train.from_pretrained={published}", *HANDFUL)
    assert finetune.returncode == 0, finetune.stderr[-3000:]
    fresh = run_module("pipeline.train", fresh_runs, *HANDFUL)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    outputs = read_manifest(at(runs), "train")["outputs"]
    assert outputs["from_pretrained"]["layout"] == "eagle" and outputs["global_steps"] == 10
    assert outputs["draft_vocab_size"] == 1024
    finetuned = Path(outputs["drafter"])
    # Its own draft vocabulary, not one recomputed from the data.
    assert torch.equal(load_file(finetuned / "model.safetensors")["d2t"],
                       load_file(published / "model.safetensors")["d2t"])  # fmt: skip
    pretrained_val = read_manifest(tiny_run, "train")["outputs"]["val_metrics"]
    for i in range(3):
        key = f"full_acc_{i}_epoch"
        assert outputs["val_metrics"][key] == pytest.approx(pretrained_val[key], abs=0.03), key

    # 3. The finetune beside the fresh drafter, in one eval; the published drafter's figures are
    # those it was measured at alone (same prompts, k and flags), not a third server start.
    fresh_drafter = trained(at(fresh_runs))
    references = f"[{{name: fresh, path: {fresh_drafter}}}]"
    both = run_module(
        "eval", runs, "eval.methods=[eagle3]", f"eval.reference_drafters={references}", *ARMS
    )
    assert both.returncode == 0, both.stderr[-3000:]
    results = json.loads((runs / "tiny" / "eval" / "results.json").read_text())
    length = {s: batch_size_one(results, s)["acceptance"]["mean_acceptance_length"]
              for s in ("eagle3", "fresh")}  # fmt: skip
    length["published"] = published_alone["acceptance"]["mean_acceptance_length"]
    assert results["summary"]["series"] == "eagle3"
    assert length["eagle3"] >= 1 + 0.9 * (length["published"] - 1), length
    assert length["fresh"] < 1.2, length  # reported as measured, not refused
    assert length["eagle3"] - length["fresh"] > 0.8 * (length["published"] - 1), length
    versus = results["summary"]["references"]
    assert versus["fresh"]["headline_over_reference_acceptance_length"] == pytest.approx(
        length["eagle3"] / length["fresh"]
    )
    table = (runs / "tiny" / "eval" / "results.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| fresh |"))
    assert "converted" not in row and "| 3 |" in row  # served as speculators wrote it
    assert str(tmp_path) not in json.dumps(results)  # published: no path of this machine

    # 4. The card sets the finetune beside the fresh drafter, and says where it started.
    card = run_module("model_card.card", runs)
    assert card.returncode == 0, card.stderr[-3000:]
    readme = (runs / "tiny" / "card" / "README.md").read_text()
    assert "| reference drafter `fresh`, k=3, same prompts: mean acceptance length |" in readme
    assert "| finetuned from | `tiny-eagle3` (eagle layout, converted)" in readme


def read_results(profile) -> dict:
    return json.loads((stage_dir(profile, "eval") / "results.json").read_text())
