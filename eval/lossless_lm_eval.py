"""Losslessness through lm-eval: the same tasks scored with and without the drafter must match.

lm-eval's ``local-completions`` model talks to the vLLM server under test over its
OpenAI-compatible ``/v1/completions``; nothing is downloaded. The default task,
``eval_reference_continuation``, is written here from ``data.eval_dataset``: each document is a
held-out question plus the first half of its reference answer, the target is the next words of
that answer, generated greedily and scored with chrF and exact match. chrF is graded, so any
changed output would move it. Other task names (``eval.lm_eval_tasks``) are lm-eval's own and
need their data in the local cache.

Greedy speculative decoding is lossless by construction, so scores must be equal and so must
every document's response; a difference names the documents.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.atomic_files import atomic_write_bytes
from pipeline.core.config import Profile
from pipeline.core.prompts import load_prompts
from pipeline.serving.vllm_api import Endpoint

DEFAULT_TASK = "eval_reference_continuation"
TARGET_WORDS = 12


def write_default_task(profile: Profile, folder: Path) -> Path:
    """The shipped-data task: documents and its YAML under ``folder``; returns the task folder."""
    d = profile.data
    docs = []
    for row in load_prompts(d.eval_dataset, d.eval_revision, d.eval_split, d.eval_max_samples):
        question = next(m["content"] for m in row.messages if m["role"] == "user")
        answer = next((m["content"] for m in row.messages if m["role"] == "assistant"), "")
        words = answer.split()
        if len(words) < 2 * TARGET_WORDS:
            continue
        half = len(words) // 2
        docs.append(
            {
                "id": row.id,
                "context": f"{question}\n\n{' '.join(words[:half])}",
                "target": " " + " ".join(words[half : half + TARGET_WORDS]),
            }
        )
    tasks = folder / "tasks"
    data = tasks / "reference_continuation.jsonl"
    atomic_write_bytes(data, "".join(json.dumps(doc) + "\n" for doc in docs).encode())
    task = {
        "task": DEFAULT_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{target}}",
        "generation_kwargs": {
            "until": ["\n"],
            "do_sample": False,
            "temperature": 0.0,
            "max_gen_toks": 2 * TARGET_WORDS,
        },
        "metric_list": [
            {"metric": "chrf", "aggregation": "chrf", "higher_is_better": True},
            {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1},
    }
    atomic_write_bytes(tasks / f"{DEFAULT_TASK}.yaml", yaml.safe_dump(task).encode())
    return tasks


def score(endpoint: Endpoint, profile: Profile, tokenizer: str, tasks_dir: Path) -> dict[str, Any]:
    """Run ``eval.lm_eval_tasks`` against ``endpoint``: scores and each document's response."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": endpoint.model,
            "base_url": f"{endpoint.v1}/completions",
            "tokenizer": tokenizer,
            "tokenized_requests": False,
            "num_concurrent": 1,
            "max_retries": profile.generate.max_retries,
            "timeout": int(profile.generate.request_timeout_s),
            "trust_remote_code": profile.verifier.trust_remote_code,
        },
        tasks=list(profile.eval.lm_eval_tasks),
        task_manager=TaskManager(include_path=str(tasks_dir)),
        limit=profile.eval.lm_eval_limit,
        log_samples=True,
        bootstrap_iters=0,  # equality is the check here, not a confidence interval
        random_seed=profile.run.seed,
        numpy_random_seed=profile.run.seed,
        torch_random_seed=profile.run.seed,
        fewshot_random_seed=profile.run.seed,
    )
    scores = {
        task: {
            k.split(",")[0]: float(v)
            for k, v in metrics.items()
            if "," in k and "stderr" not in k and isinstance(v, int | float)
        }
        for task, metrics in out["results"].items()
    }
    responses = {
        task: {str(s["doc_id"]): s["filtered_resps"][0] for s in samples}
        for task, samples in out["samples"].items()
    }
    return {"scores": scores, "responses": responses}


def compare(baseline: dict[str, Any], drafted: dict[str, Any]) -> dict[str, Any]:
    """Equal scores and responses, task by task; the differing documents otherwise."""
    tasks = {}
    for task, scores in baseline["scores"].items():
        base_resp, spec_resp = baseline["responses"][task], drafted["responses"][task]
        differing = sorted(doc for doc, r in base_resp.items() if spec_resp.get(doc) != r)
        tasks[task] = {
            "documents": len(base_resp),
            "scores_without_drafter": scores,
            "scores_with_drafter": drafted["scores"][task],
            "scores_match": scores == drafted["scores"][task],
            "differing_documents": differing,
        }
    return {
        "tasks": tasks,
        "lossless": all(t["scores_match"] and not t["differing_documents"] for t in tasks.values()),
    }
