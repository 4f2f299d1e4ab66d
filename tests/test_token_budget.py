"""Token budgets of the training data (train.max_train_tokens) and the data curve's points.

A real prepared dataset (datasets' save_to_disk, as extraction writes it) with real safetensors
hidden-state files; speculators' own dataset class reads the budget's view back, so the view is
checked by the reader that trains on it.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from datasets import Dataset
from safetensors.torch import save_file

from pipeline.core.config import ConfigError, Profile, load_profile
from pipeline.data_curve import budget_profile, budgets
from pipeline.training.point_runs import prepare_point
from pipeline.training.token_budget import (
    SELECTION,
    TokenBudgetError,
    select,
    split_index,
    training_view,
)

pytestmark = pytest.mark.unit
LENGTHS = [30, 50, 20, 40, 60, 10, 25, 35, 45, 55]  # 10 rows; ratio 0.8: 8 train, 2 validation


def prepared_dataset(folder):
    rows = [
        {
            "input_ids": list(range(i, i + n)),
            "loss_mask": [0] * (n // 2) + [1] * (n - n // 2),
            "seq_len": n,
        }
        for i, n in enumerate(LENGTHS)
    ]
    Dataset.from_list(rows).with_format("torch").save_to_disk(str(folder))
    states = folder / "hidden_states"
    states.mkdir()
    for i, n in enumerate(LENGTHS):
        tensors = {"hidden_states": torch.full((n, 4), float(i))}
        save_file(tensors, str(states / f"hs_{i}.safetensors"))
    torch.save({1: 1}, folder / "token_freq.pt")
    return folder


def test_a_budget_keeps_leading_training_rows_and_every_validation_row():
    supervised = [n - n // 2 for n in LENGTHS]
    indices, record = select(LENGTHS, supervised, 0.8, 100)
    assert indices == [0, 1, 2, 8, 9]  # 30 + 50 + 20 = 100 fits; 40 more would not
    assert (record.rows, record.tokens, record.validation_rows) == (3, 100, 2)
    assert record.supervised_tokens == 15 + 25 + 10
    assert record.available_rows == 8 and record.available_tokens == sum(LENGTHS[:8])
    assert split_index(len(indices), record.train_data_ratio) == 3  # speculators' own split
    assert not record.whole


def test_a_budget_over_the_data_keeps_it_all_and_one_below_a_row_is_refused():
    _, record = select(LENGTHS, LENGTHS, 0.8, 10_000)
    assert record.whole and record.tokens == record.available_tokens
    with pytest.raises(TokenBudgetError, match=r"max_train_tokens=10 .* first training row's 30"):
        select(LENGTHS, LENGTHS, 0.8, 10)


def test_the_view_renumbers_rows_links_their_hidden_states_and_is_replaced_when_it_changes(
    tmp_path,
):
    from speculators.train.data import ArrowDataset

    prepared = prepared_dataset(tmp_path / "prepared")
    view = tmp_path / "train" / "data"
    record = training_view(prepared, view, 0.8, 100)
    assert (view / "hidden_states" / "hs_3.safetensors").resolve() == (
        prepared / "hidden_states" / "hs_8.safetensors"
    ).resolve()
    freq = torch.load(view / "token_freq.pt")
    assert sum(freq.values()) == 15 + 25 + 10 + (45 - 22) + (55 - 27)  # its own rows' tokens
    train = ArrowDataset(
        max_len=128, datapath=view, train_ratio=record.train_data_ratio, on_missing="raise"
    )
    val = ArrowDataset(
        max_len=128, datapath=view, train_ratio=record.train_data_ratio, split="val",
        on_missing="raise",
    )  # fmt: skip
    assert [int(train.data[i]["seq_len"]) for i in range(len(train))] == [30, 50, 20]
    assert [int(val.data[i]["seq_len"]) for i in range(len(val))] == [45, 55]
    # Another budget replaces the view; no budget links the whole data again.
    assert training_view(prepared, view, 0.8, 150).rows == 4
    whole = training_view(prepared, view, 0.8, None)
    assert whole.whole and not (view / SELECTION).exists()
    assert (view / "token_freq.pt").resolve() == (prepared / "token_freq.pt").resolve()


def test_the_curve_trains_each_selection_once_and_names_budgets_beyond_the_data():
    profile = load_profile("configs/smollm2-135m.yaml", ["data_curve.train_tokens=[100,200,10000]"])
    points, unreached = budgets(profile.data_curve, LENGTHS, LENGTHS, 0.8)
    assert [p.tokens for p in points] == [100, 200, 270]  # 270: the whole training split
    assert unreached == [
        {"train_tokens": 10000, "available_tokens": 270, "more_training_rows": 289}
    ]
    two_over = load_profile(
        "configs/smollm2-135m.yaml", ["data_curve.train_tokens=[100,5000,10000]"]
    )
    points, unreached = budgets(two_over.data_curve, LENGTHS, LENGTHS, 0.8)
    assert [p.tokens for p in points] == [100, 270] and len(unreached) == 2


def test_a_point_run_is_the_profile_on_a_budget_and_reloads_from_its_file(tmp_path):
    profile = load_profile("configs/smollm2-135m.yaml", [f"run.output_dir={tmp_path}"])
    for stage in ("verifier", "generate", "extract"):
        (profile.run.run_dir / stage).mkdir(parents=True)
    record = select(LENGTHS, LENGTHS, 0.8, 100)[1]
    point = budget_profile(profile, record, 3)
    assert point.run.run_dir == profile.run.run_dir / "data_curve" / "tokens-100"
    assert point.train.max_train_tokens == 100 and point.data_curve is None and point.tune is None
    assert point.eval.num_speculative_tokens == [3] and point.eval.concurrency == [1]
    assert point.train.epochs == profile.train.epochs  # only the data differs
    config = prepare_point(profile, point)
    assert Profile.model_validate(yaml.safe_load(config.read_text())) == point
    assert (point.run.run_dir / "extract").resolve() == (profile.run.run_dir / "extract")
    (point.run.run_dir / "train").mkdir()
    prepare_point(profile, budget_profile(profile, record, 1))  # another k: started over
    assert not (point.run.run_dir / "train").exists()


def test_curve_budgets_must_ascend_and_a_budget_needs_stored_hidden_states():
    with pytest.raises(ConfigError, match="ascend without repeats"):
        load_profile("configs/smollm2-135m.yaml", ["data_curve.train_tokens=[200,100]"])
    with pytest.raises(ConfigError, match=r"none are stored: use extract\.mode: offline"):
        load_profile(
            "configs/smollm2-135m.yaml", ["train.max_train_tokens=1000", "extract.mode=online"]
        )
