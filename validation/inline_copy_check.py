"""Same PTX with and without ``attention.core.inline_copy`` (compile only).

    python -m validation.inline_copy_check [--names a,b] [--time]

Compiles kernels that inline many device functions (the fast decode's three
forms, the tensor-core decode (pooled fp16 and fp8, paged bf16), the tf32 and 16-bit
prefills, the MLA tensor-core kernel) for sm_90 in two processes, one with the shared-memo
IR copies installed and one with ``ATTN_INLINE_COPY=0``, and compares the PTX
text of each kernel. Exit status 1 if any differs (or the copies were not
installed where they should be). ``--time``: each process's compile seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time


def _kernels():
    """(name, thunk returning (py_func, argument types))."""
    from numba import types

    f32, i32, u32 = types.float32, types.int32, types.uint32
    arr = types.Array
    a1, a2 = arr(f32, 1, "C"), arr(f32, 2, "C")
    w1 = arr(u32, 1, "C")

    def fast(args, kw):
        from numba import cuda

        from attention.decode import fast as F

        elem = {"f32": f32, "f16": types.float16, "bf16": cuda.types.bfloat16}[args[5]]
        cache = arr(elem, 4, "C")
        sig = (arr(f32, 3, "C"), cache, cache, i32[::1], i32[::1], f32, i32, arr(f32, 3, "C"),
               a2, arr(f32, 4, "C"), arr(f32, 4, "C"), i32[::1])
        return F.plan(*args, **kw, pdl=False)["kernel"].py_func, sig

    def decode_mma(kind, paging):
        from attention.decode import mma

        k = mma.mma_decode_kernel(kind, 128, 4, 1, mma.WARPS, mma.STAGES, paging, None)
        return k.py_func, (arr(u32, 4, "C"), w1, w1, arr(i32, 1, "C"), arr(i32, 2, "C"), i32,
                           i32, i32, i32, f32, i32, arr(f32, 4, "C"), arr(f32, 3, "C"),
                           arr(f32, 4, "C"), arr(f32, 4, "C"))

    def decode_mma_fp8():
        from attention.decode import mma

        k = mma.mma_decode_kernel("f8", 128, 4, 1, mma.WARPS, mma.STAGES, None)
        return k.py_func, (arr(u32, 4, "C"), w1, w1, arr(i32, 1, "C"), arr(i32, 2, "C"), i32,
                           i32, i32, i32, f32, i32, arr(f32, 4, "C"), arr(f32, 3, "C"),
                           arr(f32, 4, "C"), arr(f32, 4, "C"), a1, a1)

    def prefill_tf32(d):
        from attention.prefill import tf32

        k = tf32.prefill_tf32_kernel(d, True, tf32.WARPS, tf32.default_block_n(d), None)
        return k.py_func, (a1, a1, a1, i32, i32, f32, a2, a2)

    def prefill_mma(kind, d):
        from attention.prefill import mma

        k = mma.prefill_mma_kernel(kind, d, True, mma.default_warps(d), mma.default_block_n(d))
        return k.py_func, (w1, w1, w1, i32, i32, f32, a2, a2)

    def mla_mma():
        from mla import mma as MM

        k = MM.mla_mma_kernel("f16", 512, 64, 4, 64, False)
        return k.py_func, MM.kernel_signature()

    out = [(name, lambda a=args, k=kw: fast(a, k))
           for name, args, kw in (("fast_ring", (2, 8, 2, 128, 1024, "f16"), {"stages": 4}),
                                  ("fast_buffers", (2, 4, 2, 128, 1024, "f16"), {"stages": 0}),
                                  ("fast_scalar", (2, 6, 2, 40, 1024, "f32"), {}))]
    out += [("decode_mma_f16", lambda: decode_mma("f16", None)),
            ("decode_mma_bf16_nhd", lambda: decode_mma("bf16", "NHD")),
            ("decode_mma_fp8", decode_mma_fp8),
            ("prefill_tf32_d128", lambda: prefill_tf32(128)),
            ("prefill_tf32_d64", lambda: prefill_tf32(64)),
            ("prefill_f16_d128", lambda: prefill_mma("f16", 128)),
            ("prefill_bf16_d64", lambda: prefill_mma("bf16", 64)),
            ("mla_mma_f16", mla_mma)]
    return out


NAMES = tuple(name for name, _ in _kernels())


def _dump(path, names):
    from numba import cuda

    from attention.core import inline_copy

    on = inline_copy.install()
    t0 = time.perf_counter()
    ptx = {}
    for name, thunk in _kernels():
        if not names or name in names:
            fn, sig = thunk()
            ptx[name] = cuda.compile_ptx(fn, sig, cc=(9, 0), fastmath=True)[0]
    with open(path, "w") as f:
        json.dump({"active": on, "seconds": time.perf_counter() - t0, "ptx": ptx}, f)


def compare(names=(), modes=("1", "0")):
    """Compile ``names`` (default: all) in two processes, the first with
    ``ATTN_INLINE_COPY=modes[0]``, the second with ``modes[1]``; returns ``(lines,
    n_differ, seconds_with, seconds_without)``. Raises RuntimeError unless the copies
    were installed in the first process and not in the second (``modes`` other than
    the default exist for the tests' control)."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, mode in enumerate(modes):
            path = os.path.join(tmp, f"ptx{n}.json")
            env = dict(os.environ, ATTN_INLINE_COPY=mode)
            subprocess.run([sys.executable, "-m", "validation.inline_copy_check", "--dump", path,
                            "--names", ",".join(names)], check=True, env=env)
            with open(path) as f:
                runs.append(json.load(f))
    on, off = runs
    if not on["active"] or off["active"]:
        raise RuntimeError(f"shared-memo copies active: {on['active']} with, {off['active']} "
                           "without (ATTN_INLINE_COPY=0): nothing to compare")
    lines, differ = [], 0
    for name, text in on["ptx"].items():
        same = text == off["ptx"][name]
        differ += not same
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        lines.append(f"{'same' if same else 'DIFFERENT'} {name}: {len(text)} characters of "
                     f"PTX, sha256 {digest}")
    return lines, differ, on["seconds"], off["seconds"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--names", default="", help=f"comma list of: {', '.join(NAMES)}")
    ap.add_argument("--time", action="store_true", help="print each process's compile seconds")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # a child process's side
    args = ap.parse_args(argv)
    names = tuple(n for n in args.names.split(",") if n)
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        ap.error(f"--names: unknown {unknown}; expected some of {', '.join(NAMES)}")
    if args.dump:
        _dump(args.dump, names)
        return 0
    lines, differ, t_on, t_off = compare(names)
    print("\n".join(lines))
    if args.time:
        print(f"compile seconds: {t_on:.1f} with the shared memo, {t_off:.1f} without")
    print("PTX identical" if not differ else f"{differ} kernels differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
