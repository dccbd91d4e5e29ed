"""Linear-time IR copies for numba's ``inline="always"`` (compile time only).

Every device function of this project is inlined at the numba IR level
(``device_fn``; ``compile_ptx`` with no GPU cannot call a separately compiled
device function, ../shared/NUMBA_NOTES.md). Before inlining a callee, numba-cuda
0.30.4 copies the callee's IR twice, each time with ``copy.deepcopy`` of every
block on its own. A block's variables point to the function's one ``Scope``,
which lists every variable of the function, so each block's copy copies the
whole scope again: the cost is (blocks x variables), quadratic in the callee's
size. For the large kernels (the fast decode's forms, the tensor-core
decodes) these copies took about half of a compile (``python -m
validation.inline_copy_check --time``).

``install()`` makes the blocks of one such IR copy share one deepcopy memo, so
the scope and each variable are copied once for the whole function, as a
single ``copy.deepcopy`` of all the blocks would. The IR that results is the
same function (the source IR's blocks also share one scope and their
variables); numba's later passes rename the callee's variables into the
caller's scope either way. The PTX is unchanged: ``python -m
validation.inline_copy_check`` compiles a set of kernels with and without
it in separate processes and compares the text; a compile-only test does the
same for one kernel.

How: while ``InlineWorker.inline_ir`` runs, a ``FunctionIR.copy()`` opens a
shared memo and the next assignment of that copy's ``blocks`` (the
``{label: copy.deepcopy(block)}`` that follows it in the inliner) closes it;
``Block.__deepcopy__`` uses the open memo, else the one it is given (the
standard behaviour). Installed for the numba-cuda version it was checked on
(``CHECKED``) only; ``ATTN_INLINE_COPY=0`` leaves numba as it is.
"""

from __future__ import annotations

import copy
import os
import threading

CHECKED = ("0.30.4",)
_state = threading.local()
_installed = []


def _version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("numba-cuda")
    except PackageNotFoundError:
        return None


def active():
    """True when the shared-memo copies are installed in this process."""
    return bool(_installed)


def install():
    """Install the shared-memo block copies (idempotent). Returns ``active()``.
    Not installed: under the simulator (nothing is compiled), with
    ``ATTN_INLINE_COPY=0``, or on a numba-cuda other than ``CHECKED``."""
    if _installed:
        return True
    from numba.cuda.core import config

    if config.ENABLE_CUDASIM or os.environ.get("ATTN_INLINE_COPY", "1") == "0":
        return False
    if _version() not in CHECKED:
        return False
    from numba.cuda.core import inline_closurecall, ir

    worker = inline_closurecall.InlineWorker
    if "__deepcopy__" in vars(ir.Block) or not hasattr(worker, "inline_ir"):
        return False  # not the layout this was checked on
    plain_inline = worker.inline_ir
    plain_copy = ir.FunctionIR.copy

    class _OpenCopy(ir.FunctionIR):
        """A ``FunctionIR.copy()`` whose blocks are still to be deep-copied:
        assigning ``blocks`` closes the shared memo and makes it a plain
        ``FunctionIR`` again."""

        def __setattr__(self, name, value):
            object.__setattr__(self, name, value)
            if name == "blocks":
                _state.memo = None
                object.__setattr__(self, "__class__", ir.FunctionIR)

    def inline_ir(self, *args, **kwargs):
        outer = getattr(_state, "inlining", False)
        _state.inlining = True
        try:
            return plain_inline(self, *args, **kwargs)
        finally:
            _state.inlining = outer
            _state.memo = None

    def function_ir_copy(self):
        new = plain_copy(self)
        if getattr(_state, "inlining", False):
            _state.memo = {}
            object.__setattr__(new, "__class__", _OpenCopy)
        return new

    def block_deepcopy(self, memo):
        shared = getattr(_state, "memo", None)
        if shared is None:
            shared = memo
        elif id(self) in shared:
            return shared[id(self)]
        return copy._reconstruct(self, shared, *self.__reduce_ex__(4))

    worker.inline_ir = inline_ir
    ir.FunctionIR.copy = function_ir_copy
    ir.Block.__deepcopy__ = block_deepcopy
    _installed.append((plain_inline, plain_copy))
    return True
