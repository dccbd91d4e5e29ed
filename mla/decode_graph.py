"""Batched MLA decode prepared once and replayed as a CUDA graph.

``mla.pipeline.mla_decode`` validates, builds its index tables and launches
its kernels from Python on every call: at B 64, 128 heads, L 4096 that host
work takes about 1.2 ms before the first GEMM reaches the GPU
(notes/bench.md, run 7). ``MLADecodeGraph`` does all of it once, for the
cache's full capacity, and captures the launches of the GEMM path
(``mla.attn_gemm``) as a CUDA graph through cuda.core, as
``attention.decode.step.DecodeState`` does for decode attention. ``run()``
replays it: one driver call, whatever the lengths.

Buffers (device arrays, used in place: fill them between runs):
    q_nope        [B, nh, d_nope]        float32, or [B, s_q, nh, d_nope]
                  (multi-token decode, 1 <= s_q <= 16: ``mla_decode``'s rule)
    q_pe          [B, nh, d_rope]        float32 (rotated), or [B, s_q, nh, d_rope]
    latent_cache  [B, max_seq, r + d_rope] float32 or float16, rows [c_kv | k_pe]
    lengths       [B] int32: rows 0..lengths[b]-1 of sequence b are attended
                  (multi-token: query i attends rows 0..lengths[b] - s_q + i)
    out           [B, nh, d_v] float32, lse [B, nh] float32 (written by a run;
                  multi-token [B, s_q, nh, d_v] and [B, s_q, nh])
w_uk [nh, d_nope, r] (or the checkpoint layout) and w_uv [nh, d_v, r] float32
are read in place too.

``lengths`` is read on the device at each run. A first kernel copies it into
the launches' own table after checking ``0 <= lengths[b] <= max_seq`` (and,
with s_q > 1 new queries a sequence, that a length is 0 or at least s_q); an
entry out of range attends nothing (its output row is zeros, its LSE -inf)
and raises a flag that ``check()`` (and ``run(sync=True)``) turns into a
``RangeError`` naming ``lengths``: nothing is clamped, and no kernel reads past
the cache. The score GEMM is planned for ``max_seq`` columns; its blocks past
a sequence's length exit at once.

The scratch is planned for ``max_seq`` rows per sequence too; when that passes
the budget (``workspace_limit``, default ``mla.pipeline.GEMM_WORKSPACE_LIMIT``)
the batch runs in chunks of sequences over one scratch, as ``mla_decode``
does (``mla.pipeline.plan_method``; bit for bit the unchunked results), and
the graph holds every chunk's launches. ``plan`` records the chunking.

Paged cache (``page_table=``, ``mla.paged``): ``latent_cache`` is
``[num_pages, page_size, r + d_rope]`` and ``page_table`` ``[B, max_pages]``
int32, read in place at every run like ``lengths`` (``max_seq`` is then the
capacity ``max_pages * page_size``). The first kernel
(``paged.page_check_kernel``) also checks the entries of the pages each
sequence uses: one outside ``[0, num_pages)`` attends that sequence as empty
and makes ``check()`` raise a ``RangeError`` naming ``page_table``. The runs
give the bits of ``mla_decode`` over the same paged cache (and of the
contiguous cache holding the same rows).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from attention.core import checks
from attention.core.device import (
    device_empty,
    host_ints,
    is_host_array,
    jit,
    to_device,
    to_host,
)
from attention.core.graph import CapturedLaunches

from . import attn_gemm as G
from . import kernels as K
from . import mma as MM
from . import paged as PG
from .pipeline import (
    _check_q,
    check_cache_shape,
    check_fp8_method,
    check_invariant_method,
    check_mma_cache,
    check_multi_lengths,
    plan_method,
    split_queries,
)


@functools.lru_cache(maxsize=None)
def lengths_check_kernel(s_q=1):
    """``vis[b] = lengths[b]`` when ``0 <= lengths[b] <= max_seq``, else
    ``vis[b] = 0`` and ``flag[0] = 1``. Grid ceil(B / 128), block 128.

    lengths [B] int32, vis [B] int32 (out), max_seq int32, flag [1] int32.
    ``s_q`` > 1 (multi-token decode, compile-time; 1 builds the kernel above
    unchanged): a length in ``1 .. s_q - 1`` is out of range too.
    """
    S_Q = int(s_q)

    def kernel(lengths, vis, max_seq, flag):
        b = cuda.grid(1)
        if b < lengths.shape[0]:
            n = lengths[b]
            if n < 0 or n > max_seq:
                vis[b] = 0
                flag[0] = 1
            else:
                vis[b] = n

    def kernel_multi(lengths, vis, max_seq, flag):
        b = cuda.grid(1)
        if b < lengths.shape[0]:
            n = lengths[b]
            if n < 0 or n > max_seq or (n > 0 and n < S_Q):
                vis[b] = 0
                flag[0] = 1
            else:
                vis[b] = n

    if S_Q > 1:
        kernel = kernel_multi
        kernel.__name__ = kernel.__qualname__ = f"mla_lengths_check_sq{S_Q}"
    else:
        kernel.__name__ = kernel.__qualname__ = "mla_lengths_check"
    return jit(kernel)


class MLADecodeGraph:
    """Batched absorbed MLA decode over a pooled latent cache, captured once.

    q_nope [B, nh, d_nope] float32, q_pe [B, nh, d_rope] float32 (multi-token:
    [B, s_q, nh, .], 1 <= s_q <= 16; ``q_nope`` / ``q_pe`` are then those
    device buffers and ``d_q_nope`` / ``d_q_pe`` their [B * s_q, nh, .] views),
    latent_cache [B, max_seq, r + d_rope] float32 / float16, lengths [B] ints
    (a device int32 array is read in place at every run; numpy is copied once),
    page_table None, or [B, max_pages] int32 (then latent_cache is the paged
    cache [num_pages, page_size, r + d_rope]; a device table is read in place
    at every run, numpy is copied once to ``self.page_table``; a numpy table's
    used entries are checked here for the lengths given),
    w_uk [nh, d_nope, r] (``w_uk_layout="checkpoint"``: [nh, r, d_nope]),
    w_uv [nh, d_v, r] float32; scale default 1/sqrt(d_nope + d_rope).
    Attributes ``out`` [B, nh, d_v] and ``lse`` [B, nh] (device float32;
    multi-token [B, s_q, nh, d_v] and [B, s_q, nh]), ``s_q``.
    ``tensor=False``: fp32 FMA GEMMs only (``mla.attn_gemm.prepare``).
    ``method``: None (the GEMM path, as ``tensor`` says), "gemm", "gemm_fma"
    or "mma" (the attention on 16-bit tensor cores, ``mla.mma``: an fp16
    cache; absorb, one attention launch (two with its split combine) and
    decompress are captured). An fp8 cache (``mla.fp8``: uint8 rows of ``r +
    2 d_rope`` bytes, contiguous or paged) with ``latent_scale`` (float32 [1]
    per tensor, or one a cached row: read in place at every run, so appends
    between runs are seen) runs "mma" (``method`` None or "mma").
    ``batch_invariant``: method "mma" (None takes it), split by the capacity's
    fixed chunk (``mla.mma.invariant_chunk``): a sequence's output and LSE do
    not depend on the rest of the batch (``mla_decode``'s option).
    ``graph=False`` never builds a graph (``run`` then launches plainly);
    ``graph_error`` says why a graph could not be built. ``path`` ("graph" /
    "plain") and ``fallback_reason`` (None, or why a graph was asked for and
    not built) record what ``run()`` launches; a failed capture on a GPU emits
    a ``checks.FallbackWarning`` (``attention.core.graph``). ``workspace_limit``:
    the GEMM scratch budget in bytes (default ``GEMM_WORKSPACE_LIMIT``); ``plan``
    (a ``mla.pipeline.MethodPlan``) records the chunks of sequences the batch
    runs in and why.
    """

    def __init__(self, q_nope, q_pe, latent_cache, lengths, w_uk, w_uv, *, scale=None,
                 w_uk_layout="mla", graph=True, tensor=True, workspace_limit=None,
                 page_table=None, method=None, latent_scale=None, batch_invariant=False):
        q4 = (q_nope, q_pe)  # the buffers as given (multi-token: [B, s_q, nh, .])
        s_q, q_nope, q_pe, multi = split_queries(q_nope, q_pe)
        n_rows, nh, d_nope, d_rope, rank, d_v = _check_q(q_nope, q_pe, w_uk, w_uv,
                                                         w_uk_layout, "B")
        n_b = n_rows // s_q
        self.s_q, self.multi = s_q, multi
        if n_b == 0:
            raise checks.ShapeError("q_nope: expected at least one sequence [B>=1, nh, d_nope]")
        self.paged = page_table is not None
        fp8, dim0, dim1 = check_cache_shape(latent_cache, latent_scale, n_b, rank, d_rope,
                                            self.paged)
        if fp8 is not None:
            method = check_fp8_method("mma" if method is None else method)
        if batch_invariant:
            method = check_invariant_method(True, "mma" if method is None else method)
        self.fp8 = fp8
        self.batch_invariant = bool(batch_invariant)
        if not self.paged:
            max_seq = dim1
            lens = checks.check_lengths("lengths", host_ints(lengths), max_seq, count=n_b)
        else:
            n_pages, page_size = dim0, dim1
            lens = checks.check_lengths("lengths", host_ints(lengths), 2 ** 31 - 1,
                                        count=n_b)
            max_pages = PG.check_page_table(page_table, n_b, lens, page_size, n_pages)
            max_seq = max_pages * page_size  # the capacity
            self.page_geometry = (n_pages, page_size, max_pages)
        check_multi_lengths(lens, s_q)
        host_lengths = is_host_array(lengths) or isinstance(lengths, (list, tuple))
        if not host_lengths:
            checks.check_array("lengths", lengths, (("B", n_b),), dtypes=(np.int32,))
        self.scale = checks.check_scale(scale, d_nope + d_rope)
        if method is None:
            method = "gemm" if tensor else "gemm_fma"
        if method not in ("gemm", "gemm_fma", "mma"):
            raise ValueError(f"method: expected None, 'gemm', 'gemm_fma' or 'mma', got "
                             f"{method!r}")
        if method == "mma" and fp8 is None:
            check_mma_cache(latent_cache, rank, d_rope)
        tensor = method == "gemm"
        self.method = method
        row_bytes = 0
        if self.paged and G.paged_gathers(tensor, nh * s_q, latent_cache):
            row_bytes = (rank + d_rope) * np.dtype(checks._dtype(latent_cache)).itemsize
        # every query may see max_seq rows: the scratch is planned for that
        self.plan = plan_method(method, n_b, nh, rank + d_rope, max_seq,
                                limit=workspace_limit, row_bytes=row_bytes, s_q=s_q)
        self.shape = (n_b, nh, d_nope, d_rope, rank, d_v, max_seq)
        if multi:  # the [B, s_q, nh, .] buffers on the device; the launches read row views
            self.q_nope, self.q_pe = to_device(q4[0]), to_device(q4[1])
            self.d_q_nope = self.q_nope.reshape(tuple(int(x) for x in q_nope.shape))
            self.d_q_pe = self.q_pe.reshape(tuple(int(x) for x in q_pe.shape))
        else:
            self.d_q_nope, self.d_q_pe = to_device(q_nope), to_device(q_pe)
            self.q_nope, self.q_pe = self.d_q_nope, self.d_q_pe
        # q_nope / q_pe: the query buffers as given ([B, s_q, nh, .] or [B, nh, .]);
        # d_q_nope / d_q_pe: the same memory as rows [B * s_q, nh, .]
        self.d_latent = to_device(latent_cache)
        self.latent_scale = None if fp8 is None else to_device(latent_scale)
        self.d_w_uk, self.d_w_uv = to_device(w_uk), to_device(w_uv)
        self.lengths = to_device(lens) if host_lengths else to_device(lengths)
        self.page_table = to_device(page_table) if self.paged else None
        self._vis = device_empty((n_b,), np.int32)
        self._flag = to_device(np.zeros(1, np.int32))
        self.workspace = G.Workspace()
        self._mma = None
        if method == "mma":  # planned for the full capacity, as below
            self._mma = MM.prepare(
                self.d_q_nope, self.d_q_pe if d_rope else K._placeholder(None), self.d_w_uk,
                self.d_w_uv, self.d_latent, np.arange(n_b, dtype=np.int32),
                np.full(n_b, max_seq, np.int32), self.scale, d_rope=d_rope,
                w_uk_layout=w_uk_layout, stream=None, d_vis=self._vis,
                page_table=self.page_table, s_q=s_q, fp8=fp8, d_scale=self.latent_scale,
                capacity=max_seq if batch_invariant else None)
            self._ps, self.out, self.lse = None, self._mma["out"], self._mma["lse"]
        else:  # planned for the full capacity: every query may see max_seq rows
            self._ps, self.out, _, self.lse = self._prepare_gemm(
                n_b, d_rope, max_seq, w_uk_layout, tensor, s_q)
        if multi:  # [B, s_q, nh, .] views of the rows
            self.out = self.out.reshape((n_b, s_q, nh, d_v))
            self.lse = self.lse.reshape((n_b, s_q, nh))
        self._graph = CapturedLaunches(self.enqueue, lambda: self.enqueue(0), enabled=graph,
                                       owner="MLADecodeGraph",
                                       plain_call="run_plain()'s launches at every run()")
        self.graph, self.graph_error = self._graph.graph, self._graph.error
        self.path, self.fallback_reason = self._graph.path, self._graph.fallback_reason

    def _prepare_gemm(self, n_b, d_rope, max_seq, w_uk_layout, tensor, s_q):
        return G.prepare_chunks(
            self.d_q_nope, self.d_q_pe if d_rope else K._placeholder(None), self.d_w_uk,
            self.d_w_uv, self.d_latent, np.arange(n_b, dtype=np.int32),
            np.full(n_b, max_seq, np.int32), self.scale, d_rope=d_rope,
            w_uk_layout=w_uk_layout, stream=None, chunk=self.plan.chunk,
            workspace=self.workspace, d_vis=self._vis, tensor=tensor,
            page_table=self.page_table, s_q=s_q)

    def enqueue(self, stream):
        """The launches of one run on ``stream`` (numba stream, 0, or a graph builder)."""
        n_b, max_seq = self.shape[0], self.shape[6]
        if self.paged:
            n_pages, page_size, _ = self.page_geometry
            PG.launch_page_check(self.lengths, self.page_table, page_size, n_pages, self._vis,
                                 self._flag, stream, s_q=self.s_q)
        else:
            kernel = lengths_check_kernel(self.s_q) if self.s_q > 1 else lengths_check_kernel()
            kernel[(n_b + 127) // 128, 128, stream](
                self.lengths, self._vis, np.int32(max_seq), self._flag)
        if self._mma is not None:
            MM.launch_prepared(self._mma, stream)
        else:
            G.launch_chunks(self._ps, stream)

    @property
    def stream_handle(self):
        """The graph's stream as an int handle (None without a graph), e.g. for
        ``numba.cuda.external_stream`` to record timing events on it."""
        return self._graph.stream_handle

    def run(self, sync=False):
        """One decode (graph replay when built). ``sync`` waits and then
        ``check()``s the lengths."""
        if self.graph is None:
            self.run_plain(sync=sync)
            return
        self._graph.launch(sync)
        if sync:
            self.check()

    def run_plain(self, stream=0, sync=False):
        """The same launches through numba's ordinary launch path (no graph)."""
        self.enqueue(stream)
        if sync:
            cuda.synchronize()
            self.check()

    def check(self):
        """Raise ``RangeError`` if a run since the last check saw a length
        outside [0, max_seq] (paged: or an entry of a used page outside [0,
        num_pages), naming ``page_table``); that sequence attended nothing.
        Clears the flag. Reads one int from the device after the work queued
        so far."""
        self.synchronize()
        word = int(to_host(self._flag)[0])
        if word:
            self._flag.copy_to_device(np.zeros(1, np.int32))
            if self.paged:
                raise PG.page_error(word, host_ints(self.lengths).tolist(), self.shape[6],
                                    s_q=self.s_q)
            if self.s_q > 1:
                raise checks.RangeError(
                    f"lengths: expected lengths 0 or in [s_q={self.s_q}, max_seq="
                    f"{self.shape[6]}] at a run (the s_q new queries are the last positions "
                    f"of their sequence); got {host_ints(self.lengths).tolist()}; that "
                    f"sequence attended nothing")
            raise checks.RangeError(
                f"lengths: expected lengths in [0, max_seq={self.shape[6]}] at a run; "
                f"got {host_ints(self.lengths).tolist()}")

    def synchronize(self):
        self._graph.synchronize()
