"""The test helpers themselves: a small volume that cannot be mounted skips a test on a
developer's machine but fails it under ``CI=true``, where the full-disk tests must run."""

from __future__ import annotations

import pytest

from tests.helpers import small_volume

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
    assert "CI=true runs this test" in str(outcome.value)
    monkeypatch.delenv("CI")
    outcome = outcome_of_an_unmountable_small_volume(tmp_path)
    assert outcome.type is pytest.skip.Exception, outcome
    assert "cannot mount a small tmpfs" in str(outcome.value)
