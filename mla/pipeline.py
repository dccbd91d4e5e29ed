"""The MLA pipeline: absorb_q -> latent rows [c_kv | k_pe] -> attention -> decompress_v.

Two implementations of the attention (``method=``): "gemm" (``mla.attn_gemm``:
absorb, scores, softmax, P.V and decompress as GEMMs, the score and P.V ones on
tensor cores with fp32 operands split in two tf32 halves where they qualify;
the fast one), "gemm_fma" (the same with fp32 FMA GEMMs only: exact products,
about half the error, a third slower at B 64 / L 4096) and "flash"
(``mla.kernels``: absorb_q, the tiled online-softmax attn_absorbed,
decompress_v; no scratch). "auto" (the default) picks "gemm" unless its scratch
would pass ``GEMM_WORKSPACE_LIMIT`` or a flash-only option is given
(``choose_method``).

* ``mla_attend``       one sequence, the oracles' arguments: the ``t_q`` queries
  are the last of ``t_kv`` positions (prefill, chunked prefill, decode).
* ``mla_attend_cached`` / ``mla_decode_step``  the same over a ``LatentCache``
  plane (rows already appended).
* ``mla_decode``       a batch of B sequences, one query each, over a pooled
  latent cache ``[B, max_seq, r + d_rope]`` with per-sequence lengths (the
  benchmark entry point).

All return ``out [t_q|B, nh, d_v]`` float32: numpy when ``q_nope`` is numpy,
else a device array. ``stream=None`` synchronises before returning; with a
stream the launches are only enqueued. Everything is validated before any copy
or launch. ``defect`` (falsification suite only) is routed to the kernel that
carries it (see ``mla.kernels``).
"""

from __future__ import annotations

import warnings

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
from . import kernels as K

METHODS = ("auto", "gemm", "gemm_fma", "flash")
GEMM_METHODS = ("gemm", "gemm_fma")
# "auto" takes the GEMM path while its scratch (scores of every query over its
# visible rows) stays under this many bytes, else the tiled online-softmax kernel
GEMM_WORKSPACE_LIMIT = 1 << 30


def _route(defect):
    # the GEMM path's kernel switches (``mla.attn_gemm.KERNEL_SWITCHES``) go with
    # the attention: the GEMM path takes them; the flash kernel rejects them
    known = K.KERNEL_DEFECTS + G.KERNEL_SWITCHES
    if defect is not None and defect not in known:
        raise ValueError(f"defect: expected one of {known} or None, got {defect!r}")
    return {
        "absorb": defect if defect in K.ABSORB_DEFECTS else None,
        "attn": defect if defect in K.ATTN_DEFECTS + G.KERNEL_SWITCHES else None,
        "append": defect if defect in K.APPEND_DEFECTS else None,
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


def choose_method(method, n_q, nh, width, max_visible, tile=None, heads_per_block=None,
                  defect=None):
    """"gemm", "gemm_fma" or "flash" for ``method`` ("auto" or one of those).

    "auto": the GEMM path (``mla.attn_gemm``) unless a flash-only option is
    given (``tile``, ``heads_per_block``, the ``stuck_rescale`` defect) or its
    workspace would exceed ``GEMM_WORKSPACE_LIMIT``. The latter switch is a
    fallback to a path 11-27x slower: it emits a ``checks.FallbackWarning``
    naming the scratch size and how to avoid it.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    flash_only = tile is not None or heads_per_block is not None or (
        defect is not None and defect in K.ATTN_DEFECTS and defect not in G.GEMM_DEFECTS)
    if method in GEMM_METHODS and flash_only:
        raise ValueError(f"method: {method!r} takes no tile, heads_per_block or stuck_rescale "
                         "(options of the tiled online-softmax kernel)")
    if method != "auto":
        return method
    if flash_only:
        return "flash"
    need = G.workspace_bytes(n_q, nh, width, max_visible)
    if need > GEMM_WORKSPACE_LIMIT:
        warnings.warn(checks.FallbackWarning(
            f"method='auto': running the tiled 'flash' path, 11-27x slower than the GEMM "
            f"path, because the GEMM path's scratch would take {need / 2**30:.2f} GiB "
            f"({n_q} queries x {nh} heads x (width {width} + {int(max_visible)} visible rows) "
            f"float32) > GEMM_WORKSPACE_LIMIT = {GEMM_WORKSPACE_LIMIT / 2**30:g} GiB. To keep "
            f"the GEMM path, split the batch (or the queries) so that each call stays under "
            f"the limit, or pass method='gemm' to allocate the scratch anyway; "
            f"method='flash' takes the tiled path without this warning."), stacklevel=3)
        return "flash"
    return "gemm"


def _core(q_nope, q_pe, w_uk, w_uv, d_latent, slots, lens, tails, *, scale, d_rope, tile,
          heads_per_block, w_uk_layout, stream, routes, method="flash", workspace=None):
    """absorb -> attention over d_latent [S, max_seq, W] -> decompress (enqueue only)."""
    n_q, nh, _ = (int(s) for s in q_nope.shape)
    rank = int(d_latent.shape[2]) - d_rope
    d_v = int(w_uv.shape[1])
    if method in GEMM_METHODS:
        defect = routes["attn"] or routes["absorb"]
        vis = G.visible_rows(lens, tails, defect)
        d_q_pe = to_device(q_pe, stream) if d_rope else K._placeholder(stream)
        return G.enqueue(to_device(q_nope, stream), d_q_pe, to_device(w_uk, stream),
                         to_device(w_uv, stream), d_latent, slots, vis, scale, d_rope=d_rope,
                         w_uk_layout=w_uk_layout, stream=stream, defect=defect,
                         workspace=workspace, tensor=method == "gemm")[0]
    st = launch_stream(stream)
    d_out = device_empty((n_q, nh, d_v), np.float32, stream)
    if n_q == 0:
        return d_out
    d_q_lat = device_empty((n_q, nh, rank), np.float32, stream)
    K.launch_absorb_q(to_device(q_nope, stream), to_device(w_uk, stream), d_q_lat, st,
                      w_uk_layout, routes["absorb"])
    d_o_lat = device_empty((n_q, nh, rank), np.float32, stream)
    d_lse = device_empty((n_q, nh), np.float32, stream)
    d_q_pe = to_device(q_pe, stream) if d_rope else K._placeholder(stream)
    K.launch_attn_absorbed(d_q_lat, d_q_pe, d_latent, to_device(slots, stream),
                           to_device(lens, stream), to_device(tails, stream), scale,
                           d_o_lat, d_lse, st, d_rope=d_rope, tile=tile,
                           heads_per_block=heads_per_block, defect=routes["attn"])
    K.launch_decompress_v(d_o_lat, to_device(w_uv, stream), d_out, st)
    return d_out


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
    how = choose_method(method, t_q, nh, rank + d_rope, t_kv, tile, heads_per_block, defect)
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
                  stream=stream, routes=routes, method=how)
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
    how = choose_method(method, t_q, nh, rank + d_rope, t_kv, tile, heads_per_block, defect)
    tile, hg = K.plan_blocks(nh, rank + d_rope, tile, heads_per_block)
    plane = cache.plane(layer)
    d_latent = plane.reshape((1,) + tuple(plane.shape))
    d_out = _core(q_nope, q_pe, w_uk, w_uv, d_latent, *_chunk_tables(t_q, t_kv), scale=scale,
                  d_rope=d_rope, tile=tile, heads_per_block=hg, w_uk_layout=w_uk_layout,
                  stream=stream, routes=routes, method=how)
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


def mla_decode(q_nope, q_pe, latent_cache, lengths, w_uk, w_uv, *, scale=None, stream=None,
               w_uk_layout="mla", tile=None, heads_per_block=None, method="auto",
               workspace=None):
    """Batched MLA decode: sequence b's one query over its own ``lengths[b]`` latent rows.

    q_nope:       [B, nh, d_nope] float32
    q_pe:         [B, nh, d_rope] float32 (rotated)
    latent_cache: [B, max_seq, r + d_rope] float32 or float16, rows [c_kv | k_pe]
    lengths:      [B] ints in [0, max_seq] (0 gives zeros)
    w_uk:         [nh, d_nope, r] float32 (or the checkpoint layout); w_uv [nh, d_v, r]
    scale:        default 1/sqrt(d_nope + d_rope)
    method:       "auto" | "gemm" | "gemm_fma" | "flash" (``choose_method``)
    workspace:    an ``mla.attn_gemm.Workspace`` reused across calls by the GEMM
                  path (default: scratch allocated per call)
    Returns out [B, nh, d_v] float32.
    """
    n_b, nh, d_nope, d_rope, rank, d_v = _check_q(q_nope, q_pe, w_uk, w_uv, w_uk_layout, "B")
    _, max_seq, _ = checks.check_array(
        "latent_cache", latent_cache,
        (("B", n_b), ("max_seq", None), ("r+d_rope", rank + d_rope)), dtypes=K.CACHE_DTYPES)
    lens = checks.check_lengths("lengths", host_ints(lengths), max_seq, count=n_b)
    scale = checks.check_scale(scale, d_nope + d_rope)
    if workspace is not None and not isinstance(workspace, G.Workspace):
        raise checks.DTypeError(f"workspace: expected an mla.attn_gemm.Workspace or None, "
                                f"got {type(workspace).__name__}")
    how = choose_method(method, n_b, nh, rank + d_rope, int(lens.max()) if n_b else 0, tile,
                        heads_per_block)
    tile, hg = K.plan_blocks(nh, rank + d_rope, tile, heads_per_block)
    d_out = _core(q_nope, q_pe, w_uk, w_uv, to_device(latent_cache, stream),
                  np.arange(n_b, dtype=np.int32), lens, np.zeros(n_b, np.int32), scale=scale,
                  d_rope=d_rope, tile=tile, heads_per_block=hg, w_uk_layout=w_uk_layout,
                  stream=stream, routes=_route(None), method=how, workspace=workspace)
    return _return(d_out, is_host_array(q_nope), stream)
