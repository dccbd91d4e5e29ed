"""The MLA pipeline: absorb_q -> latent rows [c_kv | k_pe] -> attention -> decompress_v.

Two implementations of the attention (``method=``): "gemm" (``mla.attn_gemm``:
absorb, scores, softmax, P.V and decompress as GEMMs, the score and P.V ones on
tensor cores with fp32 operands split in two tf32 halves where they qualify;
the fast one), "gemm_fma" (the same with fp32 FMA GEMMs only: exact products,
about half the error, a third slower at B 64 / L 4096) and "flash"
(``mla.kernels``: absorb_q, the tiled online-softmax attn_absorbed,
decompress_v; no scratch; 11-27x slower). "auto" (the default) picks "gemm"
unless a flash-only option is given (``plan_method``). The GEMM path's scratch
(``attn_gemm.workspace_bytes``: the scores of every query) is kept under
``GEMM_WORKSPACE_LIMIT`` (or ``workspace_limit=``) by running the queries in
chunks over one scratch allocation, with the results of one launch set bit for
bit; "auto" takes the tiled path only when a single query's scratch passes the
budget, and warns (``checks.FallbackWarning``). ``mla_decode(...,
return_plan=True)`` also returns the ``MethodPlan``: path, chunks and why.

* ``mla_attend``       one sequence, the oracles' arguments: the ``t_q`` queries
  are the last of ``t_kv`` positions (prefill, chunked prefill, decode).
* ``mla_attend_cached`` / ``mla_decode_step``  the same over a ``LatentCache``
  plane (rows already appended).
* ``mla_decode``       a batch of B sequences, one query each (q ``[B, nh,
  .]``) or ``s_q`` new queries each (q ``[B, s_q, nh, .]``, 1 <= s_q <= 16:
  multi-token decode, query i attending positions ``0 .. lengths[b] - s_q +
  i``, the latent rows read once a sequence), over a pooled latent cache
  ``[B, max_seq, r + d_rope]`` with per-sequence lengths (the benchmark
  entry point), or over a paged one (``page_table=``, ``mla.paged``: pages
  ``[num_pages, page_size, r + d_rope]``, every method giving the bits of the
  contiguous cache holding the same rows).

All return ``out [t_q|B, nh, d_v]`` (``mla_decode`` with multi-token queries:
``[B, s_q, nh, d_v]``) float32: numpy when ``q_nope`` is numpy,
else a device array. ``stream=None`` synchronises before returning; with a
stream the launches are only enqueued. Everything is validated before any copy
or launch. ``defect`` (falsification suite only) is routed to the kernel that
carries it (see ``mla.kernels``).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from attention.core import checks
from attention.core.device import (
    device_empty,
    finish,
    host_ints,
    is_host_array,
    launch_stream,
    to_device,
    to_host,
)

from . import attn_gemm as G
from . import fp8 as FP
from . import kernels as K
from . import mma as MM
from . import paged as PG

METHODS = ("auto", "gemm", "gemm_fma", "flash", "mma")
GEMM_METHODS = ("gemm", "gemm_fma")
# the GEMM path's scratch budget (scores of every query over its visible rows):
# past it the queries run in chunks (``plan_method``); "auto" takes the tiled
# online-softmax kernel only when one query's scratch alone passes it
GEMM_WORKSPACE_LIMIT = 1 << 30


def _route(defect, paged=False, s_q=1, fp8=False):
    # the GEMM path's kernel switches (``mla.attn_gemm.KERNEL_SWITCHES``) go with
    # the attention: the GEMM path takes them; the flash kernel rejects them.
    # The paged read defect (``mla.paged.READ_DEFECTS``) only where a page table is read,
    # the multi-token one (``mla.kernels.MULTI_DEFECTS``) only with s_q > 1 queries,
    # the fp8 ones (``mla.mma.FP8_DEFECTS``) only over an fp8 cache.
    known = (K.KERNEL_DEFECTS + G.KERNEL_SWITCHES + (PG.READ_DEFECTS if paged else ())
             + (K.MULTI_DEFECTS if s_q > 1 else ()) + MM.DEFECTS + MM.PLAN_DEFECTS
             + (MM.FP8_DEFECTS if fp8 else ()))
    if defect is not None and defect not in known:
        raise ValueError(f"defect: expected one of {known} or None, got {defect!r}")
    return {
        "absorb": defect if defect in K.ABSORB_DEFECTS else None,
        "attn": (defect if defect in K.ATTN_DEFECTS + G.KERNEL_SWITCHES + K.MULTI_DEFECTS
                 else None),
        "mma": defect if defect in MM.DEFECTS + MM.FP8_DEFECTS + MM.PLAN_DEFECTS else None,
        "append": defect if defect in K.APPEND_DEFECTS else None,
        "page": defect if defect in PG.READ_DEFECTS else None,
    }


def _check_q(q_nope, q_pe, w_uk, w_uv, w_uk_layout, n_q_label="t_q"):
    """Validate queries and weights; returns (n_q, nh, d_nope, d_rope, r, d_v)."""
    n_q, nh, d_nope = checks.check_array(
        "q_nope", q_nope, ((n_q_label, None), ("nh", None), ("d_nope", None)),
        dtypes=(np.float32,))
    checks.check_range("q_nope", nh, 1, 1024, what="head count")
    checks.check_range("q_nope", d_nope, 1, 1024, what="d_nope")
    _, _, d_rope = checks.check_array(
        "q_pe", q_pe, ((n_q_label, n_q), ("nh", nh), ("d_rope", None)), dtypes=(np.float32,))
    if d_rope % 2:
        raise checks.RangeError(f"q_pe: expected an even d_rope, got {d_rope}")
    rank = K.check_w_uk(w_uk, nh, d_nope, w_uk_layout)
    _, d_v, _ = checks.check_array(
        "w_uv", w_uv, (("nh", nh), ("d_v", None), ("r", rank)), dtypes=(np.float32,))
    checks.check_range("w_uv", d_v, 1, 1024, what="d_v")
    return n_q, nh, d_nope, d_rope, rank, d_v


class MethodPlan(NamedTuple):
    """What an MLA entry point runs and why (``plan_method``).

    method:        "gemm" | "gemm_fma" | "flash"
    chunk:         queries per GEMM launch set (0 when there are none; the
                   query count for "flash"); multi-token decode (``s_q`` > 1):
                   sequences, each with its s_q queries
    n_chunks:      GEMM launch sets run one after another over one scratch
                   (1: unchunked; 0: no queries)
    scratch_bytes: the GEMM scratch the run allocates (one chunk's; 0 for "flash")
    full_bytes:    the GEMM scratch of all the queries in one launch set
    limit:         the scratch budget the plan was made under
    fallback:      True when "auto" took the tiled path although the GEMM
                   path was possible (a ``checks.FallbackWarning`` was emitted)
    reason:        why, in words
    """

    method: str
    chunk: int
    n_chunks: int
    scratch_bytes: int
    full_bytes: int
    limit: int
    fallback: bool
    reason: str


def _gib(n):
    """A byte count in words: GiB, MiB or bytes."""
    if n >= 2**30:
        return f"{n / 2**30:.3g} GiB"
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{int(n)} B"


def _flash_only(method, tile, heads_per_block, defect):
    flash_only = tile is not None or heads_per_block is not None or (
        defect is not None and defect in K.ATTN_DEFECTS and defect not in G.GEMM_DEFECTS)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if method in GEMM_METHODS + ("mma",) and flash_only:
        raise ValueError(f"method: {method!r} takes no tile, heads_per_block or stuck_rescale "
                         "(options of the tiled online-softmax kernel)")
    mma_defects = MM.DEFECTS + MM.FP8_DEFECTS + MM.PLAN_DEFECTS
    if defect is not None and (defect in mma_defects) != (method == "mma"):
        raise ValueError(f"defect: method='mma' takes the tensor-core kernel's switches "
                         f"{mma_defects} only, and they go with it; got {defect!r} with "
                         f"method={method!r}")
    return flash_only


def _decode_only(method):
    if method == "mma":
        raise ValueError("method: 'mma' (the 16-bit tensor-core attention) is a decode "
                         "path: mla_decode and MLADecodeGraph take it; expected 'auto', "
                         "'gemm', 'gemm_fma' or 'flash' here")


def check_fp8_method(method):
    """An fp8 cache is read by the tensor-core attention only: "auto" / "mma"
    give "mma"; any other method raises, naming it."""
    if method not in ("auto", "mma"):
        raise checks.DTypeError(f"latent_cache: an fp8 (uint8) cache is read by method='mma' "
                                f"(or 'auto') only, got method={method!r}")
    return "mma"


def check_invariant_method(batch_invariant, method):
    """The method of a call with ``batch_invariant``: "mma" (asked for, or
    "auto"); any other method raises naming it. Without it, ``method`` as given."""
    if not batch_invariant:
        return method
    if method in ("auto", "mma"):
        return "mma"
    raise checks.AttentionInputError(
        f"batch_invariant: only method 'mma' (the tensor-core path, split by a fixed "
        f"chunk) is batch-invariant; got method={method!r}")


def check_cache_shape(latent_cache, latent_scale, n_b, rank, d_rope, paged):
    """``mla_decode`` / ``MLADecodeGraph``'s latent cache: a 16-bit / fp32 one, or
    an fp8 one with ``latent_scale`` (``mla.fp8.check_cache``). Returns
    ``(fp8 mode or None, dim0, dim1)``: (B, max_seq) or (num_pages, page_size)."""
    if FP.is_fp8(latent_cache) or latent_scale is not None:
        if not FP.is_fp8(latent_cache):
            raise checks.DTypeError(f"latent_scale: only with an fp8 (uint8) latent_cache, got "
                                    f"a {np.dtype(checks._dtype(latent_cache))} cache")
        mode, dim0, dim1 = FP.check_cache(latent_cache, latent_scale, rank, d_rope, n_b=n_b,
                                          paged=paged)
        why = MM.supported(rank, d_rope)
        if why is not None:
            raise checks.RangeError(f"latent_cache: the fp8 cache's kernel cannot take {why}")
        return mode, dim0, dim1
    if not paged:
        dim0, dim1, _ = checks.check_array(
            "latent_cache", latent_cache,
            (("B", n_b), ("max_seq", None), ("r+d_rope", rank + d_rope)), dtypes=K.CACHE_DTYPES)
        return None, dim0, dim1
    dim0, dim1, _ = PG.check_paged_cache("latent_cache", latent_cache, rank + d_rope)
    return None, dim0, dim1


def check_mma_cache(latent_cache, rank, d_rope):
    """method='mma' wants a 16-bit latent cache and a shape its kernel takes."""
    dt = np.dtype(checks._dtype(latent_cache))
    if dt != np.float16:
        raise checks.DTypeError(f"latent_cache: method='mma' expected a float16 cache (q and "
                                f"P are rounded to the cache's type), got {dt}")
    why = MM.supported(rank, d_rope)
    if why is not None:
        raise checks.RangeError(f"latent_cache: method='mma' cannot take {why}")


def check_limit(limit):
    """``workspace_limit``: None (``GEMM_WORKSPACE_LIMIT``, read at the call) or
    a positive int of bytes. Returns the budget in bytes."""
    if limit is None:
        return int(GEMM_WORKSPACE_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
        raise checks.RangeError(f"workspace_limit: expected a positive int of bytes or None, "
                                f"got {limit!r}")
    return int(limit)


def plan_method(method, n_q, nh, width, max_visible, tile=None, heads_per_block=None,
                defect=None, *, limit=None, split=True, stacklevel=3, row_bytes=0, s_q=1):
    """The path and chunking for ``n_q`` queries of ``nh`` heads over latent rows
    of ``width`` (``r + d_rope``), at most ``max_visible`` visible: a ``MethodPlan``.
    ``row_bytes``: bytes of a latent row the GEMM path gathers into its
    scratch (a paged cache read by ``sgemm``: ``attn_gemm.paged_gathers``), 0
    otherwise; counted in every scratch size below. ``s_q`` > 1 (multi-token
    decode): ``n_q`` counts sequences of ``s_q`` queries each (the scratch of
    one is ``s_q * nh`` rows; ``chunk`` is then in sequences).

    * "flash" (asked for, or "auto" with a flash-only option: ``tile``,
      ``heads_per_block``, the ``stuck_rescale`` defect): the tiled path, no scratch.
    * "gemm" / "gemm_fma" / "auto" otherwise: the GEMM path
      (``mla.attn_gemm``). Its scratch is ``workspace_bytes(n_q, ...)``; when
      that passes ``limit`` (default ``GEMM_WORKSPACE_LIMIT``) and ``split``,
      the queries run in ``n_chunks`` consecutive chunks of at most ``chunk``
      over one scratch of ``workspace_bytes(chunk, ...)`` (the fewest chunks
      that fit, balanced). Each query's work is independent and every chunk
      runs the whole batch's launches, so the results are the unchunked ones
      bit for bit (``attn_gemm.prepare_chunks``). Not a fallback: nothing is
      warned.

    The rule "auto never silently takes a path more than 2x slower than the
    best": the tiled path is 11-27x slower than the GEMM path (notes/bench.md),
    so "auto" leaves the GEMM path only when even one query's scratch passes
    ``limit`` (about 2**28 heads x rows: 2 M rows at 128 heads), and then says
    so with a ``checks.FallbackWarning``. A chunk holds at least about half the
    budget in scores (the fewest chunks, balanced): at the default 1 GiB that
    is >= 2**27 scores, each 2 (W + r) = 2176 flop of score and P.V GEMM at
    DeepSeek's shape, ~0.3 TFLOP or several ms of device time, against the
    host work a chunk adds (an estimate: one index-table copy and five
    launches of ~17-57 us each, NUMBA_NOTES). An explicit "gemm" /
    "gemm_fma" whose single query passes ``limit`` runs one query a chunk over
    budget (asked for).

    ``split=False`` (``choose_method``): one launch set only, so "auto" over
    the budget falls back to "flash" (warned).
    """
    flash_only = _flash_only(method, tile, heads_per_block, defect)
    limit = check_limit(limit)
    n_q = int(n_q)

    s_q = int(s_q)

    def scratch(n):
        return G.workspace_bytes(n, nh * s_q, width, max_visible, row_bytes)

    full = scratch(n_q)
    if method == "mma":
        return MethodPlan("mma", n_q, 1 if n_q else 0, 0, full, limit, False,
                          "method='mma' asked for: the 16-bit tensor-core attention "
                          "(mla.mma), no score scratch")
    if method == "flash" or (method == "auto" and flash_only):
        why = ("method='flash' asked for" if method == "flash" else
               "method='auto' with an option of the tiled kernel (tile, heads_per_block "
               "or stuck_rescale)")
        return MethodPlan("flash", n_q, 1 if n_q else 0, 0, full, limit, False, why)
    how = "gemm" if method == "auto" else method
    queries = f"{n_q} queries" if s_q == 1 else f"{n_q} sequences x {s_q} queries"
    shape = (f"{queries} x {nh} heads x (width {width} + {int(max_visible)} visible "
             f"rows) float32")
    if n_q == 0:
        return MethodPlan(how, 0, 0, 0, 0, limit, False, "no queries")
    if full <= limit:
        return MethodPlan(how, n_q, 1, full, full, limit, False,
                          f"GEMM path in one launch set: scratch {_gib(full)} ({shape}) "
                          f"<= limit {_gib(limit)}")
    per = scratch(1)
    fit = limit // per
    while fit > 1 and scratch(fit) > limit:
        fit -= 1
    if split and fit >= 1:
        n_chunks = -(-n_q // fit)
        chunk = -(-n_q // n_chunks)
        need = scratch(chunk)
        return MethodPlan(how, chunk, n_chunks, need, full, limit, False,
                          f"GEMM path in {n_chunks} chunks of <= {chunk} queries over one "
                          f"scratch of {_gib(need)}: all at once would take {_gib(full)} "
                          f"({shape}) > limit {_gib(limit)}; results identical to one "
                          f"launch set")
    if method != "auto":
        if split:
            return MethodPlan(how, 1, n_q, per, full, limit, False,
                              f"method={method!r} asked for: one query a chunk, its scratch "
                              f"{_gib(per)} over the limit {_gib(limit)}")
        return MethodPlan(how, n_q, 1, full, full, limit, False,
                          f"method={method!r} asked for: scratch {_gib(full)} ({shape}) "
                          f"allocated over the limit {_gib(limit)}")
    if split:
        why = (f"method='auto': running the tiled 'flash' path, 11-27x slower than the GEMM "
               f"path, because one query's GEMM scratch alone would take {_gib(per)} "
               f"({nh} heads x (width {width} + {int(max_visible)} visible rows) float32) > "
               f"GEMM_WORKSPACE_LIMIT = {_gib(limit)}, so no chunking of the queries fits. "
               f"To keep the GEMM path, raise workspace_limit (or GEMM_WORKSPACE_LIMIT) or "
               f"pass method='gemm' to allocate the scratch anyway; method='flash' takes the "
               f"tiled path without this warning.")
    else:
        why = (f"method='auto': running the tiled 'flash' path, 11-27x slower than the GEMM "
               f"path, because the GEMM path's scratch would take {_gib(full)} ({shape}) > "
               f"GEMM_WORKSPACE_LIMIT = {_gib(limit)}. To keep the GEMM path, split the batch "
               f"(or the queries) so that each call stays under the limit (the entry points "
               f"do: plan_method), or pass method='gemm' to allocate the scratch anyway; "
               f"method='flash' takes the tiled path without this warning.")
    warnings.warn(checks.FallbackWarning(why), stacklevel=stacklevel)
    return MethodPlan("flash", n_q, 1, 0, full, limit, True, why)


def choose_method(method, n_q, nh, width, max_visible, tile=None, heads_per_block=None,
                  defect=None):
    """"gemm", "gemm_fma" or "flash" for ``method`` ("auto" or one of those), for
    ONE launch set of ``n_q`` queries that cannot be split (``plan_method`` with
    ``split=False``; the entry points plan with splitting instead).

    "auto": the GEMM path (``mla.attn_gemm``) unless a flash-only option is
    given (``tile``, ``heads_per_block``, the ``stuck_rescale`` defect) or its
    workspace would exceed ``GEMM_WORKSPACE_LIMIT``. The latter switch is a
    fallback to a path 11-27x slower: it emits a ``checks.FallbackWarning``
    naming the scratch size and how to avoid it.
    """
    return plan_method(method, n_q, nh, width, max_visible, tile, heads_per_block, defect,
                       split=False, stacklevel=4).method


def _core(q_nope, q_pe, w_uk, w_uv, d_latent, slots, lens, tails, *, scale, d_rope, tile,
          heads_per_block, w_uk_layout, stream, routes, method="flash", workspace=None,
          chunk=None, d_table=None, d_vis=None, s_q=1, fp8=None, d_scale=None,
          capacity=None):
    """absorb -> attention over d_latent [S, max_seq, W] -> decompress (enqueue only).
    ``chunk``: the GEMM path's queries per launch set (``MethodPlan.chunk``).
    ``d_table`` (device int32 [Q, max_pages]): d_latent is a paged cache
    [num_pages, P, W] read through it (``slots`` unused; decode: ``tails`` 0);
    ``d_vis`` (device int32 [Q], optional): the visible rows the kernels read
    (``paged.page_check_kernel``'s), ``lens`` then only sizes the launches.
    ``s_q`` > 1 (multi-token decode): q_nope / q_pe [B * s_q, nh, .] hold s_q
    queries a sequence; ``slots``, ``lens``, ``tails`` (zeros), ``d_table``,
    ``d_vis`` are per sequence [B] and ``chunk`` counts sequences.
    ``fp8`` / ``d_scale``: an fp8 latent cache's scale mode and scales (method
    "mma" only). ``capacity``: method "mma", batch-invariant splits over that
    many positions (``mla.mma.prepare``).
    Returns (out [Q, nh, d_v], lse [Q, nh]) device float32."""
    n_q, nh, _ = (int(s) for s in q_nope.shape)
    rank = int(d_latent.shape[2]) - d_rope
    d_v = int(w_uv.shape[1])
    if method == "mma":
        p = MM.prepare(to_device(q_nope, stream), to_device(q_pe, stream) if d_rope
                       else K._placeholder(stream), to_device(w_uk, stream),
                       to_device(w_uv, stream), d_latent, slots, lens, scale, d_rope=d_rope,
                       w_uk_layout=w_uk_layout, stream=stream, d_vis=d_vis,
                       page_table=d_table, s_q=s_q, defect=routes["mma"], fp8=fp8,
                       d_scale=d_scale, capacity=capacity)
        MM.launch_prepared(p, launch_stream(stream))
        return p["out"], p["lse"]
    if method in GEMM_METHODS:
        defect = routes["attn"] or routes["absorb"]
        vis = G.visible_rows(lens, tails, defect)
        d_q_pe = to_device(q_pe, stream) if d_rope else K._placeholder(stream)
        out, _, lse = G.enqueue(to_device(q_nope, stream), d_q_pe, to_device(w_uk, stream),
                                to_device(w_uv, stream), d_latent, slots, vis, scale,
                                d_rope=d_rope, w_uk_layout=w_uk_layout, stream=stream,
                                defect=defect, workspace=workspace, tensor=method == "gemm",
                                chunk=chunk, d_vis=d_vis, page_table=d_table,
                                page_defect=routes["page"], s_q=s_q)
        return out, lse
    st = launch_stream(stream)
    d_out = device_empty((n_q, nh, d_v), np.float32, stream)
    d_lse = device_empty((n_q, nh), np.float32, stream)
    if n_q == 0:
        return d_out, d_lse
    d_q_lat = device_empty((n_q, nh, rank), np.float32, stream)
    K.launch_absorb_q(to_device(q_nope, stream), to_device(w_uk, stream), d_q_lat, st,
                      w_uk_layout, routes["absorb"])
    d_o_lat = device_empty((n_q, nh, rank), np.float32, stream)
    d_q_pe = to_device(q_pe, stream) if d_rope else K._placeholder(stream)
    K.launch_attn_absorbed(d_q_lat, d_q_pe, d_latent,
                           to_device(slots, stream) if d_table is None else d_table,
                           to_device(lens, stream) if d_vis is None else d_vis,
                           to_device(tails, stream), scale, d_o_lat, d_lse, st, d_rope=d_rope,
                           tile=tile, heads_per_block=heads_per_block,
                           defect=routes["attn"] or routes["page"],
                           page_size=0 if d_table is None else int(d_latent.shape[1]),
                           s_q=s_q)
    K.launch_decompress_v(d_o_lat, to_device(w_uv, stream), d_out, st)
    return d_out, d_lse


def _return(d_out, host, stream):
    result = to_host(d_out, stream) if host else d_out
    finish(stream)
    return result


def _chunk_tables(t_q, t_kv):
    """One sequence: slot 0, length t_kv, query i has t_q - 1 - i queries after it."""
    return (np.zeros(t_q, np.int32), np.full(t_q, t_kv, np.int32),
            (t_q - 1 - np.arange(t_q)).astype(np.int32))


def mla_attend(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale=None, stream=None, defect=None,
               w_uk_layout="mla", tile=None, heads_per_block=None, method="auto"):
    """MLA of one sequence through the kernels (same arguments as the oracles).

    q_nope: [t_q, nh, d_nope] float32     q_pe: [t_q, nh, d_rope] float32 (rotated)
    c_kv:   [t_kv, r] float32 or float16  k_pe: [t_kv, d_rope], c_kv's dtype (rotated);
            the latent rows are stored in that dtype, accumulation is fp32
    w_uk:   [nh, d_nope, r] float32 (or [nh, r, d_nope] with w_uk_layout="checkpoint")
    w_uv:   [nh, d_v, r] float32
    scale:  default 1/sqrt(d_nope + d_rope)
    tile, heads_per_block: attn_absorbed's block plan (default: ``plan_blocks``)
    Query i attends positions 0..t_kv - t_q + i. Returns out [t_q, nh, d_v] float32.
    """
    routes = _route(defect)
    t_q, nh, d_nope, d_rope, rank, d_v = _check_q(q_nope, q_pe, w_uk, w_uv, w_uk_layout)
    t_kv, _ = checks.check_array("c_kv", c_kv, (("t_kv", None), ("r", rank)),
                                 dtypes=K.CACHE_DTYPES)
    checks.check_array("k_pe", k_pe, (("t_kv", t_kv), ("d_rope", d_rope)),
                       dtypes=(checks._dtype(c_kv),))
    if t_q > t_kv:
        raise checks.RangeError(f"q_nope: expected t_q <= t_kv={t_kv}, got t_q={t_q}")
    scale = checks.check_scale(scale, d_nope + d_rope)
    _decode_only(method)
    plan = plan_method(method, t_q, nh, rank + d_rope, t_kv, tile, heads_per_block, defect)
    tile, hg = K.plan_blocks(nh, rank + d_rope, tile, heads_per_block)
    host = is_host_array(q_nope)
    if t_q == 0:
        return np.zeros((0, nh, d_v), np.float32) if host else device_empty((0, nh, d_v),
                                                                               np.float32)
    # -- the latent rows [c_kv | k_pe], built on the device by the append kernel --
    st = launch_stream(stream)
    row_dtype = checks._dtype(c_kv)
    d_latent = device_empty((1, t_kv, rank + d_rope), row_dtype, stream)
    d_k_pe = to_device(k_pe, stream) if d_rope else to_device(np.zeros((1, 1), row_dtype),
                                                                stream)
    K.launch_append_latent(d_latent, 0, 0, to_device(c_kv, stream), d_k_pe,
                           device_empty(1, np.int32, stream), st, routes["append"])
    d_out = _core(q_nope, q_pe, w_uk, w_uv, d_latent, *_chunk_tables(t_q, t_kv), scale=scale,
                  d_rope=d_rope, tile=tile, heads_per_block=hg, w_uk_layout=w_uk_layout,
                  stream=stream, routes=routes, method=plan.method, chunk=plan.chunk)[0]
    return _return(d_out, host, stream)


def mla_attend_cached(q_nope, q_pe, cache, layer, w_uk, w_uv, *, scale=None, stream=None,
                      defect=None, w_uk_layout="mla", tile=None, heads_per_block=None,
                      method="auto"):
    """MLA of the last ``t_q`` positions of a cache plane (rows already appended).

    q_nope [t_q, nh, d_nope], q_pe [t_q, nh, d_rope]: the queries of positions
    ``length - t_q .. length - 1`` of ``cache`` (a ``LatentCache``) at ``layer``.
    Returns out [t_q, nh, d_v] float32.
    """
    routes = _route(defect)
    t_q, nh, d_nope, d_rope, rank, d_v = _check_q(q_nope, q_pe, w_uk, w_uv, w_uk_layout)
    if rank + d_rope != cache.width:
        raise checks.ShapeError(
            f"cache: expected rows of width r+d_rope={rank + d_rope}, got {cache.width}")
    t_kv = cache.length(layer)
    if t_q > t_kv:
        raise checks.RangeError(
            f"q_nope: expected t_q <= the {t_kv} rows cached in layer {layer}, got {t_q}")
    scale = checks.check_scale(scale, d_nope + d_rope)
    _decode_only(method)
    plan = plan_method(method, t_q, nh, rank + d_rope, t_kv, tile, heads_per_block, defect)
    tile, hg = K.plan_blocks(nh, rank + d_rope, tile, heads_per_block)
    plane = cache.plane(layer)
    d_latent = plane.reshape((1,) + tuple(plane.shape))
    d_out = _core(q_nope, q_pe, w_uk, w_uv, d_latent, *_chunk_tables(t_q, t_kv), scale=scale,
                  d_rope=d_rope, tile=tile, heads_per_block=hg, w_uk_layout=w_uk_layout,
                  stream=stream, routes=routes, method=plan.method, chunk=plan.chunk)[0]
    return _return(d_out, is_host_array(q_nope), stream)


def mla_decode_step(q_nope, q_pe, cache, layer, w_uk, w_uv, *, scale=None, stream=None,
                    defect=None, w_uk_layout="mla", method="auto"):
    """One decode query over a cache plane whose last row is this token's.

    q_nope [1, nh, d_nope] (or [nh, d_nope]), q_pe [1, nh, d_rope] (or [nh, d_rope]).
    Returns out [1, nh, d_v] (or [nh, d_v] for unbatched queries).
    """
    single = len(getattr(q_nope, "shape", ())) == 2
    if single:
        q_nope, q_pe = _unsqueeze(q_nope), _unsqueeze(q_pe)
    if int(q_nope.shape[0]) != 1:
        raise checks.ShapeError(f"q_nope: expected one query [1, nh, d_nope], got {q_nope.shape}")
    out = mla_attend_cached(q_nope, q_pe, cache, layer, w_uk, w_uv, scale=scale, stream=stream,
                            defect=defect, w_uk_layout=w_uk_layout, method=method)
    return out[0] if single else out


def _unsqueeze(x):
    if is_host_array(x):
        return x.reshape((1,) + x.shape)
    if not hasattr(x, "shape"):
        return x
    d = to_device(x)
    return d.reshape((1,) + tuple(d.shape))


MAX_S_Q = 16  # new queries a sequence in one multi-token decode call


def split_queries(q_nope, q_pe):
    """Multi-token queries as rows: ``(s_q, q_nope, q_pe, multi)``.

    q_nope [B, s_q, nh, d_nope] and q_pe [B, s_q, nh, d_rope] (``multi``
    True, 1 <= s_q <= ``MAX_S_Q``) come back as [B * s_q, nh, .] views (a
    numpy array not C-contiguous is copied); rank-3 [B, nh, .] queries come
    back as they are with s_q = 1 (``multi`` False). Other ranks are left to
    the rank-3 checks (their errors name the argument)."""
    if len(getattr(q_nope, "shape", ())) != 4:
        return 1, q_nope, q_pe, False
    n_b, s_q, nh, d_nope = checks.check_array(
        "q_nope", q_nope, (("B", None), ("s_q", None), ("nh", None), ("d_nope", None)),
        dtypes=(np.float32,), contiguous=not is_host_array(q_nope))
    checks.check_range("q_nope", s_q, 1, MAX_S_Q, what="s_q (new queries a sequence)")
    _, _, _, d_rope = checks.check_array(
        "q_pe", q_pe, (("B", n_b), ("s_q", s_q), ("nh", nh), ("d_rope", None)),
        dtypes=(np.float32,), contiguous=not is_host_array(q_pe))

    def rows(x, width):
        if is_host_array(x):
            return np.ascontiguousarray(x).reshape((n_b * s_q, nh, width))
        return to_device(x).reshape((n_b * s_q, nh, width))

    return s_q, rows(q_nope, d_nope), rows(q_pe, d_rope), True


def check_multi_lengths(lens, s_q):
    """Lengths of a multi-token decode: each 0 (nothing attended) or at least
    ``s_q`` (the s_q new queries are the last positions of their sequence)."""
    lens = np.asarray(lens)
    bad = np.flatnonzero((lens > 0) & (lens < s_q))
    if bad.size:
        b = int(bad[0])
        raise checks.RangeError(
            f"lengths: expected 0 or at least s_q={s_q} (the {s_q} new queries are the last "
            f"positions of their sequence), got lengths[{b}]={int(lens[b])}")


def _shaped(x, n_b, s_q, multi):
    """``x`` [B * s_q, nh, ...] as [B, s_q, nh, ...] when ``multi``."""
    if not multi:
        return x
    shape = (n_b, s_q) + tuple(int(d) for d in x.shape[1:])
    return x.reshape(shape)


def mla_decode(q_nope, q_pe, latent_cache, lengths, w_uk, w_uv, *, scale=None, stream=None,
               w_uk_layout="mla", tile=None, heads_per_block=None, method="auto",
               workspace=None, workspace_limit=None, return_plan=False, page_table=None,
               defect=None, return_lse=False, latent_scale=None, batch_invariant=False):
    """Batched MLA decode: sequence b's new queries over its own ``lengths[b]`` latent rows.

    q_nope:       [B, nh, d_nope] float32 (one query a sequence), or [B, s_q,
                  nh, d_nope] (multi-token decode, 1 <= s_q <= 16, the same
                  for every sequence): query i of sequence b is position
                  ``lengths[b] - s_q + i`` and attends positions 0 ..
                  ``lengths[b] - s_q + i`` (causal within the new tokens; the
                  lengths count them, so a length must be 0 or at least s_q:
                  RangeError naming lengths and s_q otherwise)
    q_pe:         [B, nh, d_rope] or [B, s_q, nh, d_rope] float32 (rotated)
    latent_cache: [B, max_seq, r + d_rope] float32 or float16, rows [c_kv | k_pe];
                  with ``page_table``: the paged cache [num_pages, page_size,
                  r + d_rope] (``mla.paged``). Or an fp8 cache (``mla.fp8``):
                  uint8 rows of r e4m3 codes and d_rope float16 values,
                  [B, max_seq, r + 2 d_rope] or paged [num_pages, page_size,
                  r + 2 d_rope], read by method "mma" (what "auto" takes for
                  it) with ``latent_scale``
    latent_scale: an fp8 cache's float32 scales: [1] (per tensor) or [B,
                  max_seq] / [num_pages, page_size] (one a cached row, as
                  ``mla.fp8_append.fp8_append_latent`` writes them); None for
                  a 16-bit or fp32 cache
    lengths:      [B] ints in [0, max_seq] (0 gives zeros); paged: in [0,
                  max_pages * page_size]
    page_table:   None (contiguous cache), or [B, max_pages] int32: position p
                  of sequence b is row p % page_size of page page_table[b, p //
                  page_size]. Pages may be shared and in any order; entries
                  past a sequence's pages are never read. Every method gives
                  the bits of the contiguous cache holding the same rows (the
                  same kernels and sums; only the row addressing differs,
                  compiled in by a page-size switch that leaves the
                  contiguous kernels unchanged; where ``sgemm`` runs the
                  attention GEMMs, "gemm_fma" or "gemm" at few heads, they
                  read a copy of the visible rows gathered first:
                  ``mla.paged``). A numpy table's used entries are checked
                  here (RangeError naming page_table); a device table's on
                  the device: a sequence with an entry outside [0,
                  num_pages) is attended as empty (zeros), and without a
                  ``stream`` the call then raises RangeError naming
                  page_table after its launches (with a stream nothing is
                  raised: check the entries beforehand).
    w_uk:         [nh, d_nope, r] float32 (or the checkpoint layout); w_uv [nh, d_v, r]
    scale:        default 1/sqrt(d_nope + d_rope)
    method:       "auto" | "gemm" | "gemm_fma" | "flash" (``plan_method``): the
                  GEMM path runs the batch in chunks of sequences when its
                  scratch for the whole batch would pass the budget
    workspace:    an ``mla.attn_gemm.Workspace`` reused across calls (and across
                  the chunks of one call) by the GEMM path (default: scratch
                  allocated per call)
    workspace_limit: the GEMM scratch budget in bytes (default
                  ``GEMM_WORKSPACE_LIMIT``, read at the call)
    return_plan:  also return the ``MethodPlan``: the path taken, its chunking
                  and why
    defect:       falsification suite only: a planted defect of the kernels
                  this call runs (``mla.kernels`` absorb / attention defects,
                  ``mla.attn_gemm.KERNEL_SWITCHES``, and with a page table
                  ``mla.paged.READ_DEFECTS``: "page_off_by_one"; with s_q > 1
                  also ``mla.kernels.MULTI_DEFECTS``: "mla_causal_off_by_one"),
                  or None
    return_lse:   also return lse [B, nh] (multi-token: [B, s_q, nh]) float32,
                  the natural-log sum of exp of each query's scaled scores
                  (-inf where nothing is attended)
    batch_invariant: method "mma" ("auto" takes it): the split-KV chunk is
                  fixed by the capacity (``max_seq``, or paged ``max_pages *
                  page_size``) and the GPU, not the batch
                  (``mla.mma.invariant_chunk``), so a sequence's output and
                  LSE are the same bits whatever else the batch holds, for
                  calls of the same capacity; other methods raise
    Returns out [B, nh, d_v] float32, or [B, s_q, nh, d_v] for multi-token
    queries (a rank-4 q_nope; s_q = 1 included); with ``return_lse`` (out,
    lse), with ``return_plan`` the plan after them: (out, plan) or (out,
    lse, plan).

    Host cost: every call checks, plans, allocates its outputs and scratch and
    launches through numba (on the H200's host, B 64 / 128 heads / L 4096,
    method "mma": 2.90 ms a call against 0.56 ms of device time, the
    ``mma_public`` row of reports/bench/mla_mma.csv). A decode loop should
    build an ``mla.decode_graph.MLADecodeGraph`` once and replay it (8 us of
    host time a replay with method "mma", 16 us with the GEMM path:
    reports/bench/host.csv).

    Multi-token decode reads each sequence's latent rows once for all its
    queries: the ``s_q * nh`` (query, head) rows of a sequence are the rows of
    its score and P.V GEMMs (``mla.attn_gemm.prepare``'s ``s_q``) or the warps
    of the tiled kernel's blocks (``mla.kernels.attn_absorbed_kernel``'s
    ``s_q``), each with its own causal end. Query i's output and LSE are
    bit-identical to a one-query decode of position ``lengths[b] - s_q + i``
    over its prefix, for "flash" and "gemm_fma" always and for "gemm" where
    both calls run the score and P.V GEMMs on the same kernel (both or
    neither on tensor cores, which take a call of more than 64 rows:
    ``s_q * nh`` rows here, ``nh`` there); the softmax kernel also has to be
    the same (rows up to 8192 scores are held in registers, longer ones take
    the warp-a-row kernel: ``attn_gemm.resident_vals``).
    """
    s_q, q_nope, q_pe, multi = split_queries(q_nope, q_pe)
    n_rows, nh, d_nope, d_rope, rank, d_v = _check_q(q_nope, q_pe, w_uk, w_uv, w_uk_layout,
                                                     "B")
    n_b = n_rows // s_q
    paged = page_table is not None
    fp8, dim0, dim1 = check_cache_shape(latent_cache, latent_scale, n_b, rank, d_rope, paged)
    if fp8 is not None:
        method = check_fp8_method(method)
    method = check_invariant_method(batch_invariant, method)
    if not paged:
        max_seq = dim1
        lens = checks.check_lengths("lengths", host_ints(lengths), max_seq, count=n_b)
    else:
        n_pages, page_size = dim0, dim1
        lens = checks.check_lengths("lengths", host_ints(lengths), 2 ** 31 - 1, count=n_b)
        max_seq = PG.check_page_table(page_table, n_b, lens, page_size, n_pages) * page_size
    check_multi_lengths(lens, s_q)
    scale = checks.check_scale(scale, d_nope + d_rope)
    if workspace is not None and not isinstance(workspace, G.Workspace):
        raise checks.DTypeError(f"workspace: expected an mla.attn_gemm.Workspace or None, "
                                f"got {type(workspace).__name__}")
    routes = _route(defect, paged, s_q, fp8 is not None)
    if defect is not None and (routes["append"] or defect in K.ROPE_DEFECTS):
        raise ValueError(f"defect: mla_decode runs no append or RoPE kernel, got {defect!r}")
    row_bytes = 0
    if paged and method != "flash" and G.paged_gathers(method != "gemm_fma", nh * s_q,
                                                       latent_cache):
        row_bytes = (rank + d_rope) * np.dtype(checks._dtype(latent_cache)).itemsize
    if method == "mma" and fp8 is None:
        check_mma_cache(latent_cache, rank, d_rope)
    plan = plan_method(method, n_b, nh, rank + d_rope, int(lens.max()) if n_b else 0, tile,
                       heads_per_block, defect, limit=workspace_limit, row_bytes=row_bytes,
                       s_q=s_q)
    tile, hg = K.plan_blocks(nh, rank + d_rope, tile, heads_per_block)
    d_latent = to_device(latent_cache, stream)
    d_table = d_vis = d_flag = None
    if paged:
        d_table = to_device(page_table, stream)
        if not is_host_array(page_table) and n_b:  # entries checked on the device
            d_vis = device_empty((n_b,), np.int32, stream)
            d_flag = to_device(np.zeros(1, np.int32), stream)
            PG.launch_page_check(to_device(lens, stream), d_table, page_size, n_pages, d_vis,
                                 d_flag, launch_stream(stream), s_q=s_q)
    d_out, d_lse = _core(q_nope, q_pe, w_uk, w_uv, d_latent,
                         np.arange(n_b, dtype=np.int32), lens, np.zeros(n_b, np.int32),
                         scale=scale, d_rope=d_rope, tile=tile, heads_per_block=hg,
                         w_uk_layout=w_uk_layout, stream=stream, routes=routes,
                         method=plan.method, workspace=workspace, chunk=plan.chunk,
                         d_table=d_table, d_vis=d_vis, s_q=s_q, fp8=fp8,
                         d_scale=None if fp8 is None else to_device(latent_scale, stream),
                         capacity=max_seq if batch_invariant else None)
    host = is_host_array(q_nope)
    d_out = _shaped(d_out, n_b, s_q, multi)
    if return_lse:
        lse = _shaped(to_host(d_lse, stream) if host else d_lse, n_b, s_q, multi)
    out = _return(d_out, host, stream)
    if d_flag is not None and stream is None:
        err = PG.page_error(int(to_host(d_flag)[0]), s_q=s_q)
        if err is not None:
            raise err
    result = (out, lse) if return_lse else (out,)
    result += (plan,) if return_plan else ()
    return result if len(result) > 1 else result[0]
