"""What the sweep runs: kernels x shape cases x score fixtures x seeds x dtypes.

A kernel entry (``KernelSpec``) names the module and function it drives and
how to call it; its ``kind`` ("decode", "prefill" or "mla") says which inputs
(``validation.fixtures``), which float64 oracle and which float32 baseline
judge it. Modules are imported only when a case runs (``resolve``): a kernel
whose module does not exist yet is reported "not available"; a module that
exists but fails to import (or lacks the function) is "broken" and fails the
run.

Shape cases come in two sizes: ``small`` (the CUDA simulator, where every
thread is a Python thread) and full (a GPU). Both include the awkward sizes
that tail handling gets wrong: head_dim 40/80/96/111 (not multiples of 32),
GQA 9 query heads over 3 kv heads, T 97 and 1025 (one past a power of two),
and zero-length sequences (output zeros, LSE -inf). ``quick`` marks the subset
``--quick`` runs.

Dtypes: the storage dtype of the cached tensors (K/V caches, prefill K/V, MLA
latent rows) is cast first; if the kernel rejects that with
``checks.DTypeError``, every floating input is cast; a second rejection makes
the case "unsupported" (not a failure). The oracle and the baseline always see
exactly the values the kernel was given (upcast).

A kernel may also report a case it cannot take as "unsupported" with the
reason, by raising ``unsupported_case()`` (a ``DTypeError``) from its run
wrapper before anything is launched: the 16-bit tensor-core kernels
(``attention.decode.mma``, ``attention.prefill.mma``) do so for float32
cases, head dims they have no tile for and GQA groups that do not fit one
16-row mma tile; the MLA one (``mla.mma``, entry ``mla_mma``) for caches
other than float16, latent widths it has no tiles for and more than 16
queries. Such a case is never counted as a pass nor as a failure.
"""

from __future__ import annotations

import functools
import importlib
import traceback
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from validation import fixtures

SIM_DTYPES = ("float32", "float16")  # the simulator has no bfloat16
GPU_DTYPES = ("float32", "float16", "bfloat16")


# ---------------------------------------------------------------------------
# shape cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str
    dims: dict = field(compare=False, hash=False)
    quick: bool = False
    fixtures: tuple = fixtures.SCORE_FIXTURES
    # kernel families that run this shape; empty: every kernel of the kind
    families: tuple = ()


def _decode(name, quick=False, fixtures_=fixtures.SCORE_FIXTURES, families=(), **dims):
    return Shape(name, "decode", dims, quick, fixtures_, families)


def _prefill(name, quick=False, fixtures_=fixtures.SCORE_FIXTURES, families=(), **dims):
    return Shape(name, "prefill", dims, quick, fixtures_, families)


NORMAL_ONLY = ("normal",)

DECODE_SMALL = (
    # GQA 9:3 at head_dim 40 with an empty sequence in the middle of the batch
    _decode("gqa9x3_d40", True, m=3, h=9, h_kv=3, d=40, lens=(6, 0, 3), max_seq=8, kv_slots=5),
    _decode("zero_len", True, NORMAL_ONLY, m=3, h=2, h_kv=1, d=32, lens=(0, 0, 0), max_seq=4,
            kv_slots=4),
    _decode("d80", m=2, h=4, h_kv=2, d=80, lens=(5, 2), max_seq=6, kv_slots=3),
    _decode("d96", m=2, h=2, h_kv=2, d=96, lens=(4, 7), max_seq=9, kv_slots=4),
    _decode("d111_t97", m=2, h=2, h_kv=1, d=111, lens=(97, 1), max_seq=100, kv_slots=3),
)

DECODE_FULL = (
    _decode("gqa9x3_d40", True, m=5, h=9, h_kv=3, d=40, lens=(97, 0, 1025, 1, 300),
            max_seq=1100, kv_slots=8),
    # the production shape that exposed the stuck rescale (Qwen2.5-Coder-1.5B, 2048 context)
    _decode("qwen_gqa6_d128", True, m=3, h=12, h_kv=2, d=128, lens=(17, 11, 5), max_seq=2048,
            kv_slots=8),
    _decode("zero_len", True, NORMAL_ONLY, m=4, h=8, h_kv=2, d=64, lens=(0, 0, 0, 0),
            max_seq=16, kv_slots=6),
    _decode("d80", m=3, h=8, h_kv=2, d=80, lens=(1025, 97, 5), max_seq=1030, kv_slots=6),
    _decode("d96", m=4, h=12, h_kv=4, d=96, lens=(64, 1025, 0, 97), max_seq=1025, kv_slots=5),
    _decode("d111", m=2, h=9, h_kv=3, d=111, lens=(97, 1025), max_seq=1030, kv_slots=4),
    _decode("d256", m=2, h=4, h_kv=1, d=256, lens=(1025, 33), max_seq=1100, kv_slots=3),
    _decode("long_d128", m=4, h=32, h_kv=8, d=128, lens=(4096, 1025, 97, 0), max_seq=4096,
            kv_slots=6),
    _decode("m64_gqa7", False, NORMAL_ONLY, m=64, h=14, h_kv=2, d=64,
            lens=tuple((37 * i) % 513 for i in range(64)), max_seq=520, kv_slots=70),
)

PREFILL_SMALL = (
    _prefill("gqa3x1_d40_t5_causal", True, t=5, h=3, h_kv=1, d=40, causal=True),
    _prefill("t0", True, NORMAL_ONLY, t=0, h=2, h_kv=1, d=32, causal=True),
    _prefill("d111_t9", t=9, h=2, h_kv=2, d=111, causal=False),
    _prefill("d80_t17_causal", t=17, h=2, h_kv=1, d=80, causal=True),
)

# Shapes of one kernel family (``Shape.families``), beside the shared tables above:
# the simulator's quick shapes of the tensor-core kernels ("mma"). The decode takes
# head dims 32/64/128 only, so of the shared quick shapes only zero_len (nothing to
# attend); the prefill none but T 0 (D 40 it does not take). Not in ``shapes``
# (what every kernel of a kind runs, and the fp8 quantization table); in
# ``all_shapes``, which ``cases`` and ``find_shape`` read.
FAMILY_SMALL = (
    # GQA 4 (T_q 4 fills the 16-row tile), lengths across 16-position tiles; also
    # the fp8 family's (the tensor-core fp8 decode has no shared shape but zero_len)
    _decode("mma_gqa4_d64", True, fixtures.SCORE_FIXTURES, ("mma", "decode_fp8"), m=3, h=8,
            h_kv=2, d=64, lens=(19, 0, 33), max_seq=40, kv_slots=5),
    # GQA 2:1, T past one 16-row tile, causal
    _prefill("mma_gqa2_d64_t20_causal", True, fixtures.SCORE_FIXTURES, ("mma",), t=20, h=2,
             h_kv=1, d=64, causal=True),
)
FAMILY_FULL = ()

# MLA shapes of one family (built on first use, as ``mla_shapes``): (label, family,
# MlaDims fields, t_q, t_kv, quick). The MLA tensor-core kernel takes latent widths
# r + d_rope that are multiples of 64 (r a multiple of 64) and a float16 cache: of
# the shared small MLA shapes only s2nope (W 64, not quick), and DeepSeek's W 576 is
# slow on the simulator. Two 64-column blocks, 2 queries, one 64-position tile.
MLA_FAMILY_SMALL = (
    ("mma_nh2_r64_rope64", ("mma", "mla_fp8"),
     dict(n_head=2, d_nope=16, d_rope=64, d_v=16, kv_rank=64), 2, 40, True),
)
# DeepSeek's latent at 16 heads (128 after 8-way tensor parallelism): one row group of
# query rows, the memory-bound regime
MLA_FAMILY_FULL = (
    ("mma_dsv3_nh16", ("mma", "mla_fp8"),
     dict(n_head=16, d_nope=128, d_rope=64, d_v=128, kv_rank=512), 1, 1025, True),
    # 64 heads: four row groups a block (RG 4), the plan that puts a 16-bit cache's S
    # and P.V on wgmma on a compute-capability-9.0 GPU (``mla.mma.wgmma_level``)
    ("mma_dsv3_nh64", ("mma", "mla_fp8"),
     dict(n_head=64, d_nope=128, d_rope=64, d_v=128, kv_rank=512), 1, 1025, True),
)


def mla_family_shapes(small):
    """The MLA shapes of ``MLA_FAMILY_SMALL`` / ``MLA_FAMILY_FULL`` (run by the
    kernels of the family each names only)."""
    from mla.dims import MlaDims

    out = []
    for label, family, dims, t_q, t_kv, quick in (MLA_FAMILY_SMALL if small
                                                  else MLA_FAMILY_FULL):
        out.append(Shape(f"{label}_q{t_q}_kv{t_kv}", "mla",
                         {"dims": MlaDims(**dims), "t_q": t_q, "t_kv": t_kv}, quick,
                         fixtures.SCORE_FIXTURES,
                         family if isinstance(family, tuple) else (family,)))
    return tuple(out)

PREFILL_FULL = (
    _prefill("t1_gqa9x3_d80", True, t=1, h=9, h_kv=3, d=80, causal=True),
    _prefill("t97_gqa9x3_d40_causal", True, t=97, h=9, h_kv=3, d=40, causal=True),
    _prefill("t0", True, NORMAL_ONLY, t=0, h=4, h_kv=2, d=64, causal=True),
    _prefill("t97_d96", t=97, h=4, h_kv=4, d=96, causal=False),
    _prefill("t1025_gqa9x3_d111_causal", t=1025, h=9, h_kv=3, d=111, causal=True),
    _prefill("t1025_gqa4_d128_causal", t=1025, h=8, h_kv=2, d=128, causal=True),
    _prefill("t1025_d64", False, NORMAL_ONLY, t=1025, h=4, h_kv=4, d=64,
             causal=False),
)

# MLA: (dims index into the table, t_q, t_kv); decode is t_q = 1, chunked prefill t_q < t_kv
MLA_SMALL = (("s0", 0, 1, 9, True), ("s1", 1, 3, 9, True), ("s2nope", 2, 4, 4, False),
             ("s1", 1, 1, 1, False))
MLA_FULL = (("dsv3", 0, 1, 1025, True), ("dsv3", 0, 3, 9, True), ("dsv3", 0, 17, 17, False),
            ("nope64x256", 1, 1, 97, True), ("nope64x256", 1, 4, 4, False),
            ("s1", 2, 17, 17, False))


def _mla_dims_table(small):
    from mla import dims as mla_dims

    return tuple(mla_dims.SMALL_SHAPES) if small else tuple(mla_dims.PRESETS) + (
        mla_dims.SMALL_SHAPES[1],)


def mla_shapes(small):
    table = _mla_dims_table(small)
    out = []
    for label, idx, t_q, t_kv, quick in (MLA_SMALL if small else MLA_FULL):
        dims = table[idx]
        out.append(Shape(f"{label}_q{t_q}_kv{t_kv}", "mla",
                         {"dims": dims, "t_q": t_q, "t_kv": t_kv}, quick))
    return tuple(out)


def shapes(kind, small):
    """The shape cases of a kind at simulator (``small``) or GPU size."""
    if kind == "decode":
        return DECODE_SMALL if small else DECODE_FULL
    if kind == "prefill":
        return PREFILL_SMALL if small else PREFILL_FULL
    if kind == "mla":
        return mla_shapes(small)
    raise ValueError(f"unknown kind {kind!r}")


def all_shapes(kind, small):
    """``shapes`` and the kind's family shapes (``FAMILY_SMALL`` / ``FAMILY_FULL``,
    and for MLA ``mla_family_shapes``: run only by the kernels of the families
    each names)."""
    own = FAMILY_SMALL if small else FAMILY_FULL
    if kind == "mla":
        own = tuple(own) + mla_family_shapes(small)
    return tuple(shapes(kind, small)) + tuple(s for s in own if s.kind == kind)


def find_shape(kind, name, small):
    for s in all_shapes(kind, small):
        if s.name == name:
            return s
    raise KeyError(f"no {kind} shape named {name!r}")


# ---------------------------------------------------------------------------
# inputs, oracles, baselines
# ---------------------------------------------------------------------------


def make_inputs(kind, shape, fixture, seed):
    """The case's float32 inputs; depend only on (kind, shape, fixture, seed)."""
    rng = fixtures.case_rng(seed, kind, shape.name, fixture)
    d = shape.dims
    if kind == "decode":
        return fixtures.decode_inputs(rng, scores=fixture, **d)
    if kind == "prefill":
        return fixtures.prefill_inputs(rng, scores=fixture, **d)
    if kind == "mla":
        return fixtures.mla_inputs(rng, d["dims"], t_q=d["t_q"], t_kv=d["t_kv"], scores=fixture)
    raise ValueError(kind)


def references(kind, inputs, dtype):
    """(oracle, baseline): dicts of output name -> array; float64 oracle, float32
    baseline (the same oracle code in float32), on exactly ``inputs``."""
    if kind == "decode":
        from attention.oracle import decode_attention_ref

        args = (inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["seq_lens"],
                inputs["slot_table"])
        o64, l64 = decode_attention_ref(*args, dtype=np.float64)
        o32, l32 = decode_attention_ref(*args, dtype=np.float32)
        return {"out": o64, "lse": l64}, {"out": o32, "lse": l32}
    if kind == "prefill":
        from attention.oracle import prefill_attention_ref

        args = (inputs["q"], inputs["k"], inputs["v"], inputs["n_heads"])
        kw = {"n_kv_heads": inputs["n_kv_heads"], "causal": inputs["causal"]}
        o64, l64 = prefill_attention_ref(*args, dtype=np.float64, **kw)
        o32, l32 = prefill_attention_ref(*args, dtype=np.float32, **kw)
        return {"out": o64, "lse": l64}, {"out": o32, "lse": l32}
    if kind == "mla":
        from mla.oracle import mla_attend_absorbed, mla_attend_float32

        args = tuple(inputs[n] for n in MLA_ARGS)
        return {"out": mla_attend_absorbed(*args)}, {"out": mla_attend_float32(*args)}
    raise ValueError(kind)


MLA_ARGS = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


def _run_batched(fn, x, **kw):
    out, lse = fn(x["q"], x["k_cache"], x["v_cache"], x["seq_lens"], x["slot_table"],
                  return_lse=True, **kw)
    return {"out": out, "lse": lse}


def _run_single(fn, x):
    """decode_attention of one sequence, called for each sequence of the batch."""
    outs, lses = [], []
    for m in range(x["q"].shape[0]):
        slot = int(x["slot_table"][m])
        out, lse = fn(x["q"][m], x["k_cache"][slot], x["v_cache"][slot], int(x["seq_lens"][m]),
                      return_lse=True)
        outs.append(np.asarray(out))
        lses.append(np.asarray(lse))
    return {"out": np.stack(outs), "lse": np.stack(lses)}


def _run_flash(num_splits):
    def run(fn, x):
        out, lse = fn(x["q"], x["k_cache"], x["v_cache"], x["seq_lens"], x["slot_table"],
                      num_splits=num_splits, return_lse=True)
        return {"out": out, "lse": lse}

    return run


def _run_prefill(method):
    """Run wrapper of a prefill path: ``fn`` is ``prefill_attention`` (method
    "fused") or ``prefill_attention_reference`` ("batched", "per_head"); both
    take the same arguments and ``method=``."""
    def run(fn, x):
        out, lse = fn(x["q"], x["k"], x["v"], x["n_heads"], n_kv_heads=x["n_kv_heads"],
                      causal=x["causal"], method=method, return_lse=True)
        return {"out": out, "lse": lse}

    return run


def _run_mla(method):
    def run(fn, x, **kw):
        return {"out": fn(*(x[n] for n in MLA_ARGS), method=method, **kw)}

    return run


def _run_paged(page, layout):
    """Run wrapper of the paged fast decode: the case's pooled rows laid out in
    pages of ``page`` positions (``fixtures.paged_from_pooled``: shuffled
    pages, NaN tails and spare pages, huge unused table entries), then a
    ``DecodePlan(page_size=page, layout=layout)`` run. ``fn`` is ``DecodePlan``."""
    def run(fn, x):
        from attention.core.device import to_device, to_host

        q, k = x["q"], x["k_cache"]
        m, h, d = q.shape
        rng = np.random.default_rng([page, len(layout), m, int(np.sum(x["seq_lens"]))])
        kp, vp, table = fixtures.paged_from_pooled(k, x["v_cache"], x["seq_lens"],
                                                   x["slot_table"], page, layout, rng)
        plan = fn(m, h, k.shape[1], d, kp.shape[0], k.shape[2], cache_dtype=k.dtype,
                  q_dtype=q.dtype, page_size=page, layout=layout)
        d_lse = to_device(np.zeros((m, h), np.float32))
        out = plan.run(to_device(q), to_device(kp), to_device(vp),
                       to_device(np.asarray(x["seq_lens"], np.int32)),
                       page_table=to_device(table), lse=d_lse, sync=True)
        return {"out": np.asarray(to_host(out)), "lse": np.asarray(to_host(d_lse))}

    return run


def _run_multi(t_q, page, layout):
    """Run wrapper of the multi-token fast decode over a paged cache: the case
    as a ``t_q``-query decode (``fixtures.multi_token_case``: sequence m's
    judged query sees exactly the case's positions, the judged query index
    varying over the batch), laid out in pages as ``_run_paged`` does, then a
    ``DecodePlan(t_q=t_q, page_size=page, layout=layout)`` run; the judged
    queries' out and LSE are returned. ``fn`` is ``DecodePlan``."""
    def run(fn, x):
        from attention.core.device import to_device, to_host

        q, k = x["q"], x["k_cache"]
        m, h, d = q.shape
        q_multi, lens, pick = fixtures.multi_token_case(q, x["seq_lens"], k.shape[2], t_q)
        rng = np.random.default_rng([page, t_q, m, int(np.sum(lens))])
        kp, vp, table = fixtures.paged_from_pooled(k, x["v_cache"], lens, x["slot_table"],
                                                   page, layout, rng)
        plan = fn(m, h, k.shape[1], d, kp.shape[0], k.shape[2], cache_dtype=k.dtype,
                  q_dtype=q.dtype, page_size=page, layout=layout, t_q=t_q, method="fast")
        out = plan.run(to_device(q_multi), to_device(kp), to_device(vp), to_device(lens),
                       page_table=to_device(table), sync=True)
        rows = np.arange(m)
        return {"out": np.asarray(to_host(out))[rows, pick],
                "lse": np.asarray(to_host(plan.lse))[rows, pick]}

    return run


def _run_fp8(scales, page=None, layout="HND"):
    """Run wrapper of the fp8 fast decode: the case quantized by
    ``fixtures.fp8_quantize`` (``x["k_codes"]`` ... ; ``scales`` is its mode),
    pooled or laid out in pages of ``page`` (codes and per-row scales in the
    same pages), then a ``DecodePlan(cache_dtype="float8_e4m3fn",
    fp8_scales=scales, method="fast")`` run with q in the case dtype (the
    CUDA-core kernel: "auto" takes the tensor-core one for q float16). ``fn`` is
    ``DecodePlan``. A GPU without fp8 (before sm_89) makes the plan raise
    ``DTypeError``, and so does a query that overflows the case dtype (the
    'large' fixture in float16): the case is reported unsupported, with the
    reason."""
    def run(fn, x, defect=None):
        from attention.core.device import to_device, to_host

        from attention.core.checks import DTypeError

        q, kc, vc = x["q"], x["k_codes"], x["v_codes"]
        ks, vs = x["k_scale"], x["v_scale"]
        m, h, d = q.shape
        if not np.isfinite(q).all():  # q in the case dtype: 'large' scores overflow float16
            raise DTypeError(f"q: the case's query does not fit in {q.dtype} (inf after the "
                             "cast); the fp8 kernels take q in the case dtype")
        lens = np.asarray(x["seq_lens"], np.int32)
        slots = np.asarray(x["slot_table"], np.int32)
        kw = {"slot_table": to_device(slots)}
        n_slots = kc.shape[0]
        if page is not None:
            seed = [page, len(layout), m, int(np.sum(lens))]
            kc, vc, table = fixtures.paged_from_pooled(kc, vc, lens, slots, page, layout,
                                                       np.random.default_rng(seed))
            if scales == "token_head":
                ks, _ = fixtures.paged_scales(ks, lens, slots, page, layout,
                                              np.random.default_rng(seed))
                vs, _ = fixtures.paged_scales(vs, lens, slots, page, layout,
                                              np.random.default_rng(seed))
            kw = {"page_table": to_device(table)}
            n_slots = kc.shape[0]
        plan = fn(m, h, kc.shape[2 if layout == "NHD" and page else 1], d, n_slots,
                  x["k_codes"].shape[2], cache_dtype="float8_e4m3fn", q_dtype=q.dtype,
                  fp8_scales=scales, page_size=page, layout=layout, method="fast",
                  defect=defect)
        d_lse = to_device(np.zeros((m, h), np.float32))
        out = plan.run(to_device(q), to_device(kc), to_device(vc), to_device(lens), lse=d_lse,
                       k_scale=to_device(ks), v_scale=to_device(vs), sync=True, **kw)
        return {"out": np.asarray(to_host(out)), "lse": np.asarray(to_host(d_lse))}

    return run


def _run_mma_fp8(fn, x, **kw):
    """Run wrapper of the tensor-core decode over an fp8 cache
    (``attention.decode.mma.mma_decode``, ``fn``): the case quantized by
    ``fixtures.fp8_quantize`` (per-tensor scales [1], or per (token, kv head)
    [KV_SLOTS, H_kv, max_seq], which ``mma_decode`` takes as its token_head
    mode), pooled, the slot table as the case gives it, q in float16. A q in
    another dtype, a q that overflows float16 (the 'large' fixture), a head dim
    without a tile and a GQA group over 16 rows raise ``unsupported_case()``."""
    from attention.decode import mma as module

    unsupported = unsupported_case()
    q, kc, vc = x["q"], x["k_codes"], x["v_codes"]
    if np.dtype(q.dtype) != np.float16:
        raise unsupported(f"q {np.dtype(q.dtype)}: the fp8 tensor-core decode takes q in "
                          f"float16")
    if not np.isfinite(q).all():
        raise unsupported("q: the case's query does not fit in float16 (inf after the cast)")
    m, h, d = q.shape
    if d not in module.HEAD_DIMS:
        raise unsupported(f"head dim {d}: {module.__name__} has tiles for head dims "
                          f"{module.HEAD_DIMS} only")
    if h // kc.shape[1] > module.TILE_ROWS:
        raise unsupported(f"GQA group {h // kc.shape[1]}: {module.__name__} takes at most "
                          f"{module.TILE_ROWS} query rows a kv head")
    out, lse = fn(q, kc, vc, np.asarray(x["seq_lens"], np.int32),
                  slot_table=np.asarray(x["slot_table"], np.int32), k_scale=x["k_scale"],
                  v_scale=x["v_scale"], **kw)
    return {"out": np.asarray(out), "lse": np.asarray(lse)}


@functools.lru_cache(maxsize=None)
def unsupported_case():
    """The exception class a run wrapper raises for a case its kernel cannot take:
    a ``checks.DTypeError``, which the sweep reports as "unsupported" with the
    message as the reason (built on first use, so that importing the registry
    imports no kernel code)."""
    from attention.core.checks import DTypeError

    class UnsupportedCase(DTypeError):
        """A case outside what the kernel takes (dtype, head dim, rows a tile)."""

    return UnsupportedCase


def _mma_inputs(module, q, cache, head_dim, rows):
    """Reject, before any launch, a case the 16-bit tensor-core kernels cannot take.

    q [M, H, D] (decode) or [T, H*D] (prefill) and ``cache`` (K: [KV_SLOTS,
    H_kv, max_seq, D] or [T, H_kv*D]) as the case gives them; ``head_dim``: D;
    ``rows``: query rows a kv head puts in one mma tile (decode: group x T_q;
    prefill: None, each warp takes 16 rows of one head).
    ``module``: ``attention.decode.mma`` or ``attention.prefill.mma`` (their
    ``HEAD_DIMS``). Raises ``unsupported_case()`` for a float32 case, a head dim
    with no tile, more rows than a tile or a q that overflowed the 16-bit
    type (the 'large' fixture's q in float16); ``checks.DTypeError`` when only
    the caches are 16-bit (the sweep then casts q too: these kernels take q in
    the cache's dtype)."""
    from attention.core.checks import DTypeError

    unsupported = unsupported_case()
    if str(np.dtype(cache.dtype)) not in ("float16", "bfloat16"):
        raise unsupported(f"{np.dtype(cache.dtype)}: the tensor-core kernels take 16-bit "
                          f"q, K and V only (float16, bfloat16)")
    if np.dtype(q.dtype) != np.dtype(cache.dtype):
        raise DTypeError(f"q: the tensor-core kernels take q in the dtype of K and V, "
                         f"{np.dtype(cache.dtype)}, got {np.dtype(q.dtype)}")
    if head_dim not in module.HEAD_DIMS:
        raise unsupported(f"head dim {head_dim}: {module.__name__} has tiles for head dims "
                          f"{module.HEAD_DIMS} only")
    if rows is not None and rows > module.TILE_ROWS:
        raise unsupported(f"GQA group x T_q = {rows} query rows a kv head: "
                          f"{module.__name__} takes at most {module.TILE_ROWS} (one mma tile)")
    if not np.isfinite(q).all():
        raise unsupported(f"q: the case's query does not fit in {np.dtype(q.dtype)} (inf "
                          "after the cast); the tensor-core kernels take q in that dtype")


def _own_tokens(k, v, lens, raised, slots):
    """Copies of the pooled caches k, v [KV_SLOTS, H_kv, max_seq, D] with finite
    rows (standard normal, in the caches' dtype) at positions ``lens[m]`` ..
    ``raised[m] - 1`` of sequence m (slot ``slots[m]``): the later queries' own
    tokens of ``fixtures.multi_token_case``, which it leaves NaN.

    The tensor-core decode computes a sequence's T queries as rows of one mma
    tile, so P.V multiplies the judged query's zero weights with the V rows the
    later queries see: 0 x NaN would make the judged output NaN. Positions below
    a length are real tokens in any decode, finite; the judged query never sees
    these rows, so its oracle is the case's."""
    k, v = k.copy(), v.copy()
    rng = np.random.default_rng([len(lens), int(np.sum(raised))])
    for m, (n, n_raised) in enumerate(zip(lens, raised)):
        if n_raised > n:
            rows = (k.shape[1], int(n_raised - n), k.shape[3])
            k[slots[m], :, n:n_raised] = rng.standard_normal(rows).astype(k.dtype)
            v[slots[m], :, n:n_raised] = rng.standard_normal(rows).astype(v.dtype)
    return k, v


def _run_mma_decode(page=None, layout="HND", t_q=1):
    """Run wrapper of the tensor-core decode (``attention.decode.mma.mma_decode``,
    ``fn``): q in the cache's 16-bit dtype; the pooled case as it is
    (``page`` None, slot table shuffled), or laid out in pages of ``page``
    (``fixtures.paged_from_pooled``, as ``_run_paged``); ``t_q`` > 1: the case
    as a ``t_q``-query decode (``fixtures.multi_token_case``, as
    ``_run_multi``, the later queries' own rows made finite: ``_own_tokens``),
    each sequence judged at one query. Returns {"out" [M, H,
    D], "lse" [M, H]}. Cases the kernel cannot take raise ``unsupported_case()``
    (``_mma_inputs``)."""
    def run(fn, x, **kw):
        from attention.decode import mma as module

        q, k, v = x["q"], x["k_cache"], x["v_cache"]
        m, h, _ = q.shape
        _mma_inputs(module, q, k, int(q.shape[-1]), (h // k.shape[1]) * t_q)
        lens = np.asarray(x["seq_lens"], np.int32)
        slots = np.asarray(x["slot_table"], np.int32)
        pick = None
        if t_q > 1:
            q, raised, pick = fixtures.multi_token_case(q, lens, k.shape[2], t_q)
            k, v = _own_tokens(k, v, lens, raised, slots)
            lens = raised
        if page is None:
            out, lse = fn(q, k, v, lens, slot_table=slots, **kw)
        else:
            rng = np.random.default_rng([page, t_q, len(layout), m, int(np.sum(lens))])
            kp, vp, table = fixtures.paged_from_pooled(k, v, lens, slots, page, layout, rng)
            out, lse = fn(q, kp, vp, lens, page_table=table, layout=layout, **kw)
        out, lse = np.asarray(out), np.asarray(lse)
        if pick is not None:  # [M, T, H, D] -> the judged query of each sequence
            rows = np.arange(m)
            out, lse = out[rows, pick], lse[rows, pick]
        return {"out": out, "lse": lse}

    return run


def _run_mma_prefill(fn, x, **kw):
    """Run wrapper of the tensor-core prefill (``attention.prefill.mma.
    prefill_attention_mma``, ``fn``): q, k, v [T, H*D] / [T, H_kv*D] in one
    16-bit dtype. Cases it cannot take raise ``unsupported_case()``."""
    from attention.prefill import mma as module

    n_heads = int(x["n_heads"])
    _mma_inputs(module, x["q"], x["k"], int(x["q"].shape[1]) // n_heads, None)
    out, lse = fn(x["q"], x["k"], x["v"], n_heads, x["n_kv_heads"], causal=x["causal"], **kw)
    return {"out": np.asarray(out), "lse": np.asarray(lse)}


def _run_tf32_prefill(fn, x, **kw):
    """Run wrapper of the float32 tensor-core prefill (``attention.prefill.tf32.
    prefill_attention_tf32``, ``fn``): q, k, v [T, H*D] / [T, H_kv*D] float32.
    A head dim that is not a multiple of 8 (up to 256) raises
    ``unsupported_case()`` (the kernel's tiles); 16-bit inputs raise the kernel's
    ``checks.DTypeError`` (the sweep reports them unsupported)."""
    from attention.prefill import tf32 as module

    n_heads = int(x["n_heads"])
    head_dim = int(x["q"].shape[1]) // n_heads if n_heads else 0
    if n_heads and not module.supported_head_dim(head_dim):
        raise unsupported_case()(f"head dim {head_dim}: {module.__name__} has tiles for "
                                 f"multiples of 8 up to {module.MAX_HEAD_DIM} only")
    out, lse = fn(x["q"], x["k"], x["v"], n_heads, x["n_kv_heads"], causal=x["causal"], **kw)
    return {"out": np.asarray(out), "lse": np.asarray(lse)}


def _mla_mma_case(x, rank, what):
    """The checks ``mla.mma`` puts on a registry MLA case (``rank``: its r;
    ``what``: the cache's name in the messages), before any launch: a latent
    width it has tiles for, t_q in 1 .. 16 and a query [q_lat | q_pe] that fits
    float16 (the kernel rounds it to fp16); else ``unsupported_case()``.
    Returns t_q."""
    from mla import mma as module
    from mla.pipeline import MAX_S_Q

    unsupported = unsupported_case()
    t_q = int(x["q_nope"].shape[0])
    why = module.supported(int(rank), int(x["k_pe"].shape[1]))
    if why is not None:
        raise unsupported(f"latent width: mla.mma cannot take {why} ({what})")
    if not 1 <= t_q <= MAX_S_Q:
        raise unsupported(f"t_q = {t_q}: mla_decode takes 1 to {MAX_S_Q} new queries a "
                          f"sequence (s_q)")
    q_lat = np.einsum("thp,hpl->thl", x["q_nope"], x["w_uk"])  # [t_q, nh, r] float32
    with np.errstate(over="ignore"):
        rows = np.concatenate([q_lat, x["q_pe"]], axis=-1).astype(np.float16)
    if not np.isfinite(rows).all():
        raise unsupported("q: the case's [q_lat | q_pe] does not fit in float16 (inf after "
                          "the rounding mla.mma applies)")
    return t_q


def _run_mla_mma(fn, x, **kw):
    """Run wrapper of the MLA tensor-core decode (``mla.pipeline.mla_decode``,
    ``fn``, with ``method="mma"``): the case's t_q queries over its t_kv latent
    rows are one sequence of a multi-token decode, q_nope / q_pe [1, t_q, nh,
    .] (float32), the cache [c_kv | k_pe] as [1, t_kv, r + d_rope] float16,
    lengths [t_kv] (query i sees positions 0 .. t_kv - t_q + i, the registry's
    causal rule). Returns {"out" [t_q, nh, d_v]}. ``kw`` goes to ``mla_decode``
    (``defect=``). Cases the kernel cannot take raise ``unsupported_case()``
    before any launch: a cache other than float16, and ``_mla_mma_case``'s."""
    c_kv, k_pe = x["c_kv"], x["k_pe"]
    if np.dtype(c_kv.dtype) != np.float16:
        raise unsupported_case()(f"{np.dtype(c_kv.dtype)}: mla_decode(method='mma') takes a "
                                 f"float16 latent cache only")
    t_kv, rank = c_kv.shape
    _mla_mma_case(x, rank, "a float16 cache")
    cache = np.concatenate([c_kv, k_pe], axis=1)[None]  # [1, t_kv, r + d_rope]
    out = fn(x["q_nope"][None], x["q_pe"][None], cache, np.array([t_kv], np.int32),
             x["w_uk"], x["w_uv"], method="mma", **kw)
    return {"out": np.asarray(out)[0]}


def _paged_mla(run, page):
    """Run wrapper of the paged MLA tensor-core decode: ``run`` (``_run_mla_mma``
    or ``_run_mla_fp8``) with its sequence's latent rows laid out in shuffled
    pages of ``page`` rows (``fixtures.mla_build_pages``: NaN in every unused row
    and in two spare pages, 0xFF bytes for an fp8 cache, which are NaN codes and
    a NaN k_pe; ``MLA_HUGE_ENTRY`` in the table entry past the sequence's pages)
    and ``mla_decode(page_table=...)``, which compiles the page size into the
    kernel. Per-token fp8 scales go into the same pages (NaN where no row
    lives)."""
    from mla.paged import pages_needed

    def paged_run(fn, x, **kw):
        def paged_fn(q_nope, q_pe, cache, lengths, w_uk, w_uv, latent_scale=None, **kw2):
            rows = np.asarray(cache)  # [1, t_kv, W]
            n = int(rows.shape[1])
            max_pages = pages_needed(n, page) + 1
            seed = [page, n, int(rows.shape[2])]
            fill = 0xFF if rows.dtype == np.uint8 else np.nan
            # (mla_build_pages draws again until the pages are not in order)
            pages, table, _ = fixtures.mla_build_pages(
                rows, [n], page, max_pages, np.random.default_rng(seed), share_first=False,
                fill=fill)
            scale = latent_scale
            if scale is not None and np.asarray(scale).shape != (1,):  # per token [1, t_kv]
                sp, st, _ = fixtures.mla_build_pages(
                    np.asarray(scale, np.float32)[..., None], [n], page, max_pages,
                    np.random.default_rng(seed), share_first=False)
                assert np.array_equal(st, table)  # the same pages
                scale = np.ascontiguousarray(sp[..., 0])  # [num_pages, page]
            if scale is not None:
                kw2["latent_scale"] = scale
            return fn(q_nope, q_pe, pages, lengths, w_uk, w_uv, page_table=table, **kw2)

        return run(paged_fn, x, **kw)

    return paged_run


def _run_mla_fp8(fn, x, **kw):
    """Run wrapper of the MLA decode over an fp8 latent cache (``mla.fp8``;
    ``mla_decode`` with ``latent_scale``, the tensor-core attention): the case
    quantized by ``fixtures.mla_fp8_quantize`` (the entry's ``quantize`` mode),
    each row ``[codes of c_kv | k_pe as float16 bytes]``, one sequence of t_q
    queries as ``_run_mla_mma``. The case dtype is k_pe's: float16 only (the
    format's RoPE part), other dtypes are reported unsupported, and so are
    ``_mla_mma_case``'s cases."""
    from mla import fp8 as F

    k_pe = x["k_pe"]
    if np.dtype(k_pe.dtype) != np.float16:
        raise unsupported_case()(f"{np.dtype(k_pe.dtype)}: the fp8 latent row holds k_pe as "
                                 f"float16 (mla.fp8)")
    codes = np.asarray(x["latent_codes"], np.uint8)
    t_kv, rank = codes.shape
    _mla_mma_case(x, rank, "an fp8 cache")
    cache = np.concatenate([codes, np.ascontiguousarray(k_pe).view(np.uint8)], axis=1)
    assert cache.shape[1] == F.row_bytes(rank, k_pe.shape[1])
    scale = np.asarray(x["latent_scale"], np.float32)
    if scale.shape != (1,):
        scale = scale[None]  # [1, t_kv]: one scale a cached row
    out = fn(x["q_nope"][None], x["q_pe"][None], cache[None], np.array([t_kv], np.int32),
             x["w_uk"], x["w_uv"], latent_scale=scale, **kw)
    return {"out": np.asarray(out)[0]}


@dataclass(frozen=True)
class KernelSpec:
    name: str
    family: str  # report grouping; the planted-defect suite of the same FAMILY joins it
    kind: str  # decode | prefill | mla: inputs, oracle and baseline
    module: str
    attr: str
    run: Callable = field(compare=False)
    storage: tuple = ()  # inputs cast to the case dtype first
    note: str = ""
    # the same-precision baseline's order (``validation.baselines``): how the
    # kernel sums its q.k products and where it applies the scale
    baseline: str = "matmul/after"
    # fp8 caches: the case's K/V quantized first (``fixtures.fp8_quantize`` with
    # this scale mode); the oracle and the baseline then take the dequantized cache
    quantize: str = ""


# the warp kernels: lane j holds d = j + 32 c, an FMA sum a lane, then a shuffle
# tree over the warp; q pre-scaled; out = acc * (1 / l); fast-math exp, and the
# epilogue's reciprocal and log taken accurately (attention.core.warp.softmax_finish)
WARP_ORDER = "lanes32x1/before/recip_after/ex2"
# the split-KV warp kernel: the same chunks, merged by a combine compiled without
# fast-math (an accurate reciprocal and log)
SPLIT_ORDER = WARP_ORDER

KERNELS = (
    KernelSpec("decode", "decode", "decode", "attention.reference.warp_decode", "decode_attention",
               _run_single, ("k_cache", "v_cache"),
               "warp-per-head decode of one sequence (called per sequence)",
               WARP_ORDER),
    KernelSpec("batched_decode", "batched_decode", "decode", "attention.reference.warp_decode",
               "batched_decode_attention", _run_batched, ("k_cache", "v_cache"),
               "warp per (head, sequence) over a pooled cache with a slot table", WARP_ORDER),
    KernelSpec("flash_decode", "batched_decode", "decode", "attention.reference.split_decode",
               "flash_decode_attention", _run_flash(None), ("k_cache", "v_cache"),
               "split-KV decode, split count from the heuristic", SPLIT_ORDER),
    KernelSpec("flash_decode_split3", "batched_decode", "decode",
               "attention.reference.split_decode",
               "flash_decode_attention", _run_flash(3), ("k_cache", "v_cache"),
               "split-KV decode forced to 3 splits (empty chunks on short sequences)",
               SPLIT_ORDER),
    KernelSpec("decode_fast", "decode_fast", "decode", "attention.decode.fast",
               "batched_decode_attention_fast", _run_batched, ("k_cache", "v_cache"),
               "group-shared split-KV decode (fp32/fp16/bf16 caches), vector loads",
               "decode_fast/before/recip_after/ex2"),
    KernelSpec("decode_paged16", "decode_paged", "decode", "attention.decode.plan", "DecodePlan",
               _run_paged(16, "HND"), ("k_cache", "v_cache"),
               "the fast decode over a paged cache: pages of 16, HND, shuffled",
               "decode_fast/before/recip_after/ex2"),
    KernelSpec("decode_paged3_nhd", "decode_paged", "decode", "attention.decode.plan",
               "DecodePlan", _run_paged(3, "NHD"), ("k_cache", "v_cache"),
               "the fast decode over a paged cache: pages of 3 (not a power of two), NHD",
               "decode_fast/before/recip_after/ex2"),
    KernelSpec("decode_paged16_t4", "decode_paged", "decode", "attention.decode.plan",
               "DecodePlan", _run_multi(4, 16, "HND"), ("k_cache", "v_cache"),
               "multi-token decode (4 queries a sequence, causal) over pages of 16, HND; "
               "each sequence judged at one query, the index varying over the batch",
               "decode_fast/before/recip_after/ex2"),
    KernelSpec("decode_fp8", "decode_fp8", "decode", "attention.decode.plan", "DecodePlan",
               _run_fp8("tensor"), ("q",),
               "the fast decode over an fp8 e4m3 cache (the reference encoder's codes), "
               "per-tensor scales; judged over the dequantized cache, q in the case dtype; "
               "its baseline sums over the codes with the scales outside, as the kernel",
               "decode_fast_c/before/recip_after/ex2", quantize="tensor"),
    KernelSpec("decode_fp8_tok", "decode_fp8", "decode", "attention.decode.plan", "DecodePlan",
               _run_fp8("token_head", 3, "NHD"), ("q",),
               "the fast decode over an fp8 e4m3 cache with per-(token, kv head) scales, "
               "NHD pages of 3 (codes and scales shuffled alike); judged over the "
               "dequantized cache, q in the case dtype",
               "decode_fast/before/recip_after/ex2", quantize="token_head"),
    # the tensor-core decode over an fp8 cache (the codes' values in its tiles, exact
    # in f16; the K scale on each score, the V scale on the output): the 16-bit
    # kernels' rounded-P baseline in that order (``mma16_pc16``: a changed
    # criterion, notes/validation.md; it summed over the dequantized rows before),
    # P rounded to q's dtype (its storage: float16, the only q it takes). Every
    # tensor-core decode entry ends as the kernel does, the sum times the correctly
    # rounded 1 / l (NORM ``recip_after``: a changed criterion, notes/validation.md;
    # it divided before)
    KernelSpec("decode_mma_fp8", "decode_fp8", "decode", "attention.decode.mma", "mma_decode",
               _run_mma_fp8, ("q",),
               "the tensor-core decode over an fp8 e4m3 cache, per-tensor scales, q float16 "
               "(DecodePlan(method='mma')); judged over the dequantized cache",
               "mma16_pc16/after/recip_after", quantize="tensor"),
    # per-(token, kv head) scales: the V scales go into P, normalised a row, before
    # the rounding to f16 (``attention.decode.mma``), so the baseline rounds the same
    # weights (``mma16_pv16``: a changed criterion, notes/validation.md)
    KernelSpec("decode_mma_fp8_tok", "decode_fp8", "decode", "attention.decode.mma",
               "mma_decode", _run_mma_fp8, ("q",),
               "the tensor-core decode over an fp8 e4m3 cache with per-(token, kv head) "
               "scales, q float16 (DecodePlan(method='mma', fp8_scales='token_head')); "
               "judged over the dequantized cache",
               "mma16_pv16/after/recip_after", quantize="token_head"),
    # the 16-bit tensor-core kernels: P is rounded to the 16-bit type before P.V by
    # design (as FlashAttention and FlashMLA do), so their baseline rounds it too
    # (``validation.baselines`` "mma16_p16": ``decode_rounded_p(sums="mma16")`` and
    # ``prefill_rounded_p``, S summed as the mma model sums it; p16 becomes pf16 /
    # pbf16 with the case's dtype; the prefill's weights in FlashAttention-2's form,
    # EXP "ex2fma": a changed criterion, notes/validation.md lists the cases). float32
    # cases, head dims without a tile and GQA
    # groups over one 16-row tile are reported unsupported, with the reason
    # (``_mma_inputs``). Storage: the caches only, so the
    # kernel's DTypeError on a float32 q makes the sweep cast every input (cast
    # "all"): the oracle cache of the other kernels' cast "storage" inputs, whose q
    # stays float32, is never shared with these.
    KernelSpec("decode_mma", "mma", "decode", "attention.decode.mma", "mma_decode",
               _run_mma_decode(), ("k_cache", "v_cache"),
               "tensor-core decode (mma.m16n8k16, P rounded to 16 bits) over a pooled "
               "16-bit cache, q in the cache dtype; D 32/64/128, GQA group <= 16",
               "mma16_p16/after/recip_after"),
    KernelSpec("decode_mma_paged16", "mma", "decode", "attention.decode.mma", "mma_decode",
               _run_mma_decode(16, "HND"), ("k_cache", "v_cache"),
               "the tensor-core decode over pages of 16 (one page a tile), HND, shuffled",
               "mma16_p16/after/recip_after"),
    KernelSpec("decode_mma_paged1_nhd", "mma", "decode", "attention.decode.mma",
               "mma_decode", _run_mma_decode(1, "NHD"), ("k_cache", "v_cache"),
               "the tensor-core decode over NHD pages of 1 (a page entry a row)",
               "mma16_p16/after/recip_after"),
    KernelSpec("decode_mma_t4", "mma", "decode", "attention.decode.mma", "mma_decode",
               _run_mma_decode(16, "HND", t_q=4), ("k_cache", "v_cache"),
               "the tensor-core decode, 4 queries a sequence (causal; group x 4 <= 16 rows) "
               "over pages of 16, HND; each sequence judged at one query",
               "mma16_p16/after/recip_after"),
    KernelSpec("prefill_mma", "mma", "prefill", "attention.prefill.mma",
               "prefill_attention_mma", _run_mma_prefill, ("k", "v"),
               "tensor-core prefill (fp16/bf16 q, k, v; P rounded to 16 bits), causal or "
               "not, GQA; head dims multiples of 16 up to 128, and 256",
               "mma16_p16/after/divide/ex2fma"),
    # the MLA tensor-core decode: [q_lat | q_pe] and P rounded to fp16, S and P.V on
    # mma (``baselines.mla_rounded_p`` through the same label, kind mla); a case is
    # one sequence of a multi-token decode (t_q <= 16); caches other than fp16, latent
    # widths that are not multiples of 64 and t_q > 16 are unsupported (``_run_mla_mma``)
    KernelSpec("mla_mma", "mma", "mla", "mla.pipeline", "mla_decode", _run_mla_mma,
               ("c_kv", "k_pe"),
               "MLA decode on 16-bit tensor cores (mla_decode(method='mma'): fp16 latent "
               "cache, q and P rounded to fp16); one sequence, t_q queries, causal; "
               "r + d_rope and r multiples of 64",
               "mma16_p16/after"),
    # fp8 latent cache: judged over the dequantized c_kv (the oracle exact; the
    # baseline in the kernel's order: per tensor the codes' values with the scale
    # apart, per token the dequantized values rounded to fp16 as the kernel
    # rounds them); float16 k_pe only
    KernelSpec("mla_fp8", "mla_fp8", "mla", "mla.pipeline", "mla_decode", _run_mla_fp8,
               ("k_pe",),
               "MLA decode over an fp8 latent cache, one scale per tensor (mla.fp8: c_kv "
               "e4m3, k_pe fp16; the codes' values in the tensor-core kernel's fp16 tiles, "
               "the scale on S's c_kv part and on O)",
               "mma16_pc16/after", quantize="tensor"),
    KernelSpec("mla_fp8_tok", "mla_fp8", "mla", "mla.pipeline", "mla_decode", _run_mla_fp8,
               ("k_pe",),
               "MLA decode over an fp8 latent cache, one scale a cached row (mla.fp8 "
               "per token; amax / 448)",
               "mma16_p16/after", quantize="token"),
    # the same two over a paged latent cache (shuffled pages, NaN rows and spare
    # pages, a huge unused table entry): FlashMLA's pages of 64 (whole 64-row
    # tiles, one page-table read a tile), and pages of 3 with per-token scales
    # (tiles across pages, a read a row; the scales paged beside the rows)
    KernelSpec("mla_mma_paged64", "mma", "mla", "mla.pipeline", "mla_decode",
               _paged_mla(_run_mla_mma, 64), ("c_kv", "k_pe"),
               "mla_mma over a paged latent cache, pages of 64 (shuffled; NaN unused rows)",
               "mma16_p16/after"),
    KernelSpec("mla_fp8_tok_paged3", "mla_fp8", "mla", "mla.pipeline", "mla_decode",
               _paged_mla(_run_mla_fp8, 3), ("k_pe",),
               "mla_fp8_tok over a paged fp8 latent cache, pages of 3 (shuffled; NaN codes "
               "and scales in unused rows)",
               "mma16_p16/after", quantize="token"),
    KernelSpec("prefill_fused", "prefill", "prefill", "attention.prefill.kernels",
               "prefill_attention",
               _run_prefill("fused"), ("k", "v"), "fused tiled online-softmax prefill",
               "fma/before/recip_after"),
    # the float32 tensor-core prefill (split tf32, three mmas a product, a fresh
    # partial a k step): held to the fused prefill's baseline and rule unchanged
    KernelSpec("prefill_tf32", "prefill_tf32", "prefill", "attention.prefill.tf32",
               "prefill_attention_tf32", _run_tf32_prefill, ("k", "v"),
               "float32 prefill on tensor cores (mma.m16n8k8, operands split in tf32 "
               "halves), causal or not, GQA; head dims multiples of 8 up to 256",
               "fma/before/recip_after"),
    KernelSpec("prefill_batched", "prefill", "prefill", "attention.reference.prefill_paths",
               "prefill_attention_reference", _run_prefill("batched"), ("k", "v"),
               "reference path, all heads per launch: transpose, GEMM, softmax, GEMM",
               "fma/after/recip_first"),
    KernelSpec("prefill_per_head", "prefill", "prefill", "attention.reference.prefill_paths",
               "prefill_attention_reference", _run_prefill("per_head"), ("k", "v"),
               "reference path, one head at a time through the same small kernels",
               "fma/after/recip_first"),
    KernelSpec("mla", "mla", "mla", "mla.pipeline", "mla_attend", _run_mla("flash"),
               ("c_kv", "k_pe"),
               "absorb_q -> latent rows -> attn_absorbed (tiled online softmax) -> decompress_v",
               "interleaved4/before/recip_after"),
    KernelSpec("mla_gemm", "mla_gemm", "mla", "mla.pipeline", "mla_attend", _run_mla("gemm"),
               ("c_kv", "k_pe"),
               "the GEMM path: absorb, scores, softmax, P.V, decompress (mla.attn_gemm; "
               "scores and P.V on tensor cores, split tf32, where they qualify)",
               "mla_gemm/after/recip_first"),
    KernelSpec("mla_gemm_fma", "mla_gemm", "mla", "mla.pipeline", "mla_attend",
               _run_mla("gemm_fma"), ("c_kv", "k_pe"),
               "the GEMM path with fp32 FMA GEMMs only (method='gemm_fma')",
               "blocked64/after/recip_first"),
)
KERNELS_BY_NAME = {k.name: k for k in KERNELS}

# Precision mutants (resolving power of the judge): compile-time switches of the
# product kernels, passed as ``defect=``; kernel name -> (module, the method its
# ``mutant_applies`` is asked about, or None for the module's own tuple)
MUTANT_SOURCES = {
    "decode_fast": ("attention.decode.fast", None),
    # the same kernel over an fp8 cache, per tensor: the resolving power of its own
    # baseline order (decode_fast_c, a changed criterion)
    "decode_fp8": ("attention.decode.fast", None),
    "prefill_tf32": ("attention.prefill.tf32", None),
    # the tensor-core decode: P rounded to bf16 on the 16-bit pooled entry (inert on
    # its bf16 cases) and both fp8 entries; the unnormalised P vs on token_head only
    "decode_mma": ("attention.decode.mma", "tensor"),
    "decode_mma_fp8": ("attention.decode.mma", "tensor"),
    "decode_mma_fp8_tok": ("attention.decode.mma", "token_head"),
    "mla_gemm": ("mla.attn_gemm", "gemm"),
    "mla_gemm_fma": ("mla.attn_gemm", "gemm_fma"),
}


def mutants_of(name):
    """The precision mutants kernel ``name`` carries (empty for the others)."""
    if name not in MUTANT_SOURCES:
        return ()
    module, method = MUTANT_SOURCES[name]
    mod = importlib.import_module(module)
    names = tuple(getattr(mod, "PRECISION_MUTANTS", ()))
    if method is None:
        return names
    applies = getattr(mod, "mutant_applies", None)
    return tuple(n for n in names if applies is None or applies(n, method))
# modules the oracles and fixtures of each kind need besides the kernel's own
KIND_MODULES = {"decode": ("attention.oracle",), "prefill": ("attention.oracle",),
                "mla": ("mla.oracle", "mla.dims")}


def _import(module):
    """("ok", module) | ("not available", why) | ("broken", traceback)."""
    try:
        return "ok", importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            return "not available", f"module {module} does not exist yet"
        return "broken", traceback.format_exc(limit=4)
    except Exception:  # noqa: BLE001 - any import failure of an existing module is a defect
        return "broken", traceback.format_exc(limit=4)


def resolve(spec):
    """("ok", function) | ("not available", why) | ("broken", why) for a kernel."""
    for module in KIND_MODULES[spec.kind]:
        status, got = _import(module)
        if status != "ok":
            return status, got
    status, mod = _import(spec.module)
    if status != "ok":
        return status, mod
    fn = getattr(mod, spec.attr, None)
    if fn is None:
        return "broken", f"module {spec.module} has no {spec.attr}"
    return "ok", fn


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    kernel: str
    shape: str
    fixture: str
    seed: int
    dtype: str
    small: bool
    mutants: bool = False  # also run the kernel's precision mutants (resolving power)

    @property
    def id(self):
        return f"{self.kernel}/{self.shape}/{self.fixture}/s{self.seed}/{self.dtype}"


def cases(kernels, *, small, quick, seeds, dtypes, shape_filter=None, fixture_filter=None,
          mutant_seeds=()):
    """Every case of ``kernels`` (KernelSpecs) in a fixed order: grouped by kind,
    then by data (shape, fixture, seed, dtype), the kernels of the kind last, so
    consecutive cases share inputs and references. A kind whose shapes cannot be
    listed (its modules missing) yields no cases; the sweep reports its kernels
    through ``resolve``."""
    by_kind = {}
    for spec in kernels:
        by_kind.setdefault(spec.kind, []).append(spec)
    out = []
    for kind, specs in by_kind.items():
        try:
            kind_shapes = all_shapes(kind, small)
        except ImportError:
            continue
        for shape in kind_shapes:
            if quick and not shape.quick:
                continue
            if shape_filter and not shape_filter(shape.name):
                continue
            for fixture in shape.fixtures:
                if fixture_filter and not fixture_filter(fixture):
                    continue
                for seed in seeds:
                    for dtype in dtypes:
                        for spec in specs:
                            if shape.families and spec.family not in shape.families:
                                continue
                            out.append(Case(spec.name, shape.name, fixture, int(seed), dtype,
                                            small, spec.name in MUTANT_SOURCES
                                            and int(seed) in mutant_seeds))
    return out
