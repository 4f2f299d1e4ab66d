"""Every shipped profile validates; bad fields are named with the allowed values."""

from pathlib import Path

import pytest

from pipeline.core.config import ConfigError, load_profile

pytestmark = pytest.mark.unit
CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_profiles_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"tiny.yaml", "kimi-k2.5.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_profile_validates(path):
    profile = load_profile(path)
    v = profile.verifier
    assert v.capture_layer_ids[-1] < v.num_hidden_layers
    assert profile.server.host == "127.0.0.1"


def test_kimi_profile_is_the_hero_run():
    p = load_profile(Path(__file__).parent.parent / "configs" / "kimi-k2.5.yaml")
    assert p.verifier.model == "moonshotai/Kimi-K2.5" and p.verifier.trust_remote_code
    assert p.server.tensor_parallel_size == 8
    assert p.server.kv_cache_dtype == "auto"  # no FP8 KV cache on SM120
    assert p.data.max_samples == 25_000 and p.generate.concurrency == 128
    assert str(p.run.output_dir).startswith("/data")
    assert p.verifier.capture_layer_ids == [2, 30, 58]
    assert p.data.revision and len(p.data.revision) == 40
    # The published Kimi-family drafters, measured beside ours (and alone, before training).
    assert {r.path for r in p.eval.reference_drafters} == {
        "AQ-MedAI/Kimi-K2-Instruct-eagle3",
        "lightseekorg/kimi-k2.5-eagle3",
        "lightseekorg/kimi-k2.5-eagle3-mla",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_profile_has_its_verifier_and_data_in_the_license_manifest(path):
    from release.licenses import load_license_manifest, verifier_key

    profile = load_profile(path)
    manifest = load_license_manifest(profile.release.licenses_file)
    assert verifier_key(profile) in manifest.verifiers
    entry = manifest.datasets[profile.data.dataset]
    if profile.data.revision:  # the pin the profile reads is the revision that was checked
        assert entry.revision == profile.data.revision


def test_a_profile_extends_another_section_by_section():
    local = load_profile("configs/kimi-k2.5.yaml")
    b300 = load_profile("configs/kimi-k2.5-b300.yaml")
    assert b300.generate.concurrency == 256 and local.generate.concurrency == 128
    # Unset fields of a section it overrides are inherited, not reset to defaults.
    assert b300.generate.max_tokens == local.generate.max_tokens == 7168
    assert b300.server.reasoning_parser == "kimi_k2" and b300.data == local.data
    assert b300.plan.machines[0].name.startswith("B300")  # lists replace, first = this machine


def test_an_extends_loop_or_missing_base_is_named(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="`extends` loops back"):
        load_profile(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere\.yaml does not exist"):
        load_profile(tmp_path / "c.yaml")


def test_unknown_and_repeated_fields_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    with_extract = next(c for c in CONFIGS if "\nextract:" in c.read_text())
    bad.write_text(with_extract.read_text() + "\nextract:\n  max_seq_len: 10\n")
    with pytest.raises(ConfigError, match="'extract' is given twice"):
        load_profile(bad)
    with pytest.raises(ConfigError, match=r"generate\.concurency: Extra inputs"):
        load_profile("configs/tiny.yaml", ["generate.concurency=3"])


def test_bad_choice_lists_allowed_values():
    with pytest.raises(ConfigError) as err:
        load_profile("configs/tiny.yaml", ["server.kv_cache_dtype=fp4"])
    msg = str(err.value)
    assert "server.kv_cache_dtype" in msg and "'auto'" in msg and "'fp8'" in msg


def test_capture_layers_outside_the_model_are_rejected():
    with pytest.raises(ConfigError, match="capture_layer_ids"):
        load_profile("configs/tiny.yaml", ["verifier.capture_layer_ids=[1, 3, 6]"])
    with pytest.raises(ConfigError, match="distinct and ascending"):
        load_profile("configs/tiny.yaml", ["verifier.capture_layer_ids=[3, 1, 4]"])


def test_servers_bind_loopback_only():
    with pytest.raises(ConfigError, match="loopback only"):
        load_profile("configs/tiny.yaml", ["server.host=0.0.0.0"])


def test_overrides_revalidate_and_apply():
    p = load_profile("configs/tiny.yaml", ["generate.concurrency=3", "run.name=x"])
    assert p.generate.concurrency == 3 and p.run.name == "x"


def test_reference_drafters_and_finetuning_are_typed():
    tiny = Path("configs/tiny.yaml")
    alone = load_profile(
        tiny, ["eval.methods=[]", "eval.reference_drafters=[{name: x, path: o/d}]"]
    )
    assert alone.eval.reference_drafters[0].layer_ids_from == "vllm"
    assert alone.eval.reference_drafters[0].method == "eagle3"
    with pytest.raises(ConfigError, match="eval has nothing to measure"):
        load_profile(tiny, ["eval.methods=[]"])
    with pytest.raises(ConfigError, match="is one of eval's own arms"):
        load_profile(tiny, ["eval.reference_drafters=[{name: ngram, path: o/d}]"])
    with pytest.raises(ConfigError, match="names a drafter twice"):
        load_profile(tiny, ["eval.reference_drafters=[{name: a, path: o/d}, {name: a, path: o/e}]"])
    with pytest.raises(ConfigError, match="layer_ids_from"):
        load_profile(tiny, ["eval.reference_drafters=[{name: a, path: o/d, layer_ids_from: x}]"])
    # A bare path is the drafter's path; the mapping names its revision and layer convention.
    assert load_profile(tiny, ["train.from_pretrained=o/d"]).train.from_pretrained.path == "o/d"
    given = load_profile(tiny, ["train.from_pretrained={path: o/d, layer_ids_from: sglang}"])
    assert given.train.from_pretrained.layer_ids_from == "sglang"
