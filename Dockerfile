# The pipeline image for GPU hosts: vLLM's OpenAI server image at the project's vLLM pin, plus
# the project and its pinned dependencies. No secret enters any layer: the HF token comes from
# the environment (or a compose secret) at run time; the HF cache and /data are mounts.
FROM vllm/vllm-openai:v0.32.0

ARG UID=1000
ENV PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app \
    HF_HOME=/hf-cache \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

WORKDIR /app
COPY requirements/container.txt requirements/container.txt
RUN python3 -m pip install --no-cache-dir -r requirements/container.txt

COPY pipeline pipeline
COPY eval eval
COPY model_card model_card
COPY release release
COPY configs configs
COPY data data
COPY Makefile pyproject.toml README.md LICENSE ./

RUN useradd --create-home --uid "${UID}" drafter \
    && mkdir -p /data /hf-cache && chown "${UID}" /data /hf-cache
# Not root: numeric, so the host and volume permissions agree on who this is.
USER ${UID}

# `make` targets run the same stage modules as on a CPU machine, with the image's Python and vLLM
# (STAMP= skips the CPU venv set-up).
ENTRYPOINT ["make", "PY=python3", "STAMP="]
CMD ["hero-run", "CONFIG=configs/kimi-k2.5.yaml"]
