"""Fallbacks announce themselves; capacity overflows raise.

* ``mla.pipeline.choose_method``: "auto" switching to the tiled "flash" path
  (scratch over ``GEMM_WORKSPACE_LIMIT``) emits a ``FallbackWarning``; the GEMM
  path, an explicit method and flash-only options do not.
* ``attention.core.graph.CapturedLaunches``: a failed capture on a GPU records
  ``path`` "plain" with the reason and warns; ``graph=False`` and the
  simulator record without warning; a built graph records "graph".
* ``attention.core.pdl.status``: PDL off is recorded with its reason (no warning).
* Capacity: ``DecodeStep`` (graph / step path) raises ``RangeError`` through
  its device flag at ``check()`` and ``step(sync=True)``, naming the sequence
  and ``max_seq``; the eager paths (``DecodeBatch.step``,
  ``batched_kv_scatter``) raise before launching.

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


def _decode_step(cap=4, pos=(2, 0), graph=True, advance=True):
    from attention.decode.graph import DecodeStep

    rng = np.random.default_rng(9)
    m, h, kv, d = 2, 4, 2, 32
    k = rng.standard_normal((m, kv, cap, d)).astype(np.float32)
    v = rng.standard_normal((m, kv, cap, d)).astype(np.float32)
    q = rng.standard_normal((m, h, d)).astype(np.float32)
    kn = rng.standard_normal((m, kv, d)).astype(np.float32)
    vn = rng.standard_normal((m, kv, d)).astype(np.float32)
    return DecodeStep(q, kn, vn, k, v, np.array(pos, np.int32), graph=graph,
                      advance=advance)


@pytest.mark.device
def test_decode_step_failed_capture_warns_and_still_steps(monkeypatch):
    from attention.core import graph as gr

    monkeypatch.setattr(gr, "gpu_available", lambda: True)
    monkeypatch.setattr(gr, "SIMULATOR", False)
    monkeypatch.setattr(gr.CapturedLaunches, "_capture", _failing_capture)
    with pytest.warns(FallbackWarning, match="DecodeStep: graph capture failed"):
        step = _decode_step()
    assert step.path == "plain" and "capture refused" in step.fallback_reason
    step.step(sync=True)  # the plain path works
    np.testing.assert_array_equal(step.d_lens.copy_to_host(), [3, 1])


@pytest.mark.device
def test_decode_step_records_its_path_quietly():
    from attention.core.device import SIMULATOR

    with quiet():
        step = _decode_step()
        plain = _decode_step(graph=False)
    assert plain.path == "plain" and plain.fallback_reason is None
    if SIMULATOR:
        assert step.path == "plain" and "simulator" in step.fallback_reason
    else:
        assert step.path == "graph" and step.fallback_reason is None
    assert step.pdl["path"] in ("pdl", "plain", "none") and step.pdl["reason"]


@pytest.mark.gpu
def test_gpu_graph_is_built_without_warning():
    with quiet():
        step = _decode_step(cap=64)
    assert step.path == "graph" and step.graph is not None, step.fallback_reason


# -- capacity: the device flag of the step path ---------------------------

@pytest.mark.device
def test_decode_step_past_capacity_raises_through_the_flag():
    """Sequence 0 starts at position 2 of 4: steps 1 and 2 fit (rows 2, 3),
    step 3 does not: nothing written for it, seq_lens 0, position kept, and
    the flag becomes a RangeError naming sequence 0 and max_seq=4."""
    step = _decode_step(cap=4, pos=(2, 0))
    step.step(sync=True)
    step.step(sync=True)
    np.testing.assert_array_equal(step.d_lens.copy_to_host(), [4, 2])
    k_before = step.d_k.copy_to_host()
    step.step()  # no sync: the error waits on the device
    with pytest.raises(checks.RangeError, match=r"sequence 0 .*max_seq=4"):
        step.check()
    k_after = step.d_k.copy_to_host()
    np.testing.assert_array_equal(k_after[0], k_before[0])  # sequence 0 untouched
    assert not np.array_equal(k_after[1], k_before[1])  # sequence 1 still stepped
    np.testing.assert_array_equal(step.d_lens.copy_to_host(), [0, 3])
    np.testing.assert_array_equal(step.d_pos.copy_to_host(), [4, 3])
    out = step.out.copy_to_host()
    assert np.all(out[0] == 0)
    step.check()  # cleared by the check that raised
    with pytest.raises(checks.RangeError, match=r"sequence 0 .*max_seq=4"):
        step.step(sync=True)  # a synchronising step checks too


@pytest.mark.device
def test_decode_step_within_capacity_checks_clean():
    step = _decode_step(cap=4, pos=(0, 1))
    for _ in range(3):
        step.step(sync=True)
    step.check()
    np.testing.assert_array_equal(step.d_lens.copy_to_host(), [3, 4])


@pytest.mark.device
def test_decode_step_position_filled_out_of_range_raises():
    step = _decode_step(cap=4, pos=(0, 1), advance=False)
    step.d_pos.copy_to_device(np.array([0, -1], np.int32))
    with pytest.raises(checks.RangeError, match=r"sequence 1 .*position -1.*max_seq=4"):
        step.step_plain(sync=True)


# -- capacity: eager paths raise before launching -------------------------

@pytest.mark.device
def test_decode_batch_past_capacity_raises_before_writing():
    from attention.decode.state import DecodeBatch

    batch = DecodeBatch(2, 2, 1, 8, 2)
    k_new = np.ones((2, 1, 8), np.float32)
    q = np.zeros((2, 2, 8), np.float32)
    batch.step(q, k_new, k_new)
    batch.step(q, k_new, k_new)  # both sequences now hold max_seq=2 positions
    before = batch.k_cache.copy_to_host()
    with pytest.raises(checks.RangeError, match=r"sequence 0 .*max_seq=2"):
        batch.step(q, 2 * k_new, 2 * k_new)
    np.testing.assert_array_equal(batch.k_cache.copy_to_host(), before)
    np.testing.assert_array_equal(batch.lengths, [2, 2])


def test_batched_scatter_past_capacity_raises_before_launching():
    from attention.cache.scatter import batched_kv_scatter

    cache = np.zeros((2, 1, 4, 8), np.float32)
    rows = np.ones((2, 1, 8), np.float32)
    with pytest.raises(checks.RangeError, match=r"positions: .*max_seq=4.*got 4"):
        batched_kv_scatter(rows, rows, cache, cache.copy(), [1, 4])
    assert not cache.any()
