"""Atomic writes: a refused or failed write leaves the old file and no temporary behind."""

from __future__ import annotations

import errno

import pytest

from pipeline.core.atomic_files import ReserveExceededError, atomic_write_bytes, remove_temporaries
from tests.helpers import small_volume

pytestmark = pytest.mark.unit


def test_write_that_would_cross_the_reserve_writes_nothing(tmp_path):
    target = tmp_path / "shard.safetensors"
    atomic_write_bytes(target, b"old")
    with pytest.raises(ReserveExceededError) as info:
        atomic_write_bytes(target, b"new", reserve_bytes=2**62)
    assert info.value.errno == errno.ENOSPC and "must stay free" in str(info.value)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]


def test_enospc_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    with small_volume(tmp_path / "volume", 1024 * 1024) as volume:
        target = volume / "shard.safetensors"
        atomic_write_bytes(target, b"old")
        with pytest.raises(OSError) as info:
            atomic_write_bytes(target, b"\1" * (2 * 1024 * 1024))
        assert info.value.errno == errno.ENOSPC
        assert target.read_bytes() == b"old"
        assert [p.name for p in volume.iterdir()] == ["shard.safetensors"]


def test_remove_temporaries_only_touches_temporaries(tmp_path):
    (tmp_path / ".hs_1.safetensors.abc.tmp").write_bytes(b"partial")
    (tmp_path / "hs_0.safetensors").write_bytes(b"whole")
    assert remove_temporaries(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["hs_0.safetensors"]
