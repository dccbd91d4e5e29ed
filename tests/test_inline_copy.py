"""attention.core.inline_copy: numba's IR copies for inlining made linear, the PTX
unchanged.

Compile-only: installed on the pinned numba-cuda (it is what keeps the compile
tests and the GPU validation's compiles at about half their time); a kernel's
PTX is the same text with it and without it (``ATTN_INLINE_COPY=0``, another
process); the comparison refuses to pass where the copies were not installed
(positive control); no shared memo is left open after a compile, so later deep
copies of IR blocks behave as numba's own. Simulator: not installed (nothing is
compiled there).
"""

from __future__ import annotations

import copy
import os

import pytest

from attention.core import inline_copy


@pytest.mark.compile
def test_installed_on_the_pinned_numba_cuda():
    assert inline_copy._version() in inline_copy.CHECKED, (
        f"numba-cuda {inline_copy._version()}: check the copies on it "
        "(python -m validation.inline_copy_check) and add it to CHECKED")
    if os.environ.get("ATTN_INLINE_COPY", "1") == "0":
        pytest.skip("ATTN_INLINE_COPY=0 in this process's environment")
    assert inline_copy.active()


@pytest.mark.compile
def test_same_ptx_with_and_without():
    """A tensor-core prefill (many inlined device functions, loops and branches):
    the same PTX text compiled in a process with the shared-memo copies and one
    without."""
    from validation import inline_copy_check

    lines, differ, _, _ = inline_copy_check.compare(("prefill_bf16_d64",))
    assert differ == 0, lines
    assert len(lines) == 1 and lines[0].startswith("same prefill_bf16_d64"), lines


@pytest.mark.compile
def test_comparison_refuses_when_not_installed():
    """Positive control: with ``ATTN_INLINE_COPY=0`` in both processes there is
    nothing to compare, and the check says so instead of passing."""
    from validation import inline_copy_check

    with pytest.raises(RuntimeError, match="nothing to compare"):
        inline_copy_check.compare(("prefill_bf16_d64",), modes=("0", "0"))


@pytest.mark.compile
def test_no_memo_left_open_after_a_compile():
    """After a compile (which inlines), a deep copy of IR blocks is numba's own:
    two copies of one block are distinct objects, and a block copied alone gets
    its own scope."""
    from numba import cuda, types
    from numba.cuda.core import ir

    from attention.core.device import device_fn

    def twice(x):
        if x > 0:
            return x + x
        return x

    twice = device_fn(twice)

    def kernel(a):
        a[0] = twice(a[0])

    cuda.compile_ptx(kernel, (types.float32[::1],), cc=(9, 0))
    assert getattr(inline_copy._state, "memo", None) is None
    scope = ir.Scope(None, ir.Loc("f", 1))
    block = ir.Block(scope, ir.Loc("f", 1))
    a, b = copy.deepcopy(block), copy.deepcopy(block)
    assert a is not b and a.scope is not b.scope and a.scope is not scope


@pytest.mark.sim
def test_not_installed_under_the_simulator():
    assert not inline_copy.active()
    assert not inline_copy.install()
