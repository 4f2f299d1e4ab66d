"""The shard contract (pipeline.core.shards): the partition, the config field, and generate's
merge refusing missing, mixed and misplaced shards by name. The real sharded run over Ray is
tests/test_ray_shards_e2e.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from pipeline import generate
from pipeline.core import cli
from pipeline.core.config import ConfigError, load_profile
from pipeline.core.contracts import GenerateOutputs
from pipeline.core.manifest import now, shard_profile, shard_record, stage_dir, write_manifest
from pipeline.core.shards import Shard, ShardError, shard_index, sum_counts
from tests.helpers import stand_in_manifest

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent


def profile_at(tmp_path: Path, *overrides: str):
    return load_profile(REPO / "configs/tiny.yaml", [f"run.output_dir={tmp_path}", *overrides])


def test_the_partition_is_stable_complete_and_balanced():
    ids = [f"tiny-blend-{i}" for i in range(4000)]
    # Pinned: a changed hash would send finished shards' prompts elsewhere.
    assert [shard_index(i, 64) for i in ids[:4]] == [shard_index(i, 64) for i in ids[:4]]
    assert (
        shard_index("tiny-blend-0", 1_000_000)
        == int.from_bytes(__import__("hashlib").sha256(b"tiny-blend-0").digest()[:8], "big")
        % 1_000_000
    )
    sizes = Counter(shard_index(i, 8) for i in ids)
    assert sorted(sizes) == list(range(8)) and max(sizes.values()) < 1.2 * len(ids) / 8
    assert all(sum(Shard(k, 8).holds(i) for k in range(8)) == 1 for i in ids[:200])


@pytest.mark.parametrize("text", ["4/4", "1", "-1/3", "a/b", "0/0"])
def test_a_bad_shard_is_refused_by_the_config(tmp_path, text):
    with pytest.raises(ConfigError, match=r"run\.shard"):
        profile_at(tmp_path, f"run.shard={text}")


def test_a_shard_folder_is_under_its_stage(tmp_path):
    profile = profile_at(tmp_path, "run.shard=3/64")
    assert stage_dir(profile, "generate") == tmp_path / "tiny/generate/shards/00003-of-00064"
    assert stage_dir(profile, "verifier") == tmp_path / "tiny/verifier"


def test_stages_that_do_not_shard_refuse_run_shard(tmp_path, capsys):
    args = ["--config", str(REPO / "configs/tiny.yaml"), f"run.output_dir={tmp_path}"]
    with pytest.raises(SystemExit) as exit_:
        cli.run_stage("train", lambda p: {}, [*args, "run.shard=0/2"])
    assert exit_.value.code == 2
    assert "only generate and extract run by shard" in capsys.readouterr().err


def test_counts_sum_by_key():
    a = {"input": 3, "skip_reasons": {"x": 1}, "succeeded": 2}
    b = {"input": 4, "skip_reasons": {"x": 2, "y": 1}, "succeeded": 4}
    assert sum_counts([a, b]) == {"input": 7, "skip_reasons": {"x": 3, "y": 1}, "succeeded": 6}


def finish_shard(profile, shard: Shard, ids: list[str]) -> None:
    """A finished generate shard: its responses and a manifest written by the stage's code."""
    own = shard_profile(profile, shard)
    folder = stage_dir(own, "generate")
    folder.mkdir(parents=True)
    records = [{"id": i, "source": "s", "conversations": [], "finish_reasons": ["stop"],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2}, "skip_reason": None}
               for i in ids]  # fmt: skip
    (folder / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "skipped.jsonl").write_text("")
    from pipeline.core.manifest import stage_manifest

    verifier = stage_manifest(own, "verifier").outputs
    write_manifest(
        own, "generate", started_at=now(), counts={"input": len(ids), "succeeded": len(ids)},
        outputs=GenerateOutputs(responses="responses.jsonl", skipped="skipped.jsonl",
                                sampling={}, replicas=[], shard=shard_record(own, verifier)),
    )  # fmt: skip


def ids_of(shard: Shard, n: int = 3) -> list[str]:
    return [i for i in (f"p{j}" for j in range(400)) if shard.holds(i)][:n]


@pytest.fixture
def sharded(tmp_path):
    profile = profile_at(tmp_path)
    stand_in_manifest(profile, "verifier", model="v", chat_template_sha256="c",
                      capture_layer_ids=[1, 3, 4], hidden_size=128)  # fmt: skip
    return profile


def test_merge_puts_every_shard_together(sharded):
    for k in range(3):
        finish_shard(sharded, Shard(k, 3), ids_of(Shard(k, 3)))
    merged = generate.merge(sharded)
    assert merged["counts"] == {"input": 9, "succeeded": 9}
    assert merged["outputs"]["shards"]["count"] == 3
    assert len(merged["outputs"]["shards"]["manifests"]) == 3
    lines = (stage_dir(sharded, "generate") / "responses.jsonl").read_text().splitlines()
    wanted = [i for k in range(3) for i in ids_of(Shard(k, 3))]
    assert [json.loads(x)["id"] for x in lines] == wanted


def test_merge_names_missing_and_unfinished_shards(sharded):
    finish_shard(sharded, Shard(0, 4), ids_of(Shard(0, 4)))
    stage_dir(shard_profile(sharded, Shard(2, 4)), "generate").mkdir(parents=True)
    with pytest.raises(ShardError, match=r"missing: 1/4, 3/4; started, no manifest: 2/4"):
        generate.merge(sharded)


def test_merge_refuses_mixed_splits_and_profiles(sharded, tmp_path):
    finish_shard(sharded, Shard(0, 2), ids_of(Shard(0, 2)))
    other = profile_at(tmp_path, "generate.max_tokens=17")
    finish_shard(other, Shard(1, 2), ids_of(Shard(1, 2)))
    with pytest.raises(ShardError, match=r"shard 1/2 was made differently .*profile_sha256"):
        generate.merge(sharded)
    finish_shard(sharded, Shard(0, 3), ids_of(Shard(0, 3)))
    with pytest.raises(ShardError, match=r"different splits are mixed .*S = 2, 3"):
        generate.merge(sharded)


def test_merge_refuses_a_prompt_in_the_wrong_shard(sharded):
    finish_shard(sharded, Shard(0, 2), ids_of(Shard(0, 2)))
    finish_shard(sharded, Shard(1, 2), [*ids_of(Shard(1, 2)), ids_of(Shard(0, 2))[0]])
    with pytest.raises(
        ShardError, match=r"shard 1/2 holds prompt 'p\d+', which belongs to shard 0"
    ):
        generate.merge(sharded)


def test_merge_never_replaces_an_unsharded_run(sharded):
    folder = stage_dir(sharded, "generate")
    folder.mkdir(parents=True)
    (folder / "responses.jsonl").write_text('{"id": "p0"}\n')
    finish_shard(sharded, Shard(0, 1), ids_of(Shard(0, 1)))
    with pytest.raises(ShardError, match=r"holds an unsharded run's responses"):
        generate.merge(sharded)
    assert (folder / "responses.jsonl").read_text() == '{"id": "p0"}\n'


def test_a_merge_is_stale_once_a_shard_is_rerun(sharded):
    from pipeline.core.manifest import StageInputError, stage_manifest

    for k in range(2):
        finish_shard(sharded, Shard(k, 2), ids_of(Shard(k, 2)))
    generate.merge(sharded)
    stage_manifest(sharded, "generate")  # fresh
    shard = stage_dir(shard_profile(sharded, Shard(1, 2)), "generate")
    manifest = json.loads((shard / "manifest.json").read_text())
    manifest["counts"]["input"] += 1  # rerun, to another result
    (shard / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StageInputError, match=r"its shard 00001-of-00002 was rerun or removed"):
        stage_manifest(sharded, "generate")
