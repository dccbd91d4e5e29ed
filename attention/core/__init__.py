"""What every kernel builds on: device staging and input checks, warp
reductions and the online-softmax update, the simulator's warp support, PDL
and graph capture, per-slot pointer tables, and the roundings of the planted
precision mutants.

    device    host/device staging, streams, ``jit``, the simulator switch
    checks    input checks and the named errors (``ShapeError``, ``DTypeError``, ...)
    warp      the one implementation of each warp reduction and of the online softmax
    simwarp   warp intrinsics the CUDA simulator lacks
    pdl       programmatic dependent launch
    graph     launches captured once as a CUDA graph, then replayed
    pointers  caches read through a table of device pointers
    rounding  roundings the precision mutants apply
    inline_copy  linear-time IR copies for numba's inlining (compile time only;
              installed on import of this package)
"""

from attention.core import inline_copy as _inline_copy

_inline_copy.install()
