"""The test helpers themselves: a test that cannot run here (no small volume, no Docker engine,
no Slurm or SkyPilot) skips on a developer's machine but fails under CI, which must run it."""

from __future__ import annotations

import pytest

from tests.helpers import in_ci, small_volume

pytestmark = pytest.mark.unit
UNMOUNTABLE = -5  # tmpfs refuses a negative size, even for root


def outcome_of_an_unmountable_small_volume(tmp_path) -> pytest.ExceptionInfo:
    # BaseException: pytest's skip and fail outcomes are not Exceptions.
    with pytest.raises(BaseException) as info, small_volume(tmp_path / "volume", UNMOUNTABLE):
        pass
    return info


def test_an_unmountable_small_volume_fails_under_ci_and_skips_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    outcome = outcome_of_an_unmountable_small_volume(tmp_path)
    assert outcome.type is pytest.fail.Exception, outcome
    assert "CI runs this test, so it fails rather than skips" in str(outcome.value)
    monkeypatch.delenv("CI")
    outcome = outcome_of_an_unmountable_small_volume(tmp_path)
    assert outcome.type is pytest.skip.Exception, outcome
    assert "cannot mount a small tmpfs" in str(outcome.value)


@pytest.mark.parametrize(
    ("value", "ci"),
    [("true", True), ("1", True), ("yes", True), ("True", True), ("", False), ("0", False),
     ("false", False), ("no", False)],
)  # fmt: skip
def test_ci_is_any_value_ci_services_set(monkeypatch, value, ci):
    monkeypatch.setenv("CI", value)
    assert in_ci() is ci
    monkeypatch.delenv("CI")
    assert in_ci() is False
