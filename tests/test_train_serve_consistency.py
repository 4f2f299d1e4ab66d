"""The train/serve consistency guard on figures measured on the tiny run (2026-12-04):
speculators' validation accuracy per draft position against vLLM's served acceptance, served
as trained, and served with a plain chat template instead of the verifier's."""

from __future__ import annotations

import pytest

from eval.guards import EvalError, check_consistency, train_serve_consistency

pytestmark = pytest.mark.unit
VALIDATION = {
    "full_acc_0_epoch": 0.6667,
    "cond_acc_0_epoch": 0.6667,
    "full_acc_1_epoch": 0.4671,
    "cond_acc_1_epoch": 0.7006,
    "full_acc_2_epoch": 0.3426,
    "cond_acc_2_epoch": 0.7334,
}
SERVED_AS_TRAINED = [0.729, 0.614, 0.511]
SERVED_WITH_ANOTHER_TEMPLATE = [0.441, 0.222, 0.114]


def test_validation_counts_a_position_only_when_every_earlier_one_was_right():
    """full_acc_i is the running product of cond_acc: the quantity vLLM's acceptance counts."""
    product = 1.0
    for i in range(3):
        product *= VALIDATION[f"cond_acc_{i}_epoch"]
        assert VALIDATION[f"full_acc_{i}_epoch"] == pytest.approx(product, abs=1e-3)


def test_served_as_trained_passes():
    rows = train_serve_consistency(VALIDATION, SERVED_AS_TRAINED)
    assert [round(r["ratio"], 2) for r in rows] == [1.09, 1.31, 1.49]
    check_consistency(rows, 0.5, "eagle3 k=3")


def test_served_with_another_chat_template_is_an_error_naming_the_causes():
    rows = train_serve_consistency(VALIDATION, SERVED_WITH_ANOTHER_TEMPLATE)
    with pytest.raises(EvalError) as err:
        check_consistency(rows, 0.5, "eagle3 k=3")
    message = str(err.value)
    assert message.startswith("eagle3 k=3: served acceptance is far below")
    assert "position 2: 0.222 served, 0.467 in validation (0.48x)" in message
    assert "position 3: 0.114 served, 0.343 in validation (0.33x)" in message
    assert "position 1" not in message  # 0.66x: within the bound
    for cause in ("chat template", "max_model_len", "dtype", "capture-layer ids"):
        assert cause in message


def test_positions_beyond_what_was_trained_or_without_metrics_are_not_judged():
    assert len(train_serve_consistency(VALIDATION, [0.7, 0.6, 0.5, 0.4, 0.3])) == 3
    assert train_serve_consistency(None, SERVED_AS_TRAINED) == []
    check_consistency([], 0.5, "eagle3 k=3")


def test_positions_a_weak_drafter_almost_never_gets_right_are_not_judged():
    """Measured on a data-curve point trained on 4,914 tokens: position 3 at 0.012 served and
    0.034 in validation (0.36x) is noise, not a miswired server."""
    weak = {"full_acc_0_epoch": 0.21, "full_acc_1_epoch": 0.07, "full_acc_2_epoch": 0.034}
    check_consistency(train_serve_consistency(weak, [0.19, 0.05, 0.012]), 0.5, "eagle3 k=3")
    with pytest.raises(EvalError, match=r"position 1: 0\.080 served"):
        check_consistency(train_serve_consistency(weak, [0.08, 0.05, 0.012]), 0.5, "eagle3 k=3")


def test_the_served_template_is_a_chat_template_argument_or_the_verifiers_own(tmp_path):
    """vLLM takes ``--chat-template`` as a file or as the template itself, in either spelling."""
    import hashlib

    from pipeline.serving.vllm_api import served_chat_template_sha256

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    sha = hashlib.sha256(template.encode()).hexdigest()
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert served_chat_template_sha256(["--max-num-seqs", "4"], "own") == "own"
    assert served_chat_template_sha256(["--chat-template", str(path)], "own") == sha
    assert served_chat_template_sha256([f"--chat-template={path}"], "own") == sha
    assert served_chat_template_sha256(["--chat-template", template], "own") == sha
