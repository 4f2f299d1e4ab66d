"""Bad input to `generate`, through a real vLLM server: each case skipped by policy and counted.

One server serves the tiny verifier with vLLM's ``deepseek_r1`` reasoning parser. The tiny model
never closes a ``</think>``, so that parser returns every reply as reasoning with no answer: real
reasoning-only responses, from vLLM's own parser. On top, the prompt set has an over-long prompt
(rejected by vLLM against ``server.max_model_len``), an over-long second turn, a malformed
row, a torn JSON line, a line of non-UTF-8 bytes and an empty line. Each policy switch is run
against the same server, and every manifest must account for every input line:
``succeeded + skipped + failed == input``, each skip listed in ``skipped.jsonl`` by line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import generate
from pipeline.core.config import load_profile
from pipeline.core.prompts import PromptDataError
from pipeline.serving.vllm_server import vllm_server
from tests.helpers import seed_run_dir, verifier_model

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
LONG = " ".join(f"word{i} of a prompt far longer than the context window" for i in range(700))


def prompt_rows() -> list[dict]:
    good = [
        {"id": f"good-{i}", "source": "tiny-blend/writing",
         "conversations": [{"from": "human", "value": text}]}
        for i, text in enumerate(["Write a short poem about rain.", "Explain what a prime is.",
                                  "Give three tips for learning to cook."])
    ]  # fmt: skip
    return [
        *good,
        {"id": "too-long", "source": "tiny-blend/writing",
         "conversations": [{"from": "human", "value": LONG}]},
        {"id": "long-second-turn", "source": "tiny-blend/writing",
         "conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "Hi."},
                           {"from": "human", "value": LONG}]},
        {"id": "no-turns", "source": "tiny-blend/writing", "conversations": []},
    ]  # fmt: skip


def records(profile) -> dict[str, dict]:
    path = profile.run.run_dir / "generate" / "responses.jsonl"
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def skipped(profile) -> list[dict]:
    path = profile.run.run_dir / "generate" / "skipped.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bad_prompts_and_replies_are_skipped_by_policy_and_counted(tiny_verifier, tmp_path):
    data = tmp_path / "prompts.jsonl"
    lines = [json.dumps(r).encode() for r in prompt_rows()]
    lines[3:3] = [b'{"id": "torn", "conversations": [{"from": "hu', b"", b'{"id": "\xff\xfe"}']
    data.write_bytes(b"\n".join(lines) + b"\n")  # lines 4-6 broken; "no-turns" is line 9
    base = [f"data.dataset={data}", "generate.max_tokens=24", "server.reasoning_parser=deepseek_r1"]

    def profile_for(name: str, *overrides: str):
        p = load_profile(REPO / "configs/tiny.yaml", [f"run.output_dir={tmp_path / name}", *base,
                                                      *overrides])  # fmt: skip
        seed_run_dir(tiny_verifier, p, ("verifier",))
        return p

    strict = profile_for("strict")
    with pytest.raises(PromptDataError, match=rf"^{data} line 4: not JSON.*on_malformed_row=skip"):
        generate.run(strict)

    server_profile = profile_for("server")
    model = verifier_model(server_profile)
    with vllm_server(server_profile, model, tmp_path / "vllm.log") as server:
        at = f"server.base_url={server.base_url}"

        skipping = profile_for("skip", at, "data.on_malformed_row=skip")
        counts = generate.run(skipping)["counts"]
        assert counts == counts | {"input": 9, "succeeded": 0, "skipped": 9, "failed": 0}
        assert counts["skip_reasons"] == {
            "reasoning_only_response": 4, "prompt_too_long": 1, "malformed_row": 1,
            "invalid_json": 1, "invalid_utf8": 1, "empty_line": 1,
        }  # fmt: skip
        too_long = records(skipping)["too-long"]
        assert too_long["skip_reason"] == "prompt_too_long" and too_long["conversations"] == []
        assert "word1 " not in (skipping.run.run_dir / "generate/responses.jsonl").read_text()
        listed = skipped(skipping)
        assert {(x["where"], x["reason"]) for x in listed} >= {
            (f"{data} line 4", "invalid_json"), (f"{data} line 5", "empty_line"),
            (f"{data} line 6", "invalid_utf8"), (f"{data} line 7", "prompt_too_long"),
            (f"{data} line 9", "malformed_row"),
        }  # fmt: skip
        assert len(listed) == counts["skipped"]

        keeping = profile_for(
            "keep", at, "data.on_malformed_row=skip", "generate.keep_reasoning_only=true"
        )
        counts = generate.run(keeping)["counts"]
        assert counts == counts | {"input": 9, "succeeded": 3, "skipped": 6, "with_reasoning": 3}
        assert counts["skip_reasons"] == {
            "prompt_too_long": 2, "malformed_row": 1, "invalid_json": 1, "invalid_utf8": 1,
            "empty_line": 1,
        }  # fmt: skip
        got = records(keeping)
        # The over-long second turn ends the conversation after its answered first turn.
        assert len(got["long-second-turn"]["finish_reasons"]) == 1
        assert counts["truncated"] == sum(
            "length" in r["finish_reasons"] for r in got.values() if not r["skip_reason"]
        )
        reply = got["good-0"]["conversations"][-1]
        assert reply["from"] == "gpt" and reply["reasoning_content"].strip()

        no_truncated = profile_for(
            "no-truncated", at, "data.on_malformed_row=skip", "generate.keep_reasoning_only=true",
            "generate.on_truncated=skip", "generate.max_tokens=4",
        )  # fmt: skip
        counts = generate.run(no_truncated)["counts"]
        assert counts["skip_reasons"]["truncated_response"] >= 3  # 4 tokens rarely end a reply
        assert counts["truncated"] == 0  # none kept
        assert counts["succeeded"] + counts["skipped"] + counts["failed"] == counts["input"] == 9
