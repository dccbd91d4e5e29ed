"""Where kernels run, and how launchers move arguments there and back.

Three ways code runs in this project (README): compile-only (``compile_ptx``,
no GPU), the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, with the warp
intrinsics of ``attention.core.simwarp``) and a real GPU. This module hides the
difference from launchers:

* ``jit(...)`` / ``device_fn`` build kernels and inlined device functions with
  options the simulator would reject left out there.
* ``Staged`` arguments: numpy arrays are copied to the device (and outputs
  copied back); numba device arrays, and objects exposing
  ``__cuda_array_interface__`` (torch, cupy) or DLPack, are used in place.
* ``finish(stream)``: without a stream, a launcher synchronises before it
  returns; with a stream it only enqueues.
"""

from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda.core import config as _config

SIMULATOR = bool(_config.ENABLE_CUDASIM)

_GPU_ONLY_OPTIONS = ("lineinfo", "max_registers", "launch_bounds")

SMEM_STATIC_LIMIT = 48 * 1024  # a block's shared memory past this needs an opt-in


def jit(fn=None, **options):
    """``cuda.jit`` for kernels, dropping options the simulator rejects."""
    if SIMULATOR:
        for key in _GPU_ONLY_OPTIONS:
            options.pop(key, None)
    if fn is None:
        return cuda.jit(**options)
    return cuda.jit(**options)(fn)


def device_fn(fn):
    """An always-inlined device function (compiles with no GPU present)."""
    return cuda.jit(device=True, inline="always")(fn)


def _page_split(pos, page, shift):
    if shift >= 0:
        return pos >> shift, pos & (page - 1)
    j = pos // page
    return j, pos - j * page


# page_split(pos, page, shift): (page-table column, row in the page) of position
# pos of a paged cache with pages of ``page`` rows; ``shift`` = log2(page) when page
# is a power of two (a shift and a mask), else -1 (a division). Shared by the
# paged decode kernels and the MLA tensor-core kernel.
page_split = device_fn(_page_split)


def _fma_gpu(a, b, c):
    return cuda.fma(a, b, c)


def _fma_sim(a, b, c):
    return a * b + c  # the simulator has no fused form: two roundings


# ``a * b + c`` with one rounding on a GPU, whatever the compiler would pair:
# straight-line code is free to contract ``x + a b`` as ``fma(a, b, x)`` or to
# round a product first, and the results differ in the last bits
fma = device_fn(_fma_sim if SIMULATOR else _fma_gpu)


def ptx_statement(text):
    """A device intrinsic ``op()`` that runs the inline PTX ``text`` (no
    operands, no result), kept in place (side effects) and ordered against
    memory accesses around it (a ``memory`` clobber). GPU only: the
    simulator cannot run it.

    Used for ``cp.async.commit_group`` / ``cp.async.wait_group``
    (``attention.decode.fast``) and ``griddepcontrol`` (``attention.core.pdl``).
    """
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def op(typingctx):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return types.void(), codegen

    return op


def allow_dynamic_shared(kernel, args, nbytes):
    """Let dispatcher ``kernel``, compiled for the types of ``args`` (compiled
    here if it is not yet), launch with ``nbytes`` of dynamic shared memory:
    past ``SMEM_STATIC_LIMIT`` a block (static included) the driver needs
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` set on the function.
    Sets it on every compiled overload of ``kernel`` (on the current device),
    every time: ``ensure_dynamic_shared`` is the once-only form. Nothing to do
    on the simulator."""
    if SIMULATOR:
        return
    import numba
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv import driver

    kernel.compile(tuple(numba.typeof(a) for a in args))
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    for compiled in kernel.overloads.values():
        fn = compiled._codelibrary.get_cufunc()
        driver.driver.cuKernelSetAttribute(attr, int(nbytes), fn.handle, fn.device.id)


_SHARED_SET_UP = set()  # (kernel, tag, device id) given their dynamic shared memory


def ensure_dynamic_shared(kernel, args, nbytes, static, tag, ready=None):
    """``allow_dynamic_shared(kernel, args, nbytes)`` once a kernel, ``tag``
    (what selects the overload: the argument dtype) and device, when ``static
    + nbytes`` passes ``SMEM_STATIC_LIMIT``. ``ready``: an optional set kept by
    the caller's plan (a plan belongs to one device), holding the tags already
    set up: with it, a repeated launch does no device lookup."""
    if SIMULATOR or static + nbytes <= SMEM_STATIC_LIMIT:
        return
    if ready is not None and (kernel, tag) in ready:
        return
    key = (kernel, tag, cuda.get_current_device().id)
    if key not in _SHARED_SET_UP:
        allow_dynamic_shared(kernel, args, nbytes)
        _SHARED_SET_UP.add(key)
    if ready is not None:
        ready.add((kernel, tag))


def gpu_available() -> bool:
    """True on a machine with a usable CUDA GPU (never under the simulator)."""
    if SIMULATOR:
        return False
    try:
        return bool(cuda.is_available()) and len(cuda.gpus) > 0
    except Exception:  # driver missing or broken
        return False


def can_execute() -> bool:
    """True where kernels can run: a GPU or the simulator."""
    return SIMULATOR or gpu_available()


def device_name() -> str:
    if SIMULATOR:
        return "simulator"
    if not gpu_available():
        return "none"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def is_host_array(x) -> bool:
    return isinstance(x, np.ndarray)


def is_device_array(x) -> bool:
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray)
    return cuda.is_cuda_array(x) or (hasattr(x, "__dlpack__") and not is_host_array(x))


def as_device_view(x):
    """A numba device array viewing ``x`` (no copy) for a device-resident ``x``."""
    if SIMULATOR:
        return x
    if cuda.cudadrv.devicearray.is_cuda_ndarray(x):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x)
    if hasattr(x, "__dlpack__"):
        return _from_dlpack(x)
    raise TypeError(
        f"expected a numpy array or a device array (numba, __cuda_array_interface__ "
        f"or DLPack), got {type(x).__name__}"
    )


def _from_dlpack(x):
    """Zero-copy numba view of a DLPack-only device tensor."""
    from cuda.core.utils import StridedMemoryView

    view = StridedMemoryView.from_dlpack(x, stream_ptr=-1)
    itemsize = np.dtype(view.dtype).itemsize
    strides = None if view.strides is None else tuple(s * itemsize for s in view.strides)
    desc = {
        "shape": tuple(view.shape),
        "strides": strides,
        "typestr": np.dtype(view.dtype).str,
        "data": (int(view.ptr), bool(view.readonly)),
        "version": 3,
    }
    return cuda.from_cuda_array_interface(desc, owner=x, sync=False)


try:  # numpy bfloat16 arrays (numba maps them to cuda bf16)
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None


def c_strides(x):
    """``x`` (C-contiguous numpy) as a view with the plain C strides.

    numpy lets a length-1 axis carry any stride (``x[None]`` gives 0), and
    numba's host-to-device copy takes such an array for non-contiguous and
    walks its extent element by element in Python (seconds per megabyte).
    """
    want, step = [], x.itemsize
    for n in reversed(x.shape):
        want.append(step)
        step *= max(int(n), 1)
    want = tuple(reversed(want))
    if x.strides == want:
        return x
    return np.lib.stride_tricks.as_strided(x, x.shape, want, writeable=x.flags.writeable)


def to_device(x, stream=None):
    """Device view of ``x``; numpy arrays are copied (on ``stream`` if given).

    numpy bfloat16 arrays travel through a uint16 view: numba's host copy
    cannot export ml_dtypes buffers.
    """
    if is_host_array(x):
        x = c_strides(np.ascontiguousarray(x))
        if BFLOAT16 is not None and x.dtype == BFLOAT16 and not SIMULATOR:
            return cuda.to_device(x.view(np.uint16), stream=stream or 0).view(BFLOAT16)
        return cuda.to_device(x, stream=stream or 0)
    return as_device_view(x)


def device_empty(shape, dtype, stream=None):
    return cuda.device_array(shape, dtype=dtype, stream=stream or 0)


def output_array(name, given, shape, stream=None):
    """A float32 output buffer of ``shape`` on the device: a new one when
    ``given`` is None, else ``given`` checked (``attention.core.checks``: the
    shape and dtype, the error naming ``name``) and staged (a device array is
    used in place)."""
    from attention.core import checks

    if given is None:
        return device_empty(shape, np.float32, stream)
    checks.check_array(name, given, tuple((f"d{i}", s) for i, s in enumerate(shape)),
                       dtypes=(np.float32,))
    return to_device(given, stream)


def device_fill(shape, dtype, value, stream=None):
    """A device array filled with ``value`` (copied from a host array)."""
    return cuda.to_device(np.full(shape, value, dtype=dtype), stream=stream or 0)


def to_host(d, stream=None):
    if BFLOAT16 is not None and not SIMULATOR and np.dtype(d.dtype) == BFLOAT16:
        return d.view(np.uint16).copy_to_host(stream=stream or 0).view(BFLOAT16)
    return d.copy_to_host(stream=stream or 0)


def finish(stream):
    """Synchronise when the caller gave no stream (launch conventions)."""
    if stream is None:
        cuda.synchronize()


def launch_stream(stream):
    """The stream to launch on: the caller's, or the default stream."""
    return 0 if stream is None else stream


def host_ints(x):
    """A host copy of a small index array or scalar (device arrays are copied)."""
    if x is None or is_host_array(x) or isinstance(x, (list, tuple, int, np.integer)):
        return np.asarray(x)
    return np.asarray(to_host(as_device_view(x)))
