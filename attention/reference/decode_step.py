"""The reference decode kernels as attention backends of the decode state.

Importing this module registers two kernels with
``attention.decode.step.register_backend`` (the product module never imports
the reference area; validation imports this module instead):

* ``"warp"``: ``attention.reference.warp_decode.batched_decode_kernel``, one
  warp per (head, sequence), grid ``(H, M)``;
* ``"split"``: ``attention.reference.split_decode``'s chunk kernel, grid
  ``(H, M, n_split)``, then its combine, grid ``(H, M)``.

Both take float32 caches ``[KV_SLOTS, H_kv, max_seq, D]`` and float32 q
``[M, H, D]``, read ``seq_lens [M]`` and ``slot_table [M]`` written by the
state's prepare kernel, and write ``out [M, H, D]``, ``lse [M, H]`` float32.
Their planted defects are ``warp_decode.KERNEL_DEFECTS``.
"""

from __future__ import annotations

import numpy as np

from attention.core.device import device_empty
from attention.decode.step import register_backend
from attention.reference.split_decode import (flash_decode_chunk_kernel,
                                              flash_decode_combine_kernel, split_plan)
from attention.reference.warp_decode import WARP, KERNEL_DEFECTS, batched_decode_kernel, n_chunks

DTYPES = (np.dtype(np.float32),)


class WarpBackend:
    """One warp per (head, sequence) over the whole length."""

    defects = KERNEL_DEFECTS
    dtypes = DTYPES

    @staticmethod
    def plan(state, n_split, split_chunk):
        state.n_split = 1
        state.plan = {"n_split": 1}

    @staticmethod
    def scratch(state):
        return ()

    @staticmethod
    def attend(state, stream):
        batched_decode_kernel(n_chunks(state.head_dim), state._attn_defect)[
            (state.n_heads, state.m), WARP, stream](
            state.q, state.k_cache, state.v_cache, state.seq_lens, state.d_slots,
            np.float32(state.scale), state.out, state.lse)


class SplitBackend:
    """Split-KV warp chunks of ``split_plan``'s size, then the combine."""

    defects = KERNEL_DEFECTS
    dtypes = DTYPES

    @staticmethod
    def plan(state, n_split, split_chunk):
        state.n_split, state.chunk = split_plan(state.max_seq, state.m, state.n_heads,
                                                chunk=split_chunk)
        state.plan = {"n_split": state.n_split, "chunk": state.chunk}

    @staticmethod
    def scratch(state):
        mc, h, d, ns = state.m, state.n_heads, state.head_dim, state.n_split
        return (device_empty((mc, h, ns), np.float32), device_empty((mc, h, ns), np.float32),
                device_empty((mc, h, ns, d), np.float32))

    @staticmethod
    def attend(state, stream):
        chunks = n_chunks(state.head_dim)
        part_max, part_sum, part_acc = state._scratch
        flash_decode_chunk_kernel(chunks, state._attn_defect)[
            (state.n_heads, state.m, state.n_split), WARP, stream](
            state.q, state.k_cache, state.v_cache, state.seq_lens, state.d_slots,
            np.float32(state.scale), np.int32(state.chunk), part_max, part_sum, part_acc)
        flash_decode_combine_kernel(chunks)[(state.n_heads, state.m), WARP, stream](
            part_max, part_sum, part_acc, state.out, state.lse)


register_backend("warp", WarpBackend)
register_backend("split", SplitBackend)
