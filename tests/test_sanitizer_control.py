"""``validation.sanitizer_control``: the planted defects the sanitizer stages must flag.

On the simulator, which checks bounds, the memcheck control's kernel raises
``IndexError``: proof that it writes out of bounds (on a GPU, numba does not
check, and memcheck must report it: ``validation.gpu_suite`` runs it there).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

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


@sim_only
def test_the_racecheck_control_shares_one_word_between_warps():
    out = cuda.to_device(np.full(64, -1, np.int32))
    sc.shared_race[1, 64](out)
    got = out.copy_to_host()
    assert ((got >= 0) & (got < 64)).all()  # each read one of the 64 writes to the word


def test_an_unknown_tool_is_named():
    with pytest.raises(ValueError, match="tool"):
        sc.run("initcheck")
