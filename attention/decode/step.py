"""The decode step: pooled KV caches, device lengths, a done mask; eager or graph.

``DecodeState`` is one layer's decode-time state for M sequences and the
prebuilt launches of one decode step over it:

* ``k_cache``, ``v_cache``: device ``[KV_SLOTS, H_kv, max_seq, D]`` pools of
  float32, float16 or bfloat16; sequence ``m`` lives in slot
  ``slot_table[m]`` (distinct slots; slots not in the table are never read
  or written);
* ``d_lengths``: device int32 ``[M]``, positions cached per sequence (the
  ``lengths`` property reads them back);
* ``done``: a mask of finished sequences (host copy, mirrored on the device):
  a finished sequence is neither read nor written and its output is zeros
  (LSE -inf).

One step (``step(q, k_new, v_new)``, or ``step()`` over the device buffers
``q``, ``k_new``, ``v_new`` that the caller fills) is three launches:

    1. prepare   for each live sequence within capacity: ``positions[m] =
                 lengths[m]``, ``seq_lens[m] = lengths[m] + 1``, then
                 ``lengths[m] += 1``; a done sequence gets ``positions[m] =
                 max_seq`` (the scatter skips it) and ``seq_lens[m] = 0``
    2. scatter   ``cache[slot_table[m], :, positions[m], :] = k_new[m], v_new[m]``
                 (``attention.cache.scatter``; positions ``>= max_seq`` skipped)
    3. attention over ``seq_lens``: the state's ``DecodePlan``, the fast
                 kernel (``attention.decode.fast``, default) or with
                 ``method="mma"`` the tensor-core one (``attention.decode.mma``:
                 16-bit caches with q in their dtype, fp8 caches with q
                 float16), or a registered kernel (``register_backend``; the
                 reference warp / split-KV kernels, ``kernel="warp"`` /
                 ``"split"``, float32 only, for validation, once
                 ``attention.reference.decode_step`` is imported)

Capacity: a live sequence that already holds ``max_seq`` positions (or whose
length was set outside ``[0, max_seq]``) is neither written nor attended: its
scatter writes nothing, its ``seq_lens`` is 0 (output zeros, LSE -inf), its
length does not advance, and the prepare kernel raises an error flag on the
device. ``check()``, every synchronising step (``sync=True``, and every step
given numpy inputs, which returns numpy outputs) reads the flag and raises
``checks.RangeError`` naming the first such sequence and the capacity. Nothing
is clamped and nothing is written past the capacity.

Modes (``mode=``): ``"graph"`` (default) captures the three launches once as a
CUDA graph (``attention.core.graph.CapturedLaunches``) and a step replays it:
one driver call. ``"eager"`` enqueues them at every step through launches
built once: the prepare and scatter kernels as ``attention.core.launch.
PrebuiltLaunch``, the attention through the state's ``DecodePlan`` (fast
kernel), so an eager step does no numba dispatch either (on the simulator,
which has no ``cuda.core`` launch, they are numba launches). Where
no graph can be built (the simulator, no GPU, a capture error) a graph state
runs eager; ``path`` ("graph" / "eager") and ``fallback_reason`` record what
``step()`` runs and why, and a failed capture on a GPU warns
(``checks.FallbackWarning``). Either way everything is validated, planned,
allocated (and, on a GPU, compiled) in ``__init__``: a step does no planning
and no allocation; given arrays, it checks only their shape and dtype.
``pdl`` records whether the plan's combine (the fast or the tensor-core
kernel's) is a programmatic dependent launch and why
(``attention.core.pdl.status``; inside a graph it is plain).

FP8 e4m3 caches (``dtype=np.uint8`` or "float8_e4m3fn": codes as uint8,
``attention.cache.fp8``; sm_89 and later): the new rows ``k_new`` / ``v_new``
stay float32, float16 or bfloat16 (``new_dtype``) and launch 2 is the quantizing
append instead (``attention.cache.fp8.fp8_append_kernel``: the pooled cache as
HND pages of ``max_seq`` with a one-column table ``[M, 1]`` = the slot table,
the row at ``positions[m]``; a position ``>= max_seq`` is not written). The
scales are the state's (``fp8_scales``, as ``DecodePlan``'s):

* "tensor": ``k_scale`` / ``v_scale`` float32 ``[1]``, given at construction:
  ``code = e4m3(x / scale)``;
* "token_head": ``k_scale`` / ``v_scale`` float32 ``[KV_SLOTS, H_kv,
  max_seq]`` (the cache's shape without D), a scale a cached row: the append
  writes ``amax / 448`` over the new row's D values (``fp8.row_scales``; a
  row of zeros gets scale 0 and codes 0) beside the codes.

The attention is the state's ``DecodePlan(cache_dtype=uint8,
fp8_scales=...)`` run with the state's ``k_scale`` / ``v_scale``.

Planted defects (``defect=``, falsification suite only): the state's own
"length_not_advanced" (lengths stay put after a step) and "done_slot_read"
(finished sequences keep their length for the kernel); a defect of the
attention kernel in use (``attention.decode.fast.DEFECTS`` for "fast",
``attention.reference.warp_decode.KERNEL_DEFECTS`` for "warp" / "split") or of
the scatter (``attention.cache.scatter.SCATTER_DEFECTS``) or of the fp8
append (``attention.cache.fp8.FP8_DEFECTS``, fp8 states) is passed on to it.

Buffers (device arrays; fill or read them between steps):
    q            [M, H, D]                     float32 (or the cache dtype: ``q_dtype``;
                                               fp8: float32 / float16 / bfloat16)
    k_new, v_new [M, H_kv, D]                  cache dtype; fp8: ``new_dtype`` (rows
                                               of done sequences ignored)
    k_cache      [KV_SLOTS, H_kv, max_seq, D]  float32 / float16 / bfloat16 / uint8
    v_cache      [KV_SLOTS, H_kv, max_seq, D]  (fp8 e4m3 codes)
    k_scale      fp8 only: [1] ("tensor") or [KV_SLOTS, H_kv, max_seq]
    v_scale      ("token_head", written by each step's append) float32
    d_lengths    [M] int32, d_slots [M] int32
    positions    [M] int32, seq_lens [M] int32 (written by the step)
    out          [M, H, D] float32, lse [M, H] float32 (written by the step)
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from attention.cache import fp8 as fp8_cache
from attention.cache.paged import new_flag
from attention.cache.scatter import SCATTER_DEFECTS, scatter_kernel
from attention.core import checks
from attention.core.device import (
    BFLOAT16,
    SIMULATOR,
    as_device_view,
    device_empty,
    gpu_available,
    host_ints,
    is_host_array,
    jit,
    to_device,
    to_host,
)
from attention.core.graph import CapturedLaunches
from attention.core.launch import PrebuiltLaunch, core_stream
from attention.core.pdl import status as pdl_status
from attention.decode import fast
from attention.decode import mma as MMA
from attention.decode.plan import DecodePlan, _fp8_name

MODES = ("eager", "graph")
STATE_DEFECTS = ("length_not_advanced", "done_slot_read")
STATE_DTYPES = fast.CACHE_DTYPES + (fast.FP8_DTYPE,)  # fp32, fp16, bf16, fp8 codes (fast)
# host us of one step, eager (prebuilt launches) and replayed, B 32 fp32 on the
# H200 (notes/bench.md, run 17): quoted when a graph cannot be built
EAGER_COSTS = (38.8, 5.5)

# Other attention kernels a state can run instead of the fast one, registered
# by name from outside the product path: ``attention.reference.decode_step``
# adds the reference "warp" and "split" kernels (float32, for validation), so
# this module never imports the reference area. A backend provides
# ``defects``, ``dtypes``, ``plan(state, n_split, split_chunk)``,
# ``scratch(state)`` and ``attend(state, stream)``.
BACKENDS = {}


def register_backend(name, backend):
    """Let ``DecodeState(kernel=name)`` attend with ``backend`` (see ``BACKENDS``)."""
    BACKENDS[name] = backend


def kernels():
    """The kernel names a state accepts now: "fast" and the registered ones."""
    return ("fast",) + tuple(BACKENDS)


def all_defects():
    """Every defect switch a state accepts now (its own, the scatter's, the
    product plan's kernels' and the registered backends')."""
    names = (fast.DEFECTS + fast.FP8_DEFECTS + MMA.ALL_DEFECTS + SCATTER_DEFECTS
             + fp8_cache.FP8_DEFECTS + STATE_DEFECTS)
    for b in BACKENDS.values():
        names += tuple(b.defects)
    return tuple(dict.fromkeys(names))

# The capacity flag is the fast kernel's device error flag (``fast.clear_flag``,
# int32 [fast.ERR_WORDS]): the prepare kernel counts a sequence out of capacity in
# ERR_COUNT / ERR_LENGTHS and keeps the smallest such index in ERR_FIRST, and the
# fast kernel's own range check (which the prepared lengths never trip) writes
# into the same flag, so one check() reads both.
ERR_COUNT, ERR_FIRST, ERR_LENGTHS = fast.ERR_COUNT, fast.ERR_FIRST, fast.ERR_LENGTHS


@functools.lru_cache(maxsize=None)
def prepare_kernel(advance=True, done_read=False):
    """Per sequence: the row this step writes, the positions it attends, the
    length after it (module docstring, launch 1). ``advance=False`` and
    ``done_read=True`` are the planted "length_not_advanced" / "done_slot_read".
    Grid ceil(M/block), block ``threads_for(M)``.

    lengths [M] int32 (advanced in place), done [M] int32 (nonzero: finished),
    positions [M] int32, seq_lens [M] int32 (written), max_seq int32, flag
    [fast.ERR_WORDS] int32 (``fast.clear_flag``).
    """
    ADVANCE, DONE_READ = advance, done_read

    def kernel(lengths, done, positions, seq_lens, max_seq, flag):
        m = cuda.grid(1)
        if m < lengths.shape[0]:
            length = lengths[m]
            if done[m] != 0:
                positions[m] = max_seq  # the scatter skips it
                if DONE_READ:
                    seq_lens[m] = length
                else:
                    seq_lens[m] = 0
            elif length < 0 or length >= max_seq:
                positions[m] = max_seq
                seq_lens[m] = 0
                cuda.atomic.add(flag, ERR_COUNT, 1)
                cuda.atomic.add(flag, ERR_LENGTHS, 1)
                cuda.atomic.min(flag, ERR_FIRST, m)
            else:
                positions[m] = length
                seq_lens[m] = length + 1
                if ADVANCE:
                    lengths[m] = length + 1

    kernel.__name__ = kernel.__qualname__ = "decode_state_prepare" + (
        "" if advance else "_length_not_advanced") + ("_done_slot_read" if done_read else "")
    return jit(kernel)


def threads_for(count):
    """Threads of a per-sequence launch: ``count`` rounded up to warps, at most 128."""
    return int(min(128, max(32, -(-count // 32) * 32)))


def _upload(dst, src):
    """Copy ``src`` (numpy or device, ``dst``'s shape and dtype) into device ``dst``."""
    if is_host_array(src):
        src = np.ascontiguousarray(src)
        if BFLOAT16 is not None and src.dtype == BFLOAT16 and not SIMULATOR:
            dst.view(np.uint16).copy_to_device(src.view(np.uint16))
            return
        dst.copy_to_device(src)
        return
    dst.copy_to_device(as_device_view(src))


def _filled(shape, dtype, value):
    return to_device(np.full(shape, value, dtype=dtype))


class DecodeState:
    """Decode state of M sequences and its prebuilt step (see module docstring).

    m, n_heads, n_kv_heads, head_dim, max_seq: the batch and cache geometry
    kv_slots:   cache slots (default M; must be >= M)
    slot_table: [M] distinct ints in [0, kv_slots) (default ``arange(M)``)
    dtype:      cache dtype: float32, float16 or bfloat16 (``ml_dtypes``), or fp8
                e4m3 (``np.uint8`` / "float8_e4m3fn": codes as uint8; product plan)
    q_dtype:    float32 (default) or the cache dtype (product plan only); with
                fp8, float32, float16 or bfloat16
    new_dtype:  fp8 only: the dtype of the new rows ``k_new`` / ``v_new``,
                float32 (default), float16 or bfloat16 (quantized by the
                append); otherwise the cache dtype (the default)
    fp8_scales: fp8 only, as ``DecodePlan``'s: "tensor" (default) or
                "token_head" (a scale a cached row, written by the append)
    k_scale, v_scale: fp8 only, float32, numpy (copied) or device (used in
                place): "tensor": ``[1]``, required, finite and > 0 (checked
                when numpy); "token_head": ``[KV_SLOTS, H_kv, max_seq]``
                (``scale_shape``), optional (default fresh arrays: NaN when
                ``fill`` is NaN, else 1), the scales of rows already cached
    kernel:     "fast" (default: the product plan), or a registered kernel ("warp" /
                "split": the reference kernels, float32, after ``import
                attention.reference.decode_step``)
    method:     the product plan's kernel (``DecodePlan``'s ``method``): "fast"
                (default, the CUDA-core kernel) or "mma" (the tensor-core one:
                q in the cache's dtype, float16 with fp8; D 32, 64, 128; H /
                H_kv <= 16); a state it cannot take raises naming why
    mode:       "graph" (default; eager where no graph can be built) or "eager"
    scale:      default 1/sqrt(D)
    n_split:    the product plan's split count (default: planned for max_seq)
    split_chunk: the split kernel's chunk (default ``split_plan`` for max_seq)
    k_cache, v_cache: optional [KV_SLOTS, H_kv, max_seq, D] caches of ``dtype``
                (fp8: uint8 codes): device arrays are used in place, numpy
                arrays copied; default fresh caches filled with ``fill`` (fp8:
                its e4m3 code)
    fill:       initial value of every element of fresh caches (NaN makes
                stray reads visible)
    defect:     planted defect (falsification suite only)
    """

    def __init__(self, m, n_heads, n_kv_heads, head_dim, max_seq, *, kv_slots=None,
                 slot_table=None, dtype=np.float32, q_dtype=np.float32, kernel="fast",
                 mode="graph", scale=None, n_split=None, split_chunk=None, k_cache=None,
                 v_cache=None, fill=0.0, defect=None, fp8_scales="tensor", k_scale=None,
                 v_scale=None, new_dtype=None, method="fast"):
        # -- validation: every named error before any allocation or launch --
        for name, value, lo in (("m", m, 1), ("n_heads", n_heads, 1),
                                ("n_kv_heads", n_kv_heads, 1), ("max_seq", max_seq, 1)):
            if not isinstance(value, (int, np.integer)) or value < lo:
                raise checks.RangeError(f"{name}: expected an int >= {lo}, got {value!r}")
        checks.check_head_dim("head_dim", int(head_dim))
        checks.check_heads(int(n_heads), int(n_kv_heads), q_name="n_heads", kv_name="n_kv_heads")
        kv_slots = int(m) if kv_slots is None else kv_slots
        if not isinstance(kv_slots, (int, np.integer)) or kv_slots < m:
            raise checks.RangeError(f"kv_slots: expected an int >= M={m}, got {kv_slots!r}")
        if kernel not in kernels():
            raise checks.AttentionInputError(
                f"kernel: expected one of {kernels()}, got {kernel!r} (the reference kernels "
                "\"warp\" and \"split\" are registered by importing "
                "attention.reference.decode_step)")
        backend = None if kernel == "fast" else BACKENDS[kernel]
        if method not in ("fast", "mma") or (backend is not None and method != "fast"):
            raise checks.AttentionInputError(
                f"method: expected 'fast' or 'mma' (the product plan's kernels; "
                f"kernel={kernel!r} takes 'fast' only), got {method!r}")
        self.method = method
        if mode not in MODES:
            raise checks.AttentionInputError(f"mode: expected one of {MODES}, got {mode!r}")
        dt = _fp8_name(dtype)
        if dt is None:
            try:
                dt = np.dtype(dtype)
            except TypeError:
                raise checks.DTypeError(f"dtype: expected a numpy dtype, got {dtype!r}") from None
        allowed = STATE_DTYPES if backend is None else backend.dtypes
        if SIMULATOR and BFLOAT16 is not None and dt == BFLOAT16:
            raise checks.DTypeError("dtype: the CUDA simulator has no bfloat16")
        if dt not in allowed:
            raise checks.DTypeError(
                f"dtype: expected {' or '.join(str(a) for a in allowed)} for kernel "
                f"{kernel!r} (uint8: fp8 e4m3 codes), got {dt}")
        is_fp8 = dt == fast.FP8_DTYPE
        qdt = np.dtype(q_dtype)
        if is_fp8:
            if qdt not in fast.CACHE_DTYPES:
                raise checks.DTypeError(
                    f"q_dtype: expected float32, float16 or bfloat16 with an fp8 cache, "
                    f"got {qdt}")
        elif qdt not in (np.dtype(np.float32), dt) or (kernel != "fast" and qdt != dt):
            raise checks.DTypeError(
                f"q_dtype: expected float32{'' if kernel != 'fast' else ' or ' + str(dt)}, "
                f"got {qdt}")
        new_dt = self._check_new_dtype(new_dtype, dt, is_fp8)
        self._check_fp8_mode(fp8_scales, is_fp8, dt, k_scale, v_scale, defect)
        if defect not in (None,) + all_defects():
            raise ValueError(f"defect: expected one of {all_defects()} or None, got {defect!r}")
        if n_split is not None:
            checks.check_range("n_split", int(n_split), 1, 1 << 16, what="split count")
        self.m, self.n_heads, self.n_kv_heads = int(m), int(n_heads), int(n_kv_heads)
        self.head_dim, self.max_seq, self.kv_slots = int(head_dim), int(max_seq), int(kv_slots)
        self.dtype, self.q_dtype, self.kernel, self.mode = dt, qdt, kernel, mode
        self.new_dtype, self.fp8 = new_dt, is_fp8
        self.fp8_scales = fp8_scales if is_fp8 else None
        self.defect = defect
        self.scale = checks.check_scale(scale, self.head_dim)
        self.slot_table = checks.check_slot_table(
            None if slot_table is None else host_ints(slot_table), self.m, self.kv_slots,
            distinct=True)
        for name, given in (("k_cache", k_cache), ("v_cache", v_cache)):
            if given is not None:
                checks.check_array(name, given, tuple(zip(
                    ("KV_SLOTS", "H_kv", "max_seq", "D"), self.cache_shape)), dtypes=(dt,))
                if kernel == "fast" and not is_host_array(given):
                    checks.check_aligned(name, given, 16)
        if is_fp8:  # k_scale / v_scale: shape, dtype (and values, host per-tensor)
            for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
                if given is not None:
                    self._check_scale_array(name, given)
        self._backend = backend
        plan_defects = fast.DEFECTS + fast.FP8_DEFECTS if method == "fast" else MMA.ALL_DEFECTS
        self._attn_defect = defect if defect in (
            plan_defects if backend is None else backend.defects) else None
        self._scatter_defect = defect if defect in SCATTER_DEFECTS else None
        self._append_defect = defect if defect in fp8_cache.FP8_DEFECTS else None
        self._plan_attention(n_split, split_chunk)  # host only: no launch

        # -- device state and buffers (allocated once) --
        shape = self.cache_shape
        code = fp8_cache.encode_e4m3(np.float32(fill))[()] if is_fp8 else fill
        self.k_cache = _filled(shape, dt, code) if k_cache is None else to_device(k_cache)
        self.v_cache = _filled(shape, dt, code) if v_cache is None else to_device(v_cache)
        mc, h, d = self.m, self.n_heads, self.head_dim
        self.q = to_device(np.zeros((mc, h, d), qdt))
        self.k_new = to_device(np.zeros((mc, self.n_kv_heads, d), new_dt))
        self.v_new = to_device(np.zeros((mc, self.n_kv_heads, d), new_dt))
        self.k_scale = self.v_scale = None
        if is_fp8:
            sfill = np.float32(np.nan if np.isnan(fill) else 1.0)
            self.k_scale = (_filled(self.scale_shape, np.float32, sfill) if k_scale is None
                            else to_device(k_scale))
            self.v_scale = (_filled(self.scale_shape, np.float32, sfill) if v_scale is None
                            else to_device(v_scale))
        self.d_slots = to_device(self.slot_table)
        self.d_lengths = to_device(np.zeros(mc, np.int32))
        self._done = np.zeros(mc, bool)
        self._d_done = to_device(np.zeros(mc, np.int32))
        self.positions = device_empty((mc,), np.int32)
        self.seq_lens = device_empty((mc,), np.int32)
        if self._attn is not None:  # the plan's buffers and error flag
            a = self._attn
            self.out, self.lse, self._flag = a.out, a.lse, a.flag
            self._scratch = (a.part_acc, a.part_ml)
        else:
            self.out = device_empty((mc, h, d), np.float32)
            self.lse = device_empty((mc, h), np.float32)
            self._flag = to_device(fast.clear_flag())
            self._scratch = self._backend.scratch(self)
        # a dry step (every sequence done: nothing written, nothing advanced)
        # compiles and loads every kernel without touching the state
        self._dry = (to_device(np.zeros(mc, np.int32)), to_device(np.ones(mc, np.int32)),
                     to_device(fast.clear_flag()))
        self._prepare = prepare_kernel(defect != "length_not_advanced",
                                       defect == "done_slot_read")
        self._scatter = scatter_kernel(True, self._scatter_defect)
        self._threads = threads_for(mc)
        self._scatter_threads = int(min(128, max(32, (d + 31) // 32 * 32)))
        if is_fp8:
            # the quantizing append over the pooled cache as HND pages of max_seq
            # (table [M, 1]: the slots), T = 1 row at positions[m]; the checked
            # kernel skips a position >= max_seq (a done or full sequence, which
            # the prepare kernel has already flagged) and counts it in a sink
            self._table = to_device(self.slot_table.astype(np.int32)[:, None])
            self._append_sink = new_flag()
            self._append = fp8_cache.fp8_append_kernel(
                "HND", self.fp8_scales == "token_head", self._append_defect, checked=True)
            n_kv = self.n_kv_heads
            self._append_args = (self.k_new.reshape(mc, 1, n_kv, d),
                                 self.v_new.reshape(mc, 1, n_kv, d), self.k_cache,
                                 self.v_cache, self.k_scale, self.v_scale, self._table,
                                 self.positions, self._append_sink)
            self._append_grid = (1, mc, n_kv)
        self._streams = {}
        self._prebuilt = None
        if not SIMULATOR and gpu_available():  # compiled and loaded here
            self._prebuilt = (
                PrebuiltLaunch(self._prepare, (self.d_lengths, self._d_done, self.positions,
                                               self.seq_lens, np.int32(self.max_seq),
                                               self._flag),
                               (mc + self._threads - 1) // self._threads, self._threads),
                PrebuiltLaunch(self._append, self._append_args, self._append_grid,
                               self._scatter_threads) if is_fp8 else
                PrebuiltLaunch(self._scatter, (self.k_new, self.v_new, self.k_cache,
                                               self.v_cache, self.positions, self.d_slots),
                               (mc, self.n_kv_heads), self._scatter_threads))
        self._graph = CapturedLaunches(self.enqueue, lambda: self.enqueue(0, dry=True),
                                       enabled=(mode == "graph"), owner="DecodeState",
                                       plain_call="eager launches at every step()",
                                       plain_hint='mode="eager"', costs=EAGER_COSTS)
        self.graph, self.graph_error = self._graph.graph, self._graph.error
        self.path = "graph" if self.graph is not None else "eager"
        self.fallback_reason = self._graph.fallback_reason
        if self.graph is None and gpu_available():
            self.enqueue(0, dry=True)  # compile and load now, not at the first step
            cuda.synchronize()
        self.pdl = self._pdl_record()

    # -- set-up ------------------------------------------------------------

    @property
    def cache_shape(self):
        return (self.kv_slots, self.n_kv_heads, self.max_seq, self.head_dim)

    @property
    def scale_shape(self):
        """fp8 states: the shape of ``k_scale`` / ``v_scale``: ``(1,)``
        ("tensor") or ``(KV_SLOTS, H_kv, max_seq)`` ("token_head"); else None."""
        if not self.fp8:
            return None
        return (1,) if self.fp8_scales == "tensor" else self.cache_shape[:3]

    @staticmethod
    def _check_new_dtype(new_dtype, dt, is_fp8):
        """The new rows' dtype (module docstring); DTypeError naming ``new_dtype``."""
        if not is_fp8:
            ndt = dt if new_dtype is None else np.dtype(new_dtype)
            if ndt != dt:
                raise checks.DTypeError(
                    f"new_dtype: expected the cache's {dt} (only fp8 states quantize new "
                    f"rows), got {ndt}")
            return ndt
        ndt = np.dtype(np.float32) if new_dtype is None else np.dtype(new_dtype)
        if SIMULATOR and BFLOAT16 is not None and ndt == BFLOAT16:
            raise checks.DTypeError("new_dtype: the CUDA simulator has no bfloat16")
        if ndt not in fp8_cache.NEW_DTYPES:
            raise checks.DTypeError(
                f"new_dtype: expected float32, float16 or bfloat16 new rows for an fp8 "
                f"cache, got {ndt}")
        return ndt

    @staticmethod
    def _check_fp8_mode(fp8_scales, is_fp8, dt, k_scale, v_scale, defect):
        """``fp8_scales`` and the presence of ``k_scale`` / ``v_scale`` (their
        shapes: ``_check_scale_array``), as ``DecodePlan`` names them."""
        if fp8_scales not in fast.FP8_SCALES:
            raise checks.AttentionInputError(
                f"fp8_scales: expected one of {fast.FP8_SCALES}, got {fp8_scales!r}")
        if not is_fp8:
            if fp8_scales != "tensor":
                raise checks.AttentionInputError(
                    f"fp8_scales: {fp8_scales!r} needs an fp8 cache (dtype uint8 / "
                    f"'float8_e4m3fn'), got dtype {dt}")
            if k_scale is not None or v_scale is not None:
                raise checks.AttentionInputError(
                    "k_scale, v_scale: only fp8 states (dtype uint8 / 'float8_e4m3fn') take "
                    "scales")
            if defect in fp8_cache.FP8_DEFECTS + fast.FP8_DEFECTS:
                raise checks.AttentionInputError(f"defect: {defect!r} needs an fp8 state")
            return
        if fp8_scales == "tensor" and (k_scale is None or v_scale is None):
            raise checks.AttentionInputError(
                "k_scale, v_scale: an fp8 state with per-tensor scales (fp8_scales='tensor') "
                "needs both (float32 [1], finite and > 0)")
        if fp8_scales == "token_head" and (k_scale is None) != (v_scale is None):
            raise checks.AttentionInputError(
                "k_scale, v_scale: give both per-(token, head) scale arrays or neither "
                "(fresh ones)")

    def _check_scale_array(self, name, x):
        """``x`` as ``name`` (k_scale / v_scale): float32 of ``scale_shape``,
        C-contiguous; a numpy per-tensor scale finite and > 0. Named errors."""
        if self.fp8_scales == "tensor":
            dims = (("1", 1),)
        else:
            dims = tuple(zip(("KV_SLOTS", "H_kv", "max_seq"), self.scale_shape))
        try:
            checks.check_array(name, x, dims, dtypes=(np.float32,))
        except checks.ShapeError as exc:
            other = {"tensor": (self.cache_shape[:3], "per-(token, head) scales need "
                                "fp8_scales='token_head'"),
                     "token_head": ((1,), "per-tensor scales need fp8_scales='tensor'")}
            shape, hint = other[self.fp8_scales]
            hint = f"; {hint}" if tuple(x.shape) == shape else ""
            raise checks.ShapeError(f"{exc} (fp8_scales={self.fp8_scales!r}{hint})") from None
        if self.fp8_scales == "tensor" and is_host_array(x):
            v = float(np.asarray(x)[0])
            if not (np.isfinite(v) and v > 0):
                raise checks.RangeError(f"{name}: expected a finite scale > 0, got {v}")

    def _plan_attention(self, n_split, split_chunk):
        """The attention launches' plan, for the cache's full capacity (blocks
        or chunks past a sequence's length exit at once): a ``DecodePlan`` of
        the state's ``method`` (its buffers, flag and prebuilt launches are the
        state's), the backend's own otherwise."""
        self._attn = None
        if self.kernel == "fast":
            self._attn = DecodePlan(self.m, self.n_heads, self.n_kv_heads, self.head_dim,
                                    self.kv_slots, self.max_seq, cache_dtype=self.dtype,
                                    q_dtype=self.q_dtype, scale=self.scale, n_split=n_split,
                                    defect=self._attn_defect,
                                    fp8_scales=self.fp8_scales or "tensor", method=self.method)
            self.plan = self._attn.kernel_plan
            self.n_split = self.plan["n_split"]
        else:
            self._backend.plan(self, n_split, split_chunk)

    def _pdl_record(self):
        if self.kernel != "fast":
            return {"path": "none", "reason": f"the {self.kernel} reference kernel has no "
                                              "programmatic dependent launch"}
        if self.plan["n_split"] <= 1:
            return {"path": "none", "reason": "one split: no combine launch"}
        record = pdl_status(self.plan["pdl"])
        if record["path"] == "pdl" and self.path == "graph":
            return {"path": "plain", "reason": "step() replays a graph, where the combine "
                                               "is launched plainly (the plan's launch)"}
        return record

    # -- the launches of one step, on any stream-like object ---------------

    def enqueue(self, stream, dry=False):
        """Enqueue one step (prepare, scatter, attention) on ``stream`` (0, a
        numba stream, or a cuda.core stream / graph builder). ``dry``: every
        sequence treated as done and the lengths and flag of scratch copies:
        nothing is written to the caches or the state (numba launches: a dry
        step only compiles and loads)."""
        if self._prebuilt is not None and not dry:
            st = core_stream(stream, self._streams)
            for launch in self._prebuilt:
                launch.launch(st)
            self._attend(st)
            return
        lengths, done, flag = self._dry if dry else (self.d_lengths, self._d_done, self._flag)
        self._prepare[(self.m + self._threads - 1) // self._threads, self._threads, stream](
            lengths, done, self.positions, self.seq_lens, np.int32(self.max_seq), flag)
        if self.fp8:
            self._append[self._append_grid, self._scatter_threads, stream](*self._append_args)
        else:
            self._scatter[(self.m, self.n_kv_heads), self._scatter_threads, stream](
                self.k_new, self.v_new, self.k_cache, self.v_cache, self.positions,
                self.d_slots)
        self._attend(stream)

    def _attend(self, stream):
        if self._attn is not None:  # the plan's error flag is the state's
            self._attn.run(self.q, self.k_cache, self.v_cache, self.seq_lens, self.d_slots,
                           out=self.out, lse=self.lse, stream=stream, k_scale=self.k_scale,
                           v_scale=self.v_scale)
            return
        self._backend.attend(self, stream)

    # -- one decode step ---------------------------------------------------

    def _fill(self, name, buf, x):
        if x is None:
            return
        if getattr(x, "shape", None) != buf.shape or (
                checks._dtype(x) if hasattr(x, "dtype") else None) != buf.dtype:
            checks.check_array(name, x, tuple((f"d{i}", s) for i, s in enumerate(buf.shape)),
                               dtypes=(buf.dtype,))
        _upload(buf, x)

    def step(self, q=None, k_new=None, v_new=None, *, return_lse=False, sync=None):
        """Append this token's K/V, attend, advance.

        q:            [M, H, D] of ``q_dtype`` (None: the ``q`` buffer as it is)
        k_new, v_new: [M, H_kv, D] of the cache dtype (rows of done sequences
                      are ignored; None: the buffers as they are)
        sync:         wait for the step and ``check()`` the capacity (default:
                      True when q is numpy)
        Returns out [M, H, D] float32 (and lse [M, H] with ``return_lse``):
        numpy copies when q is numpy, else the device buffers ``out`` /
        ``lse`` (overwritten by the next step). Done sequences get zeros (LSE
        -inf). A synchronising step raises ``checks.RangeError`` when a live
        sequence was already full (module docstring).
        """
        self._fill("q", self.q, q)
        self._fill("k_new", self.k_new, k_new)
        self._fill("v_new", self.v_new, v_new)
        host = is_host_array(q)
        sync = host if sync is None else bool(sync)
        if self.graph is not None:
            self._graph.launch()
        else:
            self.enqueue(0)
        if sync:
            self.check()
        if host:
            result = (to_host(self.out), to_host(self.lse))
        else:
            result = (self.out, self.lse)
        return result if return_lse else result[0]

    def check(self):
        """Raise ``checks.RangeError`` if a step since the last check met a live
        sequence outside the capacity (it was neither written nor attended);
        clears the flag. Waits for the work queued so far and reads two ints."""
        self.synchronize()
        host = to_host(self._flag)
        raised, first = int(host[ERR_COUNT]), int(host[ERR_FIRST])
        if raised:
            self._flag.copy_to_device(fast.clear_flag())
            length = int(to_host(self.d_lengths)[first])
            raise checks.RangeError(
                f"step: sequence {first} holds {length} positions, outside what the cache's "
                f"capacity max_seq={self.max_seq} lets a step append to (lengths in "
                f"[0, {self.max_seq - 1}]): at a step since the last check its row was not "
                f"written, it attended nothing (output zeros) and its length did not advance "
                f"({raised} such sequence-step(s))")

    def synchronize(self):
        self._graph.synchronize()

    # -- lengths, done mask, seeding the cache -------------------------------

    @property
    def lengths(self):
        """Host copy of the cached lengths ``[M]`` int32 (waits for queued steps)."""
        self.synchronize()
        return to_host(self.d_lengths)

    @property
    def done(self):
        """Host copy of the done mask ``[M]`` bool."""
        return self._done.copy()

    def _set_done(self, mask):
        self.synchronize()
        self._done = np.asarray(mask, bool).copy()
        self._d_done.copy_to_device(self._done.astype(np.int32))

    def finish(self, m):
        """Mark sequence ``m`` done: from now on it is neither read nor written."""
        checks.check_range("m", int(m), 0, self.m - 1, what="sequence index")
        mask = self._done.copy()
        mask[int(m)] = True
        self._set_done(mask)

    def restart(self, m, length=0):
        """Make sequence ``m`` live again with ``length`` cached positions."""
        checks.check_range("m", int(m), 0, self.m - 1, what="sequence index")
        checks.check_range("length", int(length), 0, self.max_seq, what="length")
        mask = self._done.copy()
        mask[int(m)] = False
        self._set_done(mask)
        lens = to_host(self.d_lengths)
        lens[int(m)] = int(length)
        self.d_lengths.copy_to_device(lens)

    def set_lengths(self, lengths):
        """Set every sequence's cached length (``[M]`` ints in [0, max_seq])
        without touching the caches or the done mask."""
        lens = checks.check_lengths("lengths", host_ints(lengths), self.max_seq, count=self.m)
        self.synchronize()
        self.d_lengths.copy_to_device(lens.astype(np.int32))

    def load(self, k_cache, v_cache, lengths, *, k_scale=None, v_scale=None):
        """Replace the caches' contents and set the lengths (all sequences live).

        k_cache, v_cache: [KV_SLOTS, H_kv, max_seq, D] of the state's dtype
        (numpy or device; fp8: uint8 e4m3 codes); lengths: [M] ints in [0, max_seq].
        k_scale, v_scale: fp8 states only, float32 of ``scale_shape``: the
        codes' scales, copied into the state's ``k_scale`` / ``v_scale``;
        required with "token_head" scales ([KV_SLOTS, H_kv, max_seq]),
        optional with "tensor" ([1]: None keeps the state's). Everything is
        checked before anything is written.
        """
        dims = tuple(zip(("KV_SLOTS", "H_kv", "max_seq", "D"), self.cache_shape))
        checks.check_array("k_cache", k_cache, dims, dtypes=(self.dtype,))
        checks.check_array("v_cache", v_cache, dims, dtypes=(self.dtype,))
        lens = checks.check_lengths("lengths", host_ints(lengths), self.max_seq, count=self.m)
        scales = self._loaded_scales(k_scale, v_scale)
        self.synchronize()
        _upload(self.k_cache, k_cache)
        _upload(self.v_cache, v_cache)
        for dst, src in scales:
            _upload(dst, src)
        self.d_lengths.copy_to_device(lens.astype(np.int32))
        self._set_done(np.zeros(self.m, bool))
        return self

    def _loaded_scales(self, k_scale, v_scale):
        """``load``'s scale arguments checked: [(state buffer, given), ...]."""
        if not self.fp8:
            if k_scale is not None or v_scale is not None:
                raise checks.AttentionInputError(
                    "k_scale, v_scale: only fp8 states (dtype uint8 / 'float8_e4m3fn') take "
                    "scales")
            return []
        if self.fp8_scales == "token_head" and (k_scale is None or v_scale is None):
            raise checks.AttentionInputError(
                f"k_scale, v_scale: loading an fp8 cache with per-(token, head) scales needs "
                f"both (float32 [KV_SLOTS, H_kv, max_seq] = {list(self.scale_shape)})")
        pairs = []
        for name, given, buf in (("k_scale", k_scale, self.k_scale),
                                 ("v_scale", v_scale, self.v_scale)):
            if given is not None:
                self._check_scale_array(name, given)
                pairs.append((buf, given))
        return pairs

    def prefill(self, k, v, lengths):
        """Write positions ``0..lengths[m]-1`` of each sequence's slot and set
        the lengths (all sequences live).

        k, v: host [M, H_kv, L, D] arrays of the state's dtype with
        L >= max(lengths); lengths: [M] ints in [0, max_seq]. Other positions
        and slots are left as they are. fp8 states: rows of ``new_dtype``,
        quantized by the same append as a step's (``fp8_cache.fp8_append``,
        one launch a sequence), their per-(token, head) scales written too.
        """
        lens = checks.check_lengths("lengths", host_ints(lengths), self.max_seq, count=self.m)
        longest = int(lens.max()) if lens.size else 0
        for name, x in (("k", k), ("v", v)):
            shape = checks.check_array(
                name, x, (("M", self.m), ("H_kv", self.n_kv_heads), ("L", None),
                          ("D", self.head_dim)), dtypes=(self.new_dtype,))
            if shape[2] < longest:
                raise checks.ShapeError(
                    f"{name}: expected at least L={longest} positions (the longest length), "
                    f"got {shape[2]}")
        self.synchronize()
        k, v = np.asarray(k), np.asarray(v)
        for m in range(self.m):
            slot, length = int(self.slot_table[m]), int(lens[m])
            if length == 0:
                continue
            if self.fp8:
                rows = [np.ascontiguousarray(x[m:m + 1, :, :length].transpose(0, 2, 1, 3))
                        for x in (k, v)]  # [1, T, H_kv, D]
                kw = ({"k_scale": self.k_scale, "v_scale": self.v_scale}
                      if self.fp8_scales == "tensor" else
                      {"k_scales": self.k_scale, "v_scales": self.v_scale})
                fp8_cache.fp8_append(*rows, self.k_cache, self.v_cache,
                                     np.array([[slot]], np.int32), np.zeros(1, np.int32),
                                     defect=self._append_defect, **kw)
                continue
            for g in range(self.n_kv_heads):
                _upload(self.k_cache[slot, g, :length], k[m, g, :length])
                _upload(self.v_cache[slot, g, :length], v[m, g, :length])
        self.d_lengths.copy_to_device(lens.astype(np.int32))
        self._set_done(np.zeros(self.m, bool))
        return self
