"""vLLM KV connectors that save EAGLE-3 hidden states atomically, within a disk reserve.

vLLM's ``extract_hidden_states`` speculative method stacks the verifier's hidden states at the
requested layer ids into a cache-only attention layer; a KV connector then writes them out per
request as ``<shared_storage_path>/<req_id>.safetensors`` with ``hidden_states``
[num_tokens, num_layer_ids, hidden_size] (model dtype) and ``token_ids`` [num_tokens] int64, plus
a ``.lock`` held (flock LOCK_EX) until the file is complete. speculators' data generation waits on
the lock and moves the file into the dataset.

The stock ``ExampleHiddenStatesConnector`` writes straight to the final name, so a crash or a full
disk leaves a short file behind, and it writes whatever the free space. The classes here change
only the file write:

- ``ReservedHiddenStatesConnector`` (CUDA): every shard is written with
  :func:`pipeline.core.atomic_files.save_tensors_atomically` (temporary file, fsync,
  rename), and a shard that would leave less than ``disk_reserve_bytes``
  (kv_connector_extra_config) free is not
  written at all. With ``hidden_states_format: fp8`` shards are quantised (per-token scale) in
  speculators' fp8 layout. A shard that is not written is logged and leaves no file; the client
  sees the file missing, skips the row, and the extract stage reports how much space it needs.
- ``CpuHiddenStatesConnector`` (CPU-only vLLM builds): the same write, plus a host-memory save
  path, because the stock one copies device->host with CUDA streams, events and pinned memory,
  which the CPU build does not have (``pin_memory=True`` raises on the first request). On CPU the
  cache already lives in host memory, so the copy is a plain gather.

Loaded by vLLM through ``--kv-transfer-config`` with ``kv_connector_module_path`` set to this
module (the repository root must be on PYTHONPATH of the server process). They rely on the stock
connector's internals listed in ``STOCK_ATTRIBUTES``; tests check they still exist, so a vLLM
upgrade that renames them fails loudly.
"""

from __future__ import annotations

import fcntl
import logging
import os
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import torch
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

from pipeline.core.atomic_files import save_tensors_atomically

log = logging.getLogger(__name__)

# Stock-connector attributes these classes read, call or override.
STOCK_ATTRIBUTES = (
    "_kv_cache",
    "_block_size",
    "_lock_fds",
    "use_lock",
    "_executor",
    "_req_futures",
    "_on_write_done",
    "_is_tp_rank_zero",
    "_accumulated_finished_req_ids",
    "_kv_transfer_config",
    "_write_tensors",
)


def write_shard(
    tensors: dict[str, torch.Tensor], path: str, reserve_bytes: int, fp8: bool = False
) -> bool:
    """Write one hidden-state shard atomically; False (and no file) if it cannot be written.

    With ``fp8`` the hidden states are stored as float8_e4m3fn with one float32 scale per token
    (``hidden_states_scales``), the layout speculators' fp8 backend reads back. Non-finite
    hidden states are refused first: a scale would hide them.
    """
    hidden_states = tensors["hidden_states"]
    if not bool(torch.isfinite(hidden_states).all()):
        log.error("hidden-state shard %s not written: non-finite hidden states", path)
        return False
    if fp8:
        quantised, scales = quantize_tensor_to_fp8(hidden_states)
        tensors = {**tensors, "hidden_states": quantised, SCALES_KEY: scales}
    try:
        save_tensors_atomically(tensors, Path(path), reserve_bytes)
    except OSError as err:
        log.error("hidden-state shard %s not written: %s", path, err)
        return False
    return True


class ReservedHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock connector with atomic shard writes that keep a free-space reserve."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config
        self._disk_reserve_bytes = int(extra("disk_reserve_bytes", 0))
        self._fp8 = extra("hidden_states_format", "verifier_dtype") == "fp8"

    def _write_and_unlock(
        self, tensors: dict[str, torch.Tensor], path: str, lock_fd: int | None
    ) -> None:
        try:
            write_shard(tensors, path, self._disk_reserve_bytes, self._fp8)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the client may read (or miss) the file

    def _write_tensors(self, tensors, event, filename, lock_fd) -> None:  # stock signature
        try:
            event.synchronize()
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        self._write_and_unlock(tensors, filename, lock_fd)


class CpuHiddenStatesConnector(ReservedHiddenStatesConnector):
    """``ReservedHiddenStatesConnector`` with a host-memory save path for CPU-only vLLM."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        # Worker side: requests whose rows were copied out of the cache but not yet reported.
        self._copied_req_ids: set[str] = set()

    def _save_request(self, pending: PendingSave) -> None:
        """Gather one finished request's rows out of the cache and queue the file write.

        Advanced indexing makes an independent copy, so the request's cache blocks may be
        freed as soon as this returns.
        """
        assert self._kv_cache is not None, "register_kv_caches was not called"
        bs = self._block_size
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (block_ids[:, None] * bs + torch.arange(bs, dtype=torch.long)).flatten()
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {
            "hidden_states": hidden_states.contiguous(),
            "token_ids": pending.token_ids.clone(),
        }
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # normally made by wait_for_save
        if lock_fd is None and self.use_lock:
            flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
            lock_fd = os.open(pending.filename + ".lock", flags, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future: Future = self._executor.submit(
            self._write_and_unlock, tensors, pending.filename, lock_fd
        )
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        copied = self._copied_req_ids
        if self._is_tp_rank_zero and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._save_request(pending)
                    copied.add(pending.req_id)
        # A request is done sending (its blocks may be freed) once its rows are copied out;
        # clients wait on the per-file flock for the disk write itself.
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = copied & self._accumulated_finished_req_ids
        copied -= done
        self._accumulated_finished_req_ids -= done
        # A finished request still holding its pre-made lock fd has a save on the way; keep
        # it. Any other finished request had no save: forget it.
        self._accumulated_finished_req_ids &= set(self._lock_fds)
        return done or None, None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
