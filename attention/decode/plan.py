"""Decode attention planned once, run many times: ``DecodePlan``.

A decode step calls attention with the same geometry every time: the batch
(M, H, H_kv, D), the pooled cache (KV_SLOTS, max_seq) and the dtypes. A
``DecodePlan`` does everything that depends only on those once, when it is
made:

* chooses the kernel and the split count (``method``: the CUDA-core kernel,
  ``attention.decode.fast.plan``, or, for multi-token plans of 16-bit caches,
  the tensor-core one, ``attention.decode.mma.plan``);
* compiles the main kernel (and, with more than one split, the combine) for
  the plan's argument types and takes their ``cuda.core`` kernel handles;
* sets the dynamic shared memory opt-in of the main kernel's function;
* allocates the split-KV scratch, the default ``out`` / ``lse`` buffers, an
  identity slot table and the device error flag;
* builds the launch argument lists in numba's packed form
  (``attention.core.launch.ArgTemplate``: for an array, ``meminfo 0,
  parent 0, size, itemsize, data pointer, shape..., strides in bytes...``;
  scalars as ctypes values), in which only
  the data pointers change from one call to the next.

``run(...)`` then only checks what is cheap on the host (shapes, dtypes,
contiguity, 16-byte alignment where the kernel reads vector rows), writes the
arrays' data pointers into the prebuilt lists and enqueues the launches
through ``cuda.core.launch`` (the combine as a programmatic dependent where
the plan has ``pdl``). It makes no host-device copy, no allocation and no
synchronisation. Lengths and slots are checked on the device by the main
kernel (``fast_decode_kernel``; on the tensor-core path by the checked form of
``mma.mma_decode_kernel``, whose blocks read their sequence's length, slot or
page entries first: a bad sequence is attended as
empty, nothing is read out of bounds, and the plan's error flag counts it); ``check()``
synchronises, reads and clears the flag and raises ``RangeError`` naming
``seq_lens`` or ``slot_table``.

On the CUDA simulator there is no ``cuda.core`` launch: ``run`` launches the
same kernels through numba (``launch_path`` / ``launch_reason`` say which path
runs and why). On a machine with neither, a plan can be made and validates
arguments, and ``run`` raises ``RuntimeError`` after its checks.

Array arguments: torch CUDA tensors (float32, float16, bfloat16, int32),
numba device arrays, and any object with ``__cuda_array_interface__``
(a 2-byte void typestr, ``|V2``, as torch exports bfloat16, is read as
bfloat16 where the plan expects bfloat16).

Layouts (C-contiguous, device memory):
    q           [M, H, D]                     float32 or the cache's dtype
    k_cache     [KV_SLOTS, H_kv, max_seq, D]  float32 / float16 / bfloat16
    v_cache     [KV_SLOTS, H_kv, max_seq, D]  same dtype
    seq_lens    [M] int32, slot_table [M] int32 (None: sequence m in slot m)
    out         [M, H, D] float32, lse [M, H] float32
Paged plans (``page_size=P``): k_cache / v_cache [num_pages, H_kv, P, D] ("HND") or
[num_pages, P, H_kv, D] ("NHD"), page_table [M, ceil(max_seq / P)] int32 in the slot
table's place. Multi-token plans (``t_q=T``): q and out [M, T, H, D], lse [M, T, H].
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import cuda

from attention.core import checks
from attention.core.device import (
    BFLOAT16,
    SIMULATOR,
    SMEM_STATIC_LIMIT,
    device_empty,
    gpu_available,
)
from attention.core.launch import ArgTemplate, array_ptr, core_stream
from attention.decode import fast
from attention.decode import mma as MMA

METHODS = ("auto", "fast", "mma")
_INT32 = np.dtype(np.int32)
PLAN_DEFECTS = ("chunk_follows_batch",)  # planted in the plan itself (``defect=``)
_FLOAT32 = np.dtype(np.float32)

# how run() reads an argument, by its Python type (filled as types are met)
_TORCH, _NUMBA, _CAI, _SIM = 1, 2, 3, 4
_KIND_OF_TYPE = {}
_TORCH_DTYPES = {}  # torch dtype -> numpy dtype (filled when torch is first met)
_TYPESTR_DTYPES = {}  # __cuda_array_interface__ typestr -> numpy dtype


def as_dtype(name, dt):
    """numpy dtype of ``dt`` (numpy dtype, type, string, or torch dtype)."""
    try:
        return np.dtype(dt)
    except TypeError:
        text = str(dt).replace("torch.", "")
        try:
            return np.dtype(text)
        except TypeError:
            raise checks.DTypeError(f"{name}: expected a dtype, got {dt!r}") from None


def _kind_of(x):
    t = type(x)
    kind = _KIND_OF_TYPE.get(t)
    if kind is None:
        if SIMULATOR:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            kind = _SIM if isinstance(x, FakeCUDAArray) else 0
        elif cuda.cudadrv.devicearray.is_cuda_ndarray(x):
            kind = _NUMBA
        elif t.__module__.startswith("torch") and hasattr(x, "data_ptr"):
            kind = _TORCH
            _fill_torch_dtypes()
        elif hasattr(x, "__cuda_array_interface__"):
            kind = _CAI
        else:
            kind = 0
        _KIND_OF_TYPE[t] = kind
    return kind


def _fill_torch_dtypes():
    if _TORCH_DTYPES:
        return
    import torch

    _TORCH_DTYPES.update({torch.float32: _FLOAT32, torch.float16: np.dtype(np.float16),
                          torch.int32: _INT32, torch.int64: np.dtype(np.int64),
                          torch.float64: np.dtype(np.float64)})
    if BFLOAT16 is not None:
        _TORCH_DTYPES[torch.bfloat16] = BFLOAT16
    _TORCH_DTYPES[torch.uint8] = np.dtype(np.uint8)
    if hasattr(torch, "float8_e4m3fn"):  # fp8 caches: e4m3 codes, read as uint8
        _TORCH_DTYPES[torch.float8_e4m3fn] = np.dtype(np.uint8)


def _dtype_name(x):
    return str(getattr(x, "dtype", type(x).__name__)).replace("torch.", "")


def _shape_text(dims):
    return "[" + ", ".join(dims) + "]"


class _Spec:
    """What one array argument of a plan must be: name, shape, dtype, the
    alignment of its start, and the labels of its dimensions (messages)."""

    __slots__ = ("name", "shape", "dtype", "align", "dims")

    def __init__(self, name, shape, dtype, align, labels):
        self.name, self.shape, self.dtype, self.align = name, tuple(shape), dtype, align
        self.dims = _shape_text(f"{lab}={n}" for lab, n in zip(labels, shape))

    def fail_shape(self, shape):
        raise checks.ShapeError(
            f"{self.name}: expected shape {self.dims} (the plan's), got {tuple(shape)}")

    def fail_dtype(self, got):
        raise checks.DTypeError(
            f"{self.name}: expected dtype {self.dtype} (the plan's), got {got}")

    def fail_layout(self):
        raise checks.LayoutError(f"{self.name}: expected a C-contiguous array of shape "
                                 f"{self.dims}")

    def fail_align(self, ptr):
        raise checks.LayoutError(f"{self.name}: expected a device address aligned to "
                                 f"{self.align} bytes (vector loads), got {ptr:#x}")

    def fail_kind(self, x):
        if isinstance(x, np.ndarray):
            raise checks.LayoutError(
                f"{self.name}: expected a device array, got a numpy array (DecodePlan.run "
                "copies nothing; attention.decode(...) stages numpy inputs)")
        raise checks.DTypeError(
            f"{self.name}: expected a device array (torch CUDA tensor, numba device array or "
            f"__cuda_array_interface__), got {type(x).__name__}")


def pointer(spec, x):
    """The data pointer of device array ``x`` after checking it against
    ``spec`` (shape, dtype, C-contiguity, alignment); named errors otherwise."""
    kind = _kind_of(x)
    if kind == _TORCH:
        if not x.is_cuda:
            raise checks.LayoutError(f"{spec.name}: expected a CUDA tensor, got one on "
                                     f"{x.device}")
        if x.shape != spec.shape:
            spec.fail_shape(x.shape)
        dt = _TORCH_DTYPES.get(x.dtype)
        if dt != spec.dtype:
            spec.fail_dtype(_dtype_name(x))
        if not x.is_contiguous():
            spec.fail_layout()
        ptr = x.data_ptr()
    elif kind == _NUMBA:
        if x.shape != spec.shape:
            spec.fail_shape(x.shape)
        if x.dtype != spec.dtype:
            spec.fail_dtype(x.dtype)
        if not x.is_c_contiguous():
            spec.fail_layout()
        ptr = x.device_ctypes_pointer.value or 0
    elif kind == _CAI:
        cai = x.__cuda_array_interface__
        shape = tuple(cai["shape"])
        if shape != spec.shape:
            spec.fail_shape(shape)
        typestr = cai["typestr"]
        dt = _TYPESTR_DTYPES.get(typestr)
        if dt is None:
            dt = np.dtype(typestr)
            if dt.kind == "V" and dt.itemsize == 2 and BFLOAT16 is not None:
                dt = BFLOAT16  # bfloat16 as torch and others export it
            _TYPESTR_DTYPES[typestr] = dt
        if dt != spec.dtype:
            spec.fail_dtype(dt)
        strides = cai.get("strides")
        if strides is not None and not checks._is_c_contiguous(x):
            spec.fail_layout()
        ptr = int(cai["data"][0])
    else:
        spec.fail_kind(x)
    if ptr & (spec.align - 1):
        spec.fail_align(ptr)
    return ptr


def check_sim_array(spec, x):
    """The simulator's form of ``pointer``: the same checks, no pointer."""
    if _kind_of(x) != _SIM:
        spec.fail_kind(x)
    if tuple(x.shape) != spec.shape:
        spec.fail_shape(x.shape)
    if np.dtype(x.dtype) != spec.dtype:
        spec.fail_dtype(x.dtype)
    if not x.is_c_contiguous():
        spec.fail_layout()
    return x


class DecodePlan:
    """Batched decode attention over a pooled KV cache, planned once.

    m:            M, sequences a call serves (>= 1)
    n_heads:      H, query heads; n_kv_heads: H_kv (divides H)
    head_dim:     D, in [1, 256]
    kv_slots:     KV_SLOTS of the cache (>= M); max_seq: its capacity
    cache_dtype:  float32, float16 or bfloat16 (numpy / torch dtype or name), or
                  fp8 e4m3: ``np.uint8`` / "float8_e4m3fn" (codes as uint8,
                  ``attention.cache.fp8``; sm_89 and later), run with scales
                  ``k_scale`` / ``v_scale`` (K = code * scale; ``fp8_scales``)
    fp8_scales:   fp8 caches: "tensor" (default): ``k_scale`` / ``v_scale`` are
                  float32 [1] (each score times the K scale, the output times the
                  V scale); "token_head": a float32 scale a cached row, in the
                  cache's layout without D (pooled ``[KV_SLOTS, H_kv, max_seq]``,
                  HND ``[num_pages, H_kv, P]``, NHD ``[num_pages, P, H_kv]``, as
                  ``attention.cache.fp8.fp8_append`` writes them): the CUDA-core
                  kernel dequantizes each K / V row in registers, code * its
                  scale (fp32); the tensor-core one multiplies each score by its
                  row's K scale and folds the V scales into P, normalised a row
                  (``attention.decode.mma``). Fixed at construction (the kernel
                  is compiled for it)
    q_dtype:      float32 or the cache's dtype (default: the cache's); with fp8,
                  float32, float16 or bfloat16 (default float32)
    max_len:      the longest sequence a call may hold (default: max_seq); the
                  split plan covers ``limit >= max_len`` positions and the device
                  check flags any length past ``limit``
    scale:        default 1/sqrt(D)
    n_split:      KV chunks a sequence (default: sized to fill the GPU)
    page_size:    None (a pooled cache: sequence m reads slot ``slot_table[m]``)
                  or P >= 1: a paged cache of ``kv_slots`` pages of P positions,
                  read through a page table ``[M, ceil(max_seq / P)]`` int32;
                  ``max_seq`` is then the most positions a sequence may hold
    layout:       a paged cache's layout: "HND" (default) ``[num_pages, H_kv, P,
                  D]``, or "NHD" ``[num_pages, P, H_kv, D]``. HND is the default
                  because it is the pooled cache's layout (the pooled cache is
                  the case P = max_seq with one page a sequence) and keeps a
                  page's rows of one kv head contiguous (P * D elements), which a
                  block streams; NHD is vLLM's and FlashInfer's default
    batch_invariant: split every sequence in chunks of a fixed number of
                  positions (``fast.invariant_chunk`` / ``mma.invariant_chunk``,
                  the kernel's: from the geometry, the capacity and the GPU, not
                  the batch) instead of a split count
                  sized to the batch, so that a sequence's output and LSE are
                  bit-identical whatever else the batch holds (the splits are
                  merged in a fixed order). Not with ``n_split``. An option, not
                  the default: on the H200 (``bench/paged.py``, fp16 / bf16) it
                  costs the fast kernel +23..25 % at B 32 / L 4096 (one split
                  becomes 16 and a combine) and +1 % at B 1 / L 32768 (32 splits
                  either way); the tensor-core kernel's cost is not measured yet
    t_q:          T, new queries a sequence in each run, 1 .. ``fast.MAX_T_Q``
                  (multi-token decode: speculative or multi-token-prediction
                  steps). With T > 1, q is ``[M, T, H, D]``, out ``[M, T, H, D]``
                  and lse ``[M, T, H]``; query i of sequence m attends positions
                  ``0 .. seq_lens[m] - T + i`` (the length counts the T new
                  tokens, already in the cache: ``paged_append`` /
                  ``kv_scatter`` first). A length of 1 .. T - 1 is flagged on the
                  device (``check()`` names ``seq_lens``); 0 is an empty sequence.
                  Cost: one block a query reads the same K/V (memory once, L2
                  the rest), but each does a query's arithmetic on CUDA cores:
                  T = 4 takes 3.1x the time of T = 1 at B 32 / L 4096 fp16 on the
                  H200 (``bench/paged.py``); the T queries of a kv group as one
                  16-row tensor-core tile is the way to the 1.2x of K/V reads
    method:       "auto" (default), "fast" or "mma". "fast": the CUDA-core
                  kernel (``attention.decode.fast``), every dtype and option.
                  "mma": the tensor-core kernel (``attention.decode.mma``: the
                  T queries x H / H_kv heads of a kv group as the rows of one
                  16-row ``mma`` tile, so K/V are read once for all T queries
                  and T adds no mma): 16-bit caches with q in the cache's dtype,
                  or fp8 e4m3 caches with either scale mode and q float16 (the
                  codes converted to f16 in registers as ``ldmatrix`` gives
                  them: on the H200 it took 89.8 us against the CUDA-core
                  kernel's 122.9 at T = 1, B 32 / L 4096, notes/bench.md),
                  D in 32, 64, 128, H / H_kv x T <= 16, batch-invariant plans
                  too (a fixed chunk: ``mma.invariant_chunk``); P is rounded to the
                  cache's dtype before P.V, as FlashAttention and FlashInfer do
                  (the validation judges it by the rounded-P baseline); a
                  plan it cannot take raises naming the reason. "auto": "mma"
                  where it can take the plan and T > 1 or the cache is fp8
                  (q float16), else "fast". On the
                  H200 (notes/bench.md run 20, B 32 / H 32 / H_kv 8 / D 128 /
                  L 4096 fp16) T = 4 took 154.5 us on the tensor-core kernel
                  (1.03x its T = 1) and 406.2 us on the CUDA-core one, which
                  stays the faster at T = 1 (129.5 against 149.5 us)
    defect:       a planted defect (falsification suite only): the fast
                  kernel's (``fast.DEFECTS``, ``fast.PAGED_DEFECTS``), the
                  tensor-core kernel's (``mma.ALL_DEFECTS``, with ``method="mma"``)
                  or the plan's own ``PLAN_DEFECTS``: "chunk_follows_batch", a
                  batch-invariant plan whose split length is the default plan's
                  for its M (so the merge follows the batch)

    Attributes: ``method`` ("fast" or "mma": the kernel chosen), ``fast_plan``
    (the ``attention.decode.fast.plan`` dict; None on the tensor-core path),
    ``kernel_plan`` (the chosen kernel's plan dict), ``n_split``, ``limit``,
    ``out`` [M, H, D] / ``lse`` [M, H] (the default output buffers,
    overwritten by every run that is given none), ``flag`` (int32
    [fast.ERR_WORDS] device error flag), ``launch_path`` ("cuda.core",
    "numba" or "none"), ``launch_reason``, ``registers`` (the main kernel's
    registers a thread where the plan compiled it for a GPU, else None),
    ``fp8_scales`` and ``scale_shape`` (the shape ``k_scale`` / ``v_scale``
    must have: ``(1,)``, or the cache's shape without D).

    A plan belongs to the device current when it was made. ``run`` is not
    thread-safe (it writes pointers into the plan's argument lists).
    """

    def __init__(self, m, n_heads, n_kv_heads, head_dim, kv_slots, max_seq, *,
                 cache_dtype=np.float16, q_dtype=None, max_len=None, scale=None,
                 n_split=None, page_size=None, layout="HND", batch_invariant=False,
                 t_q=1, defect=None, fp8_scales="tensor", method="auto"):
        m, n_heads, n_kv, head_dim = int(m), int(n_heads), int(n_kv_heads), int(head_dim)
        kv_slots, max_seq = int(kv_slots), int(max_seq)
        checks.check_range("m", m, 1, 1 << 30, what="sequence count")
        checks.check_heads(n_heads, n_kv, q_name="n_heads", kv_name="n_kv_heads")
        checks.check_head_dim("head_dim", head_dim)
        checks.check_range("max_seq", max_seq, 1, 1 << 30, what="cache capacity")
        t_q = int(t_q)
        checks.check_range("t_q", t_q, 1, fast.MAX_T_Q, what="queries a sequence")
        if t_q > max_seq:
            raise checks.RangeError(
                f"t_q: expected at most max_seq={max_seq} queries a sequence, got {t_q}")
        if page_size is not None:
            checks.check_range("page_size", int(page_size), 1, 1 << 30, what="page size")
            if layout not in ("HND", "NHD"):
                raise checks.LayoutError(
                    f"layout: expected 'HND' ([num_pages, H_kv, P, D]) or 'NHD' "
                    f"([num_pages, P, H_kv, D]), got {layout!r}")
            checks.check_range("kv_slots", kv_slots, 1, 1 << 31 - 1, what="page count")
        elif kv_slots < m:
            raise checks.RangeError(f"kv_slots: expected KV_SLOTS >= m={m}, got {kv_slots}")
        if batch_invariant and n_split is not None:
            raise checks.AttentionInputError(
                "n_split: a batch-invariant plan fixes its chunk length; give no n_split")
        max_len = max_seq if max_len is None else int(max_len)
        checks.check_range("max_len", max_len, 1, max_seq, what="longest length")
        if n_split is not None:
            checks.check_range("n_split", int(n_split), 1, 1 << 16, what="split count")
        cdt = _fp8_name(cache_dtype) or as_dtype("cache_dtype", cache_dtype)
        if cdt not in fast.CACHE_DTYPES + (fast.FP8_DTYPE,):
            raise checks.DTypeError(
                f"cache_dtype: expected float32, float16, bfloat16 or fp8 e4m3 (uint8 codes, "
                f"'float8_e4m3fn'), got {cdt}")
        kind = fast.dtype_kind(cdt, fp8=True)
        if kind == "f8":
            qdt = _FLOAT32 if q_dtype is None else as_dtype("q_dtype", q_dtype)
            if qdt not in fast.CACHE_DTYPES:
                raise checks.DTypeError(
                    f"q_dtype: expected float32, float16 or bfloat16 with an fp8 cache, got {qdt}")
            if not fast.fp8_capable():
                raise checks.DTypeError(
                    "cache_dtype: fp8 e4m3 caches need a GPU of compute capability 8.9 or "
                    "later (cvt.rn.f16x2.e4m3x2)")
        else:
            qdt = cdt if q_dtype is None else as_dtype("q_dtype", q_dtype)
            if qdt not in (_FLOAT32, cdt):
                raise checks.DTypeError(
                    f"q_dtype: expected float32 or the cache's {cdt}, got {qdt}")
        if fp8_scales not in fast.FP8_SCALES:
            raise checks.AttentionInputError(
                f"fp8_scales: expected one of {fast.FP8_SCALES}, got {fp8_scales!r}")
        if fp8_scales != "tensor" and kind != "f8":
            raise checks.AttentionInputError(
                f"fp8_scales: {fp8_scales!r} needs an fp8 cache (cache_dtype uint8 / "
                f"'float8_e4m3fn'), got cache_dtype {cdt}")
        if (defect in fast.FP8_TOKEN_DEFECTS + MMA.FP8_TOKEN_DEFECTS
                and fp8_scales != "token_head"):
            raise checks.AttentionInputError(
                f"defect: {defect!r} needs fp8_scales='token_head'")
        if method not in METHODS:
            raise checks.AttentionInputError(
                f"method: expected one of {METHODS}, got {method!r}")
        why = _mma_unsupported(kind, cdt, qdt, head_dim, n_heads // n_kv, t_q,
                               batch_invariant, defect, method, fp8_scales)
        if method == "auto":
            method = "mma" if why is None and (t_q > 1 or kind == MMA.FP8_KIND) else "fast"
        elif method == "mma" and why is not None:
            raise checks.AttentionInputError(
                f"method: 'mma' (the tensor-core decode) cannot take this plan: {why}")
        if (method == "fast" and defect in MMA.ALL_DEFECTS
                and defect not in fast.DEFECTS + fast.FP8_DEFECTS):
            raise checks.AttentionInputError(
                f"defect: {defect!r} is a switch of the tensor-core kernel: give method='mma'")
        self.method = method
        self.fp8_scales = fp8_scales
        self.scale = checks.check_scale(scale, head_dim)
        self.m, self.n_heads, self.n_kv_heads, self.head_dim = m, n_heads, n_kv, head_dim
        self.kv_slots, self.max_seq, self.max_len = kv_slots, max_seq, max_len
        self.cache_dtype, self.q_dtype, self.kind = cdt, qdt, kind
        self.t_q = t_q
        lead = (m, t_q) if t_q > 1 else (m,)
        self.out_shape, self.lse_shape = lead + (n_heads, head_dim), lead + (n_heads,)
        # the kernel's view: the T queries' heads as T * H rows
        self._kernel_q, self._kernel_lse = (m, t_q * n_heads, head_dim), (m, t_q * n_heads)

        self.paged = page_size is not None
        self.page_size = int(page_size) if self.paged else max_seq
        self.layout = layout if self.paged else "HND"
        self.batch_invariant = bool(batch_invariant)
        paging = self.layout if self.paged else None
        if defect is not None and defect not in PLAN_DEFECTS:
            (MMA if method == "mma" else fast).check_defect(defect)
        chunk = None
        mma_scales = fp8_scales if kind == MMA.FP8_KIND else "tensor"
        if self.batch_invariant and method == "mma":
            chunk = MMA.invariant_chunk(n_heads, n_kv, head_dim, max_len, kind, t_q=t_q,
                                        scales=mma_scales)
            if defect == "chunk_follows_batch":
                chunk = MMA.plan(m, n_heads, n_kv, head_dim, max_len, kind, t_q=t_q,
                                 scales=mma_scales)["chunk"]
        elif self.batch_invariant:
            chunk = fast.invariant_chunk(n_heads, n_kv, head_dim, max_len, kind)
            if defect == "chunk_follows_batch":
                chunk = fast.plan(m, n_heads, n_kv, head_dim, max_len, kind)["chunk"]
        kernel_defect = None if defect in PLAN_DEFECTS else defect
        if method == "mma":
            pl = MMA.plan(m, n_heads, n_kv, head_dim, max_len, kind, t_q=t_q, n_split=n_split,
                          paging=paging, defect=kernel_defect, checked=True,
                          scales=mma_scales, chunk=chunk)
            self.fast_plan = None
        else:
            pl = fast.plan(m, n_heads, n_kv, head_dim, max_len, kind, n_split=n_split,
                           defect=kernel_defect, paging=paging, chunk=chunk, t_q=t_q,
                           fp8_scales=fp8_scales)
            self.fast_plan = pl
        self.kernel_plan = pl
        self.mma_plan = pl if method == "mma" else None
        self.n_split = pl["n_split"]
        P = self.page_size
        if self.paged:
            self.max_pages = -(-max_seq // P)
            self.limit = fast.range_limit(pl, self.max_pages * P)
            if layout == "HND":
                cache_shape, cache_dims = (kv_slots, n_kv, P, head_dim), (
                    "num_pages", "H_kv", "page_size", "D")
            else:
                cache_shape, cache_dims = (kv_slots, P, n_kv, head_dim), (
                    "num_pages", "page_size", "H_kv", "D")
            table = _Spec("page_table", (m, self.max_pages), _INT32, 1, ("M", "max_pages"))
        else:
            self.max_pages = 1
            self.limit = fast.range_limit(pl, max_seq)
            cache_shape = (kv_slots, n_kv, max_seq, head_dim)
            cache_dims = ("KV_SLOTS", "H_kv", "max_seq", "D")
            table = _Spec("slot_table", (m,), _INT32, 1, ("M",))
        # 16-byte row loads (the fast kernel's vector rows, the mma kernel's cp.async)
        align = 16 if method == "mma" or pl["vec"] > 1 else 1
        lab = ("M", "T") if t_q > 1 else ("M",)
        if fp8_scales == "token_head":  # the cache's layout without D
            scale_shape, scale_dims = cache_shape[:3], cache_dims[:3]
        else:
            scale_shape, scale_dims = (1,), ("1",)
        self.scale_shape = scale_shape
        self._specs = (
            _Spec("q", self.out_shape, qdt, align, lab + ("H", "D")),
            _Spec("k_cache", cache_shape, cdt, align, cache_dims),
            _Spec("v_cache", cache_shape, cdt, align, cache_dims),
            _Spec("seq_lens", (m,), _INT32, 1, ("M",)),
            table,
            _Spec("out", self.out_shape, _FLOAT32, 1, lab + ("H", "D")),
            _Spec("lse", self.lse_shape, _FLOAT32, 1, lab + ("H",)),
            _Spec("k_scale", scale_shape, _FLOAT32, 1, scale_dims),
            _Spec("v_scale", scale_shape, _FLOAT32, 1, scale_dims),
        )
        self.fp8 = kind == "f8"
        self._last = (None, None)  # (seq_lens, slot_table) of the last run
        self.registers = None  # the main kernel's registers a thread (cuda.core plans)
        self._streams = {}
        self._torch_out = None

        if SIMULATOR:
            self.launch_path = "numba"
            self.launch_reason = ("the simulator has no cuda.core launch: numba launches of "
                                  "the same kernels")
        elif not gpu_available():
            self.launch_path = "none"
            self.launch_reason = "no CUDA GPU: the plan validates arguments only"
            return
        else:
            self.launch_path = "cuda.core"
            self.launch_reason = ("prebuilt argument lists launched through cuda.core "
                                  "(no numba dispatch)")
        self._allocate()
        if self.launch_path == "cuda.core":
            self._build_launches()

    # -- set-up -------------------------------------------------------------

    def _allocate(self):
        m, h, d = self.m, self.n_heads, self.head_dim
        self.out = device_empty(self.out_shape, np.float32)
        self.lse = device_empty(self.lse_shape, np.float32)
        self.part_acc, self.part_ml = fast.scratch(m, self.t_q * h, d, self.n_split)
        self.flag = cuda.to_device(fast.clear_flag())
        self.identity_slots = cuda.to_device(np.arange(m, dtype=np.int32))
        if not SIMULATOR:
            cuda.synchronize()  # the copies above are complete before any run

    def _build_launches(self):
        from cuda.core import LaunchConfig
        from numba import types

        if self.method == "mma":
            self._build_mma_launches()
        else:
            self._build_fast_launch()
        pl = self.kernel_plan
        f32 = types.float32
        self._combine_kernel = None
        if self.n_split > 1:
            ck = fast.combine_kernel(-(-self.head_dim // fast.WARP), pl.get("pdl", False),
                                     fast.combine_switch(pl["defect"])
                                     if self.method == "fast" else None)
            ctypes_ = (types.Array(f32, 4, "C"), types.Array(f32, 4, "C"),
                       types.Array(f32, 3, "C"), types.Array(f32, 2, "C"))
            cfn = ck.compile(ctypes_)._codelibrary.get_cufunc()
            self._combine_kernel = cfn.kernel
            grid = (self.t_q * self.n_heads, self.m)
            block = fast.combine_warps(self.n_split) * fast.WARP
            self._combine_config = LaunchConfig(grid=grid, block=block)
            if pl.get("pdl", False):
                self._combine_pdl_config = LaunchConfig(
                    grid=grid, block=block, programmatic_stream_serialization=True)
            else:
                self._combine_pdl_config = self._combine_config
            c = ArgTemplate()
            c.add_array(self.part_acc.shape, 4, array_ptr(self.part_acc))
            c.add_array(self.part_ml.shape, 4, array_ptr(self.part_ml))
            cat = (c.add_array(self._kernel_q, 4, array_ptr(self.out)),
                   c.add_array(self._kernel_lse, 4, array_ptr(self.lse)))
            self._combine_args = c.words
            self._combine_at = cat
        from cuda.core import launch as core_launch

        try:
            from cuda.core.graph import GraphBuilder
        except ImportError:  # pragma: no cover - an older cuda.core
            GraphBuilder = ()
        self._core_launch = core_launch
        self._builder_type = GraphBuilder
        self._own_out, self._own_lse = array_ptr(self.out), array_ptr(self.lse)
        self._stream0 = core_stream(0, self._streams)

    def _compile_main(self, pl, argtypes, static_smem):
        """Compile plan ``pl``'s kernel for ``argtypes``: its ``cuda.core`` handle,
        registers, launch config and (past 48 KB) the dynamic shared memory opt-in."""
        from cuda.core import LaunchConfig

        compiled = pl["kernel"].compile(argtypes)
        fn = compiled._codelibrary.get_cufunc()
        self.registers = int(compiled.regs_per_thread)
        if static_smem + pl["dyn_smem"] > SMEM_STATIC_LIMIT:
            from cuda.bindings import driver as binding
            from numba.cuda.cudadrv import driver

            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.driver.cuKernelSetAttribute(attr, int(pl["dyn_smem"]), fn.handle,
                                               fn.device.id)
        self._main_kernel = fn.kernel
        self._main_config = LaunchConfig(grid=pl["grid"], block=pl["block"],
                                         shmem_size=int(pl["dyn_smem"]))

    def _build_fast_launch(self):
        """The fast kernel's compiled handle, launch config and argument list."""
        from numba import types

        pl = self.fast_plan
        elem = {"f32": types.float32, "f16": types.float16, "bf16": cuda.types.bfloat16,
                "f8": types.uint8}
        f32, i32 = types.float32, types.int32
        qe = elem[fast.dtype_kind(self.q_dtype)]
        cache = types.Array(elem[self.kind], 4, "C")
        argtypes = (types.Array(qe, 3, "C"), cache, cache, types.Array(i32, 1, "C"),
                    types.Array(i32, 2 if self.paged else 1, "C"), f32, i32,
                    types.Array(f32, 3, "C"),
                    types.Array(f32, 2, "C"), types.Array(f32, 4, "C"),
                    types.Array(f32, 4, "C"), types.Array(i32, 1, "C"))
        if self.fp8:
            nd = len(self.scale_shape)
            argtypes += (types.Array(f32, nd, "C"), types.Array(f32, nd, "C"))
        self._compile_main(pl, argtypes, pl["static_smem"])
        s = self._specs
        t = ArgTemplate()
        at = [t.add_array(self._kernel_q, s[0].dtype.itemsize)]
        at += [t.add_array(sp.shape, sp.dtype.itemsize) for sp in s[1:5]]
        t.add(ctypes.c_float(self.scale))
        t.add(ctypes.c_int32(pl["chunk"]))
        at.append(t.add_array(self._kernel_q, 4, array_ptr(self.out)))
        at.append(t.add_array(self._kernel_lse, 4, array_ptr(self.lse)))
        t.add_array(self.part_acc.shape, 4, array_ptr(self.part_acc))
        t.add_array(self.part_ml.shape, 4, array_ptr(self.part_ml))
        t.add_array((fast.ERR_WORDS,), 4, array_ptr(self.flag))
        if self.fp8:  # k_scale, v_scale pointers (set by each run)
            at.append(t.add_array(self.scale_shape, 4))
            at.append(t.add_array(self.scale_shape, 4))
        self._main_args = t.words
        self._main_at = tuple(at)  # q, k, v, lens, slots, out, lse pointer indices

    def _build_mma_launches(self):
        """The tensor-core kernel (``mma.mma_decode_kernel``, checked: the range
        check in its blocks): handle, config and argument list."""
        from numba import types

        pl = self.mma_plan
        u32, i32, f32 = types.uint32, types.int32, types.float32
        A = types.Array
        m, t_q, h, d = self.m, self.t_q, self.n_heads, self.head_dim
        s = self._specs
        cache_shape = s[1].shape
        table_shape = s[4].shape if self.paged else (m, 1)
        n_entries = self.kv_slots
        page = self.page_size
        argtypes = (A(u32, 4, "C"), A(u32, 1, "C"), A(u32, 1, "C"), A(i32, 1, "C"),
                    A(i32, 2, "C"), i32, i32, i32, i32, f32, i32, A(f32, 4, "C"),
                    A(f32, 3, "C"), A(f32, 4, "C"), A(f32, 4, "C"), i32, A(i32, 1, "C"))
        if self.fp8:  # k_scale, v_scale: [1], or token_head's flat [N]
            argtypes += (A(f32, 1, "C"), A(f32, 1, "C"))
        self._compile_main(pl, argtypes, 0)
        n_kv = self.n_kv_heads
        words = int(np.prod(cache_shape)) // (4 if self.fp8 else 2)
        shift = page.bit_length() - 1 if page & (page - 1) == 0 else -1
        t = ArgTemplate()
        at = [t.add_array((m, t_q, h, d // 2), 4), t.add_array((words,), 4),
              t.add_array((words,), 4), t.add_array((m,), 4), t.add_array(table_shape, 4)]
        for v in (n_kv, page, n_entries, shift):
            t.add(ctypes.c_int32(v))
        t.add(ctypes.c_float(self.scale))
        t.add(ctypes.c_int32(pl["chunk"]))
        at.append(t.add_array((m, t_q, h, d), 4, array_ptr(self.out)))
        at.append(t.add_array((m, t_q, h), 4, array_ptr(self.lse)))
        t.add_array(self.part_acc.shape, 4, array_ptr(self.part_acc))
        t.add_array(self.part_ml.shape, 4, array_ptr(self.part_ml))
        t.add(ctypes.c_int32(self.limit))
        t.add_array((fast.ERR_WORDS,), 4, array_ptr(self.flag))
        if self.fp8:  # k_scale, v_scale pointers (set by each run), viewed flat
            n_sc = int(np.prod(self.scale_shape))
            at.append(t.add_array((n_sc,), 4))
            at.append(t.add_array((n_sc,), 4))
        self._main_args = t.words
        self._main_at = tuple(at)  # q, k, v, lens, table, out, lse: the fast path's order

    # -- a call -------------------------------------------------------------

    def run(self, q, k_cache, v_cache, seq_lens, slot_table=None, *, page_table=None,
            out=None, lse=None, stream=None, sync=False, k_scale=None, v_scale=None):
        """Enqueue one decode; returns ``out``.

        q:          [M, H, D] the plan's q dtype (device array); [M, T, H, D]
                    with ``t_q = T > 1``
        k_cache:    [KV_SLOTS, H_kv, max_seq, D] the plan's cache dtype; paged:
                    [num_pages, H_kv, P, D] (HND) or [num_pages, P, H_kv, D] (NHD)
        v_cache:    the same shape and dtype
        seq_lens:   [M] int32, each in [0, limit] (checked on the device)
        slot_table: [M] int32, each in [0, KV_SLOTS) (checked on the device);
                    None: sequence m reads slot m. Pooled plans only
        page_table: paged plans: [M, max_pages] int32; the entries of the pages
                    below each length must be in [0, num_pages) (checked on the
                    device; entries past them are never read). A paged plan also
                    takes it in ``slot_table``'s place
        out, lse:   [M, H, D] / [M, H] ([M, T, H, D] / [M, T, H] with ``t_q``)
                    float32 device arrays; None: the plan's
                    ``out`` / ``lse`` (with torch q, ``out`` comes back as a torch
                    view of the plan's buffer)
        stream:     None or 0 (default stream), a numba, cuda.core or torch stream
        sync:       wait for the launches, then ``check()``
        k_scale, v_scale: fp8 plans only (required there): float32 device
                    arrays (K = e4m3 code * k_scale), read on the device by each
                    run: [1] (``fp8_scales`` "tensor"), or the cache's layout
                    without D ("token_head": ``scale_shape``, e.g. pooled
                    [KV_SLOTS, H_kv, max_seq], HND [num_pages, H_kv, P], NHD
                    [num_pages, P, H_kv]); a row's scale must be finite where
                    the row is attended
        No copy, allocation or synchronisation (unless ``sync``); a bad length or
        slot makes its sequence empty and is raised by ``check()``.
        """
        specs = self._specs
        if page_table is not None:
            if not self.paged:
                raise checks.AttentionInputError(
                    "page_table: this plan reads a pooled cache (made without page_size); "
                    "pass slot_table")
            slot_table = page_table
        elif slot_table is None and self.paged:
            raise checks.ShapeError(
                f"page_table: a paged plan needs a page table [M={self.m}, max_pages="
                f"{self.max_pages}] int32, got None")
        if (k_scale is None or v_scale is None) if self.fp8 else (
                k_scale is not None or v_scale is not None):
            raise checks.AttentionInputError(
                f"k_scale, v_scale: an fp8 plan needs both (float32 "
                f"{self._specs[7].dims} device arrays)"
                if self.fp8 else "k_scale, v_scale: only fp8 plans take scales")
        if self.launch_path != "cuda.core":
            return self._run_other(q, k_cache, v_cache, seq_lens, slot_table, out, lse,
                                   stream, sync, k_scale, v_scale)
        a = self._main_args
        at = self._main_at
        a[at[0]] = pointer(specs[0], q)
        a[at[1]] = pointer(specs[1], k_cache)
        a[at[2]] = pointer(specs[2], v_cache)
        lens_ptr = pointer(specs[3], seq_lens)
        if slot_table is None:
            slot_table = self.identity_slots
        table_ptr = pointer(specs[4], slot_table)
        a[at[4]] = table_ptr
        out_ptr = self._own_out if out is None else pointer(specs[5], out)
        lse_ptr = self._own_lse if lse is None else pointer(specs[6], lse)
        a[at[5]] = out_ptr
        a[at[6]] = lse_ptr
        if self.fp8:
            a[at[7]] = pointer(specs[7], k_scale)
            a[at[8]] = pointer(specs[8], v_scale)
        st = self._stream0 if stream is None else core_stream(stream, self._streams)
        launch = self._core_launch
        a[at[3]] = lens_ptr
        launch(st, self._main_config, self._main_kernel, *a)
        if self._combine_kernel is not None:
            c = self._combine_args
            c[self._combine_at[0]] = out_ptr
            c[self._combine_at[1]] = lse_ptr
            cfg = (self._combine_config if isinstance(st, self._builder_type)
                   else self._combine_pdl_config)
            launch(st, cfg, self._combine_kernel, *c)
        self._last = (seq_lens, slot_table)
        if sync:
            self.check()
        if out is None:
            out = self._torch_view() if _kind_of(q) == _TORCH else self.out
        return out

    def _torch_view(self):
        if self._torch_out is None:
            import torch

            self._torch_out = torch.as_tensor(self.out, device="cuda")
        return self._torch_out

    def _run_other(self, q, k_cache, v_cache, seq_lens, slot_table, out, lse, stream, sync,
                   k_scale=None, v_scale=None):
        """The simulator's run (numba launches of the same kernels) and the
        no-GPU plan's (checks, then RuntimeError)."""
        s = self._specs
        if self.launch_path == "none":
            for spec, x in zip(s, (q, k_cache, v_cache, seq_lens, slot_table, out, lse,
                                   k_scale, v_scale)):
                if x is not None:
                    pointer(spec, x)
            raise RuntimeError(f"DecodePlan.run: {self.launch_reason}")
        if slot_table is None:
            slot_table = self.identity_slots
        args = [check_sim_array(sp, x) for sp, x in zip(s[:5], (q, k_cache, v_cache,
                                                                seq_lens, slot_table))]
        d_out = self.out if out is None else check_sim_array(s[5], out)
        d_lse = self.lse if lse is None else check_sim_array(s[6], lse)
        scales = None
        if self.fp8:
            scales = (check_sim_array(s[7], k_scale), check_sim_array(s[8], v_scale))
        st = 0 if stream is None else stream
        if self.method == "mma":
            d_q, d_k, d_v, d_lens, d_table = args
            lead = (self.m, self.t_q, self.n_heads)
            MMA.launch(self.mma_plan, d_q.reshape(lead + (self.head_dim,)), d_k, d_v, d_lens,
                       d_table, self.scale, d_out.reshape(lead + (self.head_dim,)),
                       d_lse.reshape(lead), self.part_acc, self.part_ml, st,
                       limit=self.limit, d_err=self.flag,
                       d_k_scale=scales[0] if scales else None,
                       d_v_scale=scales[1] if scales else None)
        else:
            fast.launch(self.fast_plan, *args, self.scale, d_out, d_lse, self.part_acc,
                        self.part_ml, st, err=self.flag, scales=scales)
        self._last = (seq_lens, slot_table)
        if sync:
            self.check()
        return d_out

    def check(self):
        """Wait for the work queued so far, read the device error flag and clear
        it; ``RangeError`` naming ``seq_lens`` or ``slot_table``, the first
        flagged sequence, its value and the valid range, if a run since the
        last check met a length outside ``[0, limit]`` or a slot outside
        ``[0, KV_SLOTS)`` (those sequences were attended as empty)."""
        if self.launch_path == "none":
            return
        lens, slots = self._last
        fast.read_flag(self.flag, lens, slots, self.limit, self.kv_slots, paged=self.paged,
                       t_q=self.t_q)


def _mma_unsupported(kind, cdt, qdt, head_dim, group, t_q, batch_invariant, defect, method,
                     fp8_scales="tensor"):
    """None when the tensor-core decode can take the plan, else why not (for
    ``method="auto"`` a planted defect keeps the fast kernel)."""
    if kind == MMA.FP8_KIND:
        if qdt != np.dtype(np.float16):
            return f"q_dtype {qdt}: with an fp8 cache it takes q in float16"
    elif kind not in MMA.KINDS:
        return f"cache_dtype {cdt}: it takes float16, bfloat16 or fp8 e4m3 caches"
    elif qdt != cdt:
        return f"q_dtype {qdt}: it takes q in the cache's dtype ({cdt})"
    if head_dim not in MMA.HEAD_DIMS:
        return f"head_dim {head_dim}: it takes {MMA.HEAD_DIMS}"
    if group * t_q > MMA.TILE_ROWS:
        return (f"n_heads / n_kv_heads x t_q = {group} x {t_q}: it takes at most "
                f"{MMA.TILE_ROWS} query rows a kv head")
    if defect is not None and (method == "auto" or defect not in MMA.ALL_DEFECTS
                               + PLAN_DEFECTS):
        return f"defect {defect!r}: not one of its switches {MMA.ALL_DEFECTS}" if (
            method != "auto") else "a planted defect (give method= to choose its kernel)"
    return None


def _fp8_name(dt):
    """uint8 for the names and numpy dtype of fp8 e4m3 (codes stored as uint8),
    else None."""
    if isinstance(dt, str) and dt.replace("torch.", "") in ("float8_e4m3fn", "e4m3", "fp8"):
        return fast.FP8_DTYPE
    name = getattr(dt, "name", None) or str(dt)
    if "float8_e4m3fn" in str(name):
        return fast.FP8_DTYPE
    return None


def _array_dtype(x):
    cai = getattr(x, "__cuda_array_interface__", None) if not hasattr(x, "data_ptr") else None
    if isinstance(cai, dict):
        dt = np.dtype(cai["typestr"])
        return BFLOAT16 if dt.kind == "V" and dt.itemsize == 2 else dt
    return checks._dtype(x)
