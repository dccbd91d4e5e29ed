"""``validation.sanitizer_control``: the planted defects the sanitizer stages must flag.

On the simulator, which checks bounds, the memcheck control's kernel raises
``IndexError``: proof that it writes out of bounds (on a GPU, numba does not
check, and memcheck must report it: ``validation.gpu_suite`` runs it there).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from numba import cuda, int32

from tests.conftest import MODE
from validation import sanitizer_control as sc

sim_only = pytest.mark.skipif(MODE != "sim", reason="the simulator checks bounds; on a GPU "
                              "the control runs under compute-sanitizer (validation.gpu_suite)")


@sim_only
def test_the_memcheck_control_writes_past_its_array():
    a = cuda.to_device(np.zeros(sc.N, np.float32))
    with pytest.raises(IndexError):
        sc.oob_write[1, 2 * sc.N](a)
    sc.oob_write[1, sc.N](a)  # control: within the array it runs and writes every element
    assert (a.copy_to_host() == np.arange(sc.N)).all()


def _ptx(kernel, *argtypes):
    return cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0))[0]


def _shared_accesses(ptx):
    return (len(re.findall(r"\bst\.shared\.", ptx)), len(re.findall(r"\bld\.shared\.", ptx)))


@pytest.mark.compile
def test_the_racecheck_control_keeps_its_shared_load():
    """The PTX stores to shared memory and loads from it with no barrier: the
    accesses racecheck must flag. Control: the first form of the control (one
    word written and read back by every thread) compiles to the store alone, the
    load replaced by the stored value, which is why it went unflagged."""
    from numba import types

    i32 = types.Array(types.int32, 1, "C")
    ptx = _ptx(sc.shared_race, i32)
    assert _shared_accesses(ptx) == (1, 1), ptx
    assert "bar.sync" not in ptx and "barrier" not in ptx

    @cuda.jit
    def one_word(out):
        sm = cuda.shared.array(1, int32)
        t = cuda.threadIdx.x
        sm[0] = t
        out[t] = sm[0]

    assert _shared_accesses(_ptx(one_word, i32)) == (1, 0)


@pytest.mark.compile
def test_the_memcheck_control_stores_without_a_bounds_check():
    """numba does not check bounds in device code: the control's one store is not
    behind a branch (the only comparison is the negative-index wrap, a select),
    so threads past the array's end write."""
    from numba import types

    ptx = _ptx(sc.oob_write, types.Array(types.float32, 1, "C"))
    assert len(re.findall(r"\bst\.global\.f32", ptx)) == 1, ptx
    assert not re.search(r"\bbra\b", ptx.split("{", 1)[1]), ptx


def test_an_unknown_tool_is_named():
    with pytest.raises(ValueError, match="tool"):
        sc.run("initcheck")
