"""The rows speculators trains on: all of extract's prepared data, or a token budget of it.

speculators splits a prepared dataset by position: the first ``int(rows * ratio)`` rows train,
the rest validate, and row ``i`` reads ``hidden_states/hs_<i>.safetensors``. A budget
(``train.max_train_tokens``) keeps the longest leading run of training rows whose tokens fit it,
and every validation row, so drafters trained on different budgets are validated on the same
rows. The budget's view is a dataset of its own (rows selected, then renumbered), whose
``hs_<j>`` are links to the hidden states of the rows it kept (no copy), with the token
frequencies of its own rows (the draft vocabulary is chosen from what it trains on) and the
ratio that splits it at the same boundary.

Invariants: the view is written whole into a temporary folder and renamed into place; a view
of another selection, or of data extraction has since rewritten, is replaced, never reused; a
budget below the first row is an error naming the smallest budget that trains.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.core.errors import PipelineError

SELECTION = "selection.json"


class TokenBudgetError(PipelineError):
    """A token budget that selects no training row."""


@dataclass(frozen=True)
class TrainingData:
    """What speculators trains on, as recorded in train's manifest."""

    rows: int  # training rows (the validation rows come after them)
    tokens: int  # their tokens (seq_len): what the budget counts
    supervised_tokens: int  # of which assistant tokens (loss_mask = 1)
    validation_rows: int
    available_rows: int  # the training split of extract's data
    available_tokens: int
    max_train_tokens: int | None
    train_data_ratio: float  # the ratio that splits the dataset speculators reads

    @property
    def whole(self) -> bool:
        """Every available training row is kept."""
        return self.rows == self.available_rows

    def record(self) -> dict[str, int | float | bool | None]:
        return {**asdict(self), "whole": self.whole}


def split_lengths(prepared: Path) -> tuple[list[int], list[int]]:
    """Each row's tokens and supervised (assistant) tokens, in the dataset's order; the masks
    summed in Arrow a batch at a time (a hero run's are hundreds of millions of values)."""
    import numpy as np
    import pyarrow.compute as pc
    from datasets import load_from_disk

    data = load_from_disk(str(prepared)).with_format("arrow")
    seq_lens: list[int] = []
    supervised: list[int] = []
    for batch in data.iter(batch_size=4096):
        seq_lens += batch.column("seq_len").to_pylist()
        masks = batch.column("loss_mask").combine_chunks()
        rows = pc.list_parent_indices(masks).to_numpy(zero_copy_only=False)
        ones = pc.list_flatten(masks).to_numpy(zero_copy_only=False)
        supervised += np.bincount(rows, weights=ones, minlength=len(masks)).astype(int).tolist()
    return seq_lens, supervised


def split_index(rows: int, ratio: float) -> int:
    """The first validation row, by the expression speculators' dataset uses."""
    return int(rows * ratio)


def select(
    seq_lens: list[int], supervised: list[int], ratio: float, max_train_tokens: int | None
) -> tuple[list[int], TrainingData]:
    """The row indices of the view (training rows, then every validation row) and its record."""
    split = split_index(len(seq_lens), ratio)
    available = sum(seq_lens[:split])
    kept, tokens = 0, 0
    for length in seq_lens[:split]:
        if max_train_tokens is not None and tokens + length > max_train_tokens:
            break
        kept, tokens = kept + 1, tokens + length
    if kept == 0:
        raise TokenBudgetError(
            f"train.max_train_tokens={max_train_tokens} is below the first training row's "
            f"{seq_lens[0] if seq_lens else 0} tokens: raise it"
        )
    indices = [*range(kept), *range(split, len(seq_lens))]
    validation = len(seq_lens) - split
    # speculators takes int(rows * ratio) training rows: half a row above `kept` lands on it.
    view_ratio = ratio if kept == split else (kept + 0.5) / len(indices)
    record = TrainingData(
        rows=kept,
        tokens=tokens,
        supervised_tokens=sum(supervised[:kept]),
        validation_rows=validation,
        available_rows=split,
        available_tokens=available,
        max_train_tokens=max_train_tokens,
        train_data_ratio=view_ratio,
    )
    return indices, record


def training_view(
    prepared: Path, view: Path, ratio: float, max_train_tokens: int | None
) -> TrainingData:
    """The dataset folder speculators reads at ``view``: links to all of ``prepared`` without a
    budget, else the budget's own dataset (module docstring). Returns what it trains on."""
    seq_lens, supervised = split_lengths(prepared)
    indices, record = select(seq_lens, supervised, ratio, max_train_tokens)
    marker = view / SELECTION
    if record.whole:  # no budget, or one the data does not reach: select kept the ratio
        if marker.exists():  # a budget's view: not the whole data
            shutil.rmtree(view)
        _link_all(prepared, view)
        return record
    # The data's own fingerprint too: a view of data extraction has since rewritten is redone.
    data = hashlib.sha256((prepared / "state.json").read_bytes() + repr(seq_lens).encode())
    wanted = json.dumps(
        {"max_train_tokens": max_train_tokens, "rows": indices, "data": data.hexdigest()},
        sort_keys=True,
    )
    if marker.exists() and marker.read_text() == wanted:
        return record
    _write_budget_view(prepared, view, indices, wanted)
    return record


def _link_all(prepared: Path, view: Path) -> None:
    """Links to every file of ``prepared``; the vocabulary maps speculators writes land in
    ``view``, beside them, not in extract's folder."""
    view.mkdir(parents=True, exist_ok=True)
    for item in prepared.iterdir():
        if item.name.startswith(("d2t-", "t2d-")):
            continue
        link = view / item.name
        if not link.is_symlink():
            link.symlink_to(item.resolve())


def _write_budget_view(prepared: Path, view: Path, indices: list[int], selection: str) -> None:
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    staging = view.with_name(view.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    subset = load_from_disk(str(prepared)).select(indices)
    subset.save_to_disk(str(staging))
    links = staging / "hidden_states"
    links.mkdir()
    source = (prepared / "hidden_states").resolve()
    for new, old in enumerate(indices):
        (links / f"hs_{new}.safetensors").symlink_to(source / f"hs_{old}.safetensors")
    save_token_frequency_distribution(subset, staging / "token_freq.pt")
    (staging / SELECTION).write_text(selection)
    shutil.rmtree(view, ignore_errors=True)
    staging.rename(view)
