"""Fallbacks announce themselves; capacity overflows raise.

* ``mla.pipeline.choose_method``: "auto" switching to the tiled "flash" path
  (scratch over ``GEMM_WORKSPACE_LIMIT``) emits a ``FallbackWarning``; the GEMM
  path, an explicit method and flash-only options do not.
* ``attention.core.graph.CapturedLaunches``: a failed capture on a GPU records
  ``path`` "plain" with the reason and warns; ``graph=False`` and the
  simulator record without warning; a built graph records "graph".
* ``attention.core.pdl.status``: PDL off is recorded with its reason (no warning).
* Capacity: ``attention.decode.step.DecodeState`` (graph and eager modes)
  raises ``RangeError`` through its device flag at ``check()`` and at a
  synchronising step, naming the sequence and ``max_seq``, with nothing
  written for that sequence; ``batched_kv_scatter`` (host positions) raises
  before launching.

Each announcement has a positive control (it fires) and a negative control
(the normal path stays quiet).
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest

from attention.core import checks
from attention.core.checks import FallbackWarning


@contextlib.contextmanager
def quiet():
    """A context in which a FallbackWarning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        yield


# -- mla.pipeline: "auto" -> "flash" -------------------------------------

def test_auto_switch_to_flash_warns():
    from mla import pipeline as P

    # B 64, 128 heads, width 576, 40 000 visible rows: ~1.3 GiB of scratch
    with pytest.warns(FallbackWarning, match=r"'flash'.*GEMM_WORKSPACE_LIMIT.*method='gemm'"):
        how = P.choose_method("auto", 64, 128, 576, 40_000)
    assert how == "flash"


def test_auto_gemm_and_explicit_choices_are_quiet():
    from mla import pipeline as P

    with quiet():
        assert P.choose_method("auto", 64, 128, 576, 4096) == "gemm"  # 0.16 GiB
        # asked for: no fallback, no warning, whatever the size
        assert P.choose_method("flash", 64, 128, 576, 40_000) == "flash"
        assert P.choose_method("gemm", 64, 128, 576, 40_000) == "gemm"
        # a flash-only option chooses flash knowingly
        assert P.choose_method("auto", 64, 128, 576, 40_000, tile=32) == "flash"


# -- PDL: recorded only ---------------------------------------------------

def test_pdl_status_records_path_and_reason():
    from attention.core import pdl

    record = pdl.status()
    assert record["path"] in ("pdl", "plain") and record["reason"]
    assert (record["path"] == "pdl") == pdl.capable()
    if not pdl.capable():
        assert record["reason"] == pdl.off_reason()
    assert pdl.status(False) == {"path": "plain", "reason": "pdl=False was asked for"}


# -- graph capture --------------------------------------------------------

def _failing_capture(self, enqueue, warm):
    raise RuntimeError("capture refused")


@pytest.mark.device
def test_failed_capture_warns_and_records(monkeypatch):
    from attention.core import graph as gr

    monkeypatch.setattr(gr, "gpu_available", lambda: True)
    monkeypatch.setattr(gr, "SIMULATOR", False)
    monkeypatch.setattr(gr.CapturedLaunches, "_capture", _failing_capture)
    with pytest.warns(FallbackWarning, match=r"Owner: graph capture failed .*capture refused"):
        cap = gr.CapturedLaunches(lambda s: None, lambda: None, owner="Owner")
    assert cap.graph is None and cap.path == "plain"
    assert "capture refused" in cap.fallback_reason and "capture refused" in cap.error


@pytest.mark.device
def test_plain_by_request_or_without_graphs_is_quiet():
    from attention.core import graph as gr
    from attention.core.device import SIMULATOR

    with quiet():
        cap = gr.CapturedLaunches(lambda s: None, lambda: None, enabled=False)
        assert cap.path == "plain" and cap.fallback_reason is None
        if SIMULATOR:  # no graphs at all: recorded, not warned
            cap = gr.CapturedLaunches(lambda s: None, lambda: None)
            assert cap.path == "plain" and "simulator" in cap.fallback_reason


def _decode_state(cap=4, lengths=(2, 0), mode="graph"):
    from attention.decode.step import DecodeState

    rng = np.random.default_rng(9)
    m, h, kv, d = 2, 4, 2, 32
    st = DecodeState(m, h, kv, d, cap, mode=mode)
    k = rng.standard_normal(st.cache_shape).astype(np.float32)
    v = rng.standard_normal(st.cache_shape).astype(np.float32)
    st.load(k, v, np.array(lengths, np.int32))
    st.q.copy_to_device(rng.standard_normal((m, h, d)).astype(np.float32))
    st.k_new.copy_to_device(rng.standard_normal((m, kv, d)).astype(np.float32))
    st.v_new.copy_to_device(rng.standard_normal((m, kv, d)).astype(np.float32))
    return st


@pytest.mark.device
def test_decode_state_failed_capture_warns_and_still_steps(monkeypatch):
    from attention.core import graph as gr

    monkeypatch.setattr(gr, "gpu_available", lambda: True)
    monkeypatch.setattr(gr, "SIMULATOR", False)
    monkeypatch.setattr(gr.CapturedLaunches, "_capture", _failing_capture)
    with pytest.warns(FallbackWarning, match="DecodeState: graph capture failed"):
        st = _decode_state()
    assert st.mode == "graph" and st.path == "eager"
    assert "capture refused" in st.fallback_reason and "capture refused" in st.graph_error
    st.step(sync=True)  # the eager path works
    np.testing.assert_array_equal(st.lengths, [3, 1])


@pytest.mark.device
def test_decode_state_records_its_path_quietly():
    from attention.core.device import SIMULATOR

    with quiet():
        st = _decode_state()
        eager = _decode_state(mode="eager")
    assert eager.path == "eager" and eager.fallback_reason is None
    if SIMULATOR:
        assert st.path == "eager" and "simulator" in st.fallback_reason
    else:
        assert st.path == "graph" and st.fallback_reason is None
    assert st.pdl["path"] in ("pdl", "plain", "none") and st.pdl["reason"]


@pytest.mark.gpu
def test_gpu_graph_is_built_without_warning():
    with quiet():
        st = _decode_state(cap=64)
    assert st.path == "graph" and st.graph is not None, st.fallback_reason


# -- capacity: the device flag of the decode state (both modes) -------------

@pytest.mark.device
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_decode_state_past_capacity_raises_through_the_flag(mode):
    """Sequence 0 holds 2 of 4 positions: steps 1 and 2 fit (rows 2, 3), step 3
    does not: nothing written for it, seq_lens 0, length kept, and the flag
    becomes a RangeError naming sequence 0 and max_seq=4."""
    st = _decode_state(cap=4, lengths=(2, 0), mode=mode)
    st.step(sync=True)
    st.step(sync=True)
    np.testing.assert_array_equal(st.seq_lens.copy_to_host(), [4, 2])
    k_before = st.k_cache.copy_to_host()
    st.step()  # no sync: the error waits on the device
    with pytest.raises(checks.RangeError, match=r"sequence 0 .*max_seq=4"):
        st.check()
    k_after = st.k_cache.copy_to_host()
    np.testing.assert_array_equal(k_after[0], k_before[0])  # sequence 0 untouched
    assert not np.array_equal(k_after[1], k_before[1])  # sequence 1 still stepped
    np.testing.assert_array_equal(st.seq_lens.copy_to_host(), [0, 3])
    np.testing.assert_array_equal(st.lengths, [4, 3])
    assert np.all(st.out.copy_to_host()[0] == 0)
    st.check()  # cleared by the check that raised
    with pytest.raises(checks.RangeError, match=r"sequence 0 .*max_seq=4"):
        st.step(sync=True)  # a synchronising step checks too


@pytest.mark.device
def test_decode_state_within_capacity_checks_clean():
    st = _decode_state(cap=4, lengths=(0, 1))
    for _ in range(3):
        st.step(sync=True)
    st.check()
    np.testing.assert_array_equal(st.seq_lens.copy_to_host(), [3, 4])


@pytest.mark.device
def test_decode_state_length_filled_out_of_range_raises():
    st = _decode_state(cap=4, lengths=(0, 1), mode="eager")
    st.d_lengths.copy_to_device(np.array([0, -1], np.int32))
    with pytest.raises(checks.RangeError, match=r"sequence 1 holds -1 positions.*max_seq=4"):
        st.step(sync=True)


@pytest.mark.device
def test_decode_state_numpy_step_past_capacity_raises_and_writes_nothing_for_it():
    """A step given numpy arrays synchronises: the overflow raises at once;
    the full sequence's slot and length are untouched."""
    from attention.decode.step import DecodeState

    st = DecodeState(2, 2, 1, 8, 2, mode="eager")
    k_new = np.ones((2, 1, 8), np.float32)
    q = np.zeros((2, 2, 8), np.float32)
    st.step(q, k_new, k_new)
    st.step(q, k_new, k_new)  # both sequences now hold max_seq=2 positions
    before = st.k_cache.copy_to_host()
    with pytest.raises(checks.RangeError, match=r"sequence 0 .*max_seq=2"):
        st.step(q, 2 * k_new, 2 * k_new)
    np.testing.assert_array_equal(st.k_cache.copy_to_host(), before)
    np.testing.assert_array_equal(st.lengths, [2, 2])


# -- capacity: the eager scatter raises before launching ---------------------

def test_batched_scatter_past_capacity_raises_before_launching():
    from attention.cache.scatter import batched_kv_scatter

    cache = np.zeros((2, 1, 4, 8), np.float32)
    rows = np.ones((2, 1, 8), np.float32)
    with pytest.raises(checks.RangeError, match=r"positions: .*max_seq=4.*got 4"):
        batched_kv_scatter(rows, rows, cache, cache.copy(), [1, 4])
    assert not cache.any()
