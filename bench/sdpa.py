"""Which backend a torch ``scaled_dot_product_attention`` call runs (benchmark labels).

torch dispatches SDPA to one of four backends (``torch.nn.attention.SDPBackend``):
flash, memory-efficient, cuDNN or math (the unfused reference: batched GEMMs
and a separate softmax, the slowest). Which one runs depends on the dtype,
the shapes and flags such as ``enable_gqa`` (e.g. fp32 with ``enable_gqa``:
flash takes no fp32 and the math path serves it), so a benchmark row names it.

``backend_of(torch, fn)`` determines it in the run: each backend is tried
alone under ``torch.nn.attention.sdpa_kernel([backend])`` (the ones that run
the call), and the CUDA kernels of one unrestricted call are read from the
profiler and classified by name (``classify_kernels``). The label is the
classified backend when the profiler gave kernel names, else the only backend
that runs alone, else "default of a|b" (the ones that run).

Everything here takes ``torch`` as an argument: the module imports without it.
"""

from __future__ import annotations

# label -> SDPBackend member name, in torch's usual order of preference
BACKENDS = (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"),
            ("efficient", "EFFICIENT_ATTENTION"), ("math", "MATH"))

# substrings of CUDA kernel names (lower case), checked in this order: cuDNN's
# fused kernels also say "flash", so cuDNN comes first
_KERNEL_MARKS = (("cudnn", ("cudnn",)),
                 ("flash", ("flash_fwd", "pytorch_flash", "flash")),
                 ("efficient", ("fmha", "efficient_attention", "mem_efficient", "cutlassf")))


def classify_kernels(names):
    """The SDPA backend that launched CUDA kernels ``names`` (an iterable of
    str): "cudnn", "flash" or "efficient" when a fused attention kernel is
    among them, "math" when there are kernels but none of those (GEMMs and a
    softmax), None when there are none."""
    names = [str(n).lower() for n in names]
    if not names:
        return None
    for label, marks in _KERNEL_MARKS:
        if any(mark in n for n in names for mark in marks):
            return label
    return "math"


def label(kernel, backend):
    """Row label ``kernel[backend]`` (``kernel`` alone when backend is None)."""
    return kernel if not backend else f"{kernel}[{backend}]"


def base_name(row_label):
    """The kernel name of a row label without its ``[backend]`` suffix."""
    return str(row_label).split("[", 1)[0]


def choose_label(profiled, alone):
    """The backend label from the profiler's answer (``profiled``: a label or
    None) and the backends that run the call alone (``alone``: labels)."""
    if profiled is not None:
        return profiled
    if len(alone) == 1:
        return alone[0]
    if alone:
        return "default of " + "|".join(alone)
    return "unknown"


def _member(torch, name):
    from torch.nn.attention import SDPBackend  # noqa: F401  (torch >= 2.3)

    return getattr(torch.nn.attention.SDPBackend, name, None)


def run_with(torch, backend, fn):
    """``fn()`` with SDPA restricted to ``backend`` (a label of ``BACKENDS``)."""
    from torch.nn.attention import sdpa_kernel

    member = _member(torch, dict(BACKENDS)[backend])
    if member is None:
        raise RuntimeError(f"this torch has no SDPA backend {backend!r}")
    with sdpa_kernel([member]):
        return fn()


def backends_that_run(torch, fn):
    """Labels of the backends that run ``fn()`` when each is the only one allowed."""
    ok = []
    for name, _ in BACKENDS:
        try:
            run_with(torch, name, fn)
            torch.cuda.synchronize()
            ok.append(name)
        except Exception:  # this backend does not take the call
            continue
    return ok


def profiled_kernels(torch, fn):
    """Names of the CUDA kernels one ``fn()`` launches (torch profiler), or
    None when the profiler gives none."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()
                 if str(getattr(e, "device_type", "")).lower().endswith("cuda")]
        return names or None
    except Exception:
        return None


def backend_of(torch, fn):
    """(label, detail) of the backend an unrestricted ``fn()`` runs: see the
    module docstring. ``detail`` lists the backends that run alone and the
    source of the label."""
    alone = backends_that_run(torch, fn)
    names = profiled_kernels(torch, fn)
    profiled = classify_kernels(names) if names else None
    chosen = choose_label(profiled, alone)
    source = "profiler kernel names" if profiled is not None else "backends run alone"
    return chosen, f"{source}; alone: {','.join(alone) or 'none'}"
