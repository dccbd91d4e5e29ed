"""``scripts/validate`` (``python -m validation``): sweep, error growth, planted
defects, report.

On a GPU the default is the full sweep (GPU shapes, seeds 0,1,2, dtypes
float32/float16/bfloat16, 1024 growth steps) written to ``reports/``. On the
CUDA simulator (no GPU, or ``--device sim``) it is the quick sweep at small
shapes (seed 0, float32/float16, 32 growth steps) written to ``reports/sim/``,
which git ignores, so a local run never overwrites the committed GPU report.

Exit status: 0 when every case, growth run and planted-defect family passes;
1 when any fails (a case over its bound or raising, a growth step over its
bound, a defect escaping, a broken module); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def _seeds(text):
    out = []
    for part in _csv(text):
        if "-" in part[1:]:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def _shard(text):
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected i/n, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"expected 0 <= i < n, got {text!r}")
    return i, n


def _matcher(patterns):
    """None (everything) or a predicate over names; "none" matches nothing."""
    if patterns is None:
        return None
    pats = _csv(patterns)
    if pats == ["none"]:
        return lambda name: False
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in pats)


def parser():
    ap = argparse.ArgumentParser(
        prog="scripts/validate",
        description="Validate every kernel against the float64 oracles: a sweep over kernels x "
                    "shapes x score fixtures x seeds x dtypes, error growth over decode steps, "
                    "and the planted-defect score; writes summary.md, validation.json and plots.",
        epilog="Examples: scripts/validate --quick | scripts/validate --kernels 'batched*' "
               "--growth none --defects none | scripts/validate --shard 0/4 --out reports "
               "(then --resume for what a --deadline cut, and --merge) | scripts/validate "
               "--mark-stale")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=None,
                      help="the quick subset of shapes and fixtures, one seed (default on the "
                           "simulator)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="every shape case (default on a GPU)")
    ap.add_argument("--kernels", help="kernels to sweep: comma list of names or globs, or "
                                      "'none' (default: all; --list shows them)")
    ap.add_argument("--shapes", help="shape cases: comma list of names or globs")
    ap.add_argument("--fixtures", help="score fixtures: normal, large, equal")
    ap.add_argument("--seeds", type=_seeds, help="e.g. 0,1,2 or 0-4 (default: 0,1,2 on a GPU, "
                                                 "0 quick or on the simulator)")
    ap.add_argument("--dtypes", type=_csv, help="storage dtypes: float32, float16, bfloat16")
    ap.add_argument("--steps", type=int, help="decode steps of each growth run (default 1024 "
                                              "on a GPU, 32 on the simulator)")
    ap.add_argument("--growth", help="growth runs: batched_decode, flash_decode, fast_decode, "
                                     "mla_decode, mla_gemm_decode, mla_gemm_fma_decode, "
                                     "mla_fp8_decode, ... (growth.GROWTH_KERNELS), or 'none'")
    ap.add_argument("--defects", help="planted-defect suites by family name (globs), or 'none'")
    ap.add_argument("--mutants", default="first",
                    help="run the product kernels' precision mutants (the judge's resolving "
                         "power) on the cases of these seeds: 'first' (default: the first "
                         "seed), a seed list, or 'none'")
    ap.add_argument("--suite-module", action="append", default=[], metavar="MODULE",
                    help="also run this suite module (import path; repeatable)")
    ap.add_argument("--device", choices=("auto", "gpu", "sim"), default="auto",
                    help="gpu, sim (CUDA simulator) or auto (GPU when there is one)")
    ap.add_argument("--out", help="output folder (default: reports on a GPU, reports/sim on "
                                  "the simulator)")
    ap.add_argument("--shard", type=_shard, metavar="I/N",
                    help="run the I-th of N parts (0-based; every N-th bundle, or balanced "
                         "by --costs) into "
                         "OUT/shards/; combine them with --merge")
    ap.add_argument("--costs", metavar="REPORT",
                    help="a previous report (folder, validation.json or .json.gz) whose measured "
                         "work-group seconds order the run longest first and balance the "
                         "--shard parts (validation/schedule.py), and run a sweep bundle "
                         "longer than a fair share one seed a bundle (cli.split_by_seed); "
                         "every shard of a run must name the same file")
    ap.add_argument("--rebuild", action="store_true",
                    help="rewrite summary.md and the plots of OUT from its validation.json "
                         "(e.g. after a run cut short while writing them); runs nothing")
    ap.add_argument("--index", action="store_true",
                    help="write reports/gpu/runs/INDEX.md (or OUT/INDEX.md): every kept GPU "
                         "run, newest first, fresh or stale against the sources; runs nothing")
    ap.add_argument("--archive", action="store_true",
                    help="compress OUT/validation.json into validation.json.gz (a run kept "
                         "under reports/gpu/runs: a tenth of the bytes; --rebuild, --costs, "
                         "--index and validation.plot read either); runs nothing")
    ap.add_argument("--merge", action="store_true",
                    help="merge OUT/shards/*.json (shard and resume parts) into the report "
                         "and exit")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run whose parts are in OUT/shards/: run only the units "
                         "no part finished, into OUT/shards/resume-K.json; combine with "
                         "--merge")
    ap.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                    help="stop starting units after this many seconds; units not run are "
                         "reported as errors and the report is still written")
    ap.add_argument("--jobs", type=int, default=None,
                    help="worker processes (default: one a CPU core, at most 8, on a GPU, "
                         "where compiling the kernels takes most of the time; up to 2 on "
                         "the simulator)")
    ap.add_argument("--list", action="store_true", help="list the work units and exit")
    ap.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--check-fresh", action="store_true",
                    help="print whether OUT's report, and every other GPU report and stage "
                         "log under OUT (gpu/*.json, bench/summary.md, bench/ncu, gpu/logs), "
                         "measured the kernel sources in the tree (exit 1 if any did not, or "
                         "the report is missing)")
    ap.add_argument("--mark-stale", action="store_true",
                    help="write (or clear) the STALE banner of OUT/summary.md, and rewrite "
                         "OUT/gpu/runs/INDEX.md where it exists (--index)")
    return ap


# ---------------------------------------------------------------------------
# device selection (before numba is imported)
# ---------------------------------------------------------------------------


def _probe_gpu():
    code = ("from numba import cuda; import sys; "
            "sys.exit(0 if cuda.is_available() and len(cuda.gpus) > 0 else 1)")
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def select_device(choice):
    """"sim" or "gpu"; sets NUMBA_ENABLE_CUDASIM for the simulator. Raises
    SystemExit(2) when the choice cannot be honoured."""
    sim_env = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    numba_loaded = "numba" in sys.modules
    if choice == "sim":
        if not sim_env:
            if numba_loaded:
                _usage("--device sim: numba was imported without NUMBA_ENABLE_CUDASIM=1")
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        return "sim"
    if choice == "gpu":
        if sim_env:
            _usage("--device gpu, but NUMBA_ENABLE_CUDASIM=1 is set")
        from attention.core.device import gpu_available

        if not gpu_available():
            _usage("--device gpu: no usable CUDA GPU here (try --device sim)")
        return "gpu"
    if sim_env:
        return "sim"
    if numba_loaded:
        from attention.core.device import gpu_available

        return "gpu" if gpu_available() else _usage("no GPU and numba already imported "
                                                    "without the simulator")
    if _probe_gpu():
        return "gpu"
    print("validate: no CUDA GPU found: running on the CUDA simulator", file=sys.stderr)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    return "sim"


def _usage(msg):
    print(f"validate: {msg}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------------
# work units
# ---------------------------------------------------------------------------


def run_unit(unit):
    """Run one unit (a sweep Case, a GrowthJob, a DefectUnit or a row of the fp8
    quantization table) in this process."""
    import attention  # noqa: F401  (simulator warp intrinsics)
    from validation import defects, fp8_quant, growth, registry, simfast, sweep

    simfast.install()  # the simulator's faster machinery (a no-op on a GPU)

    if isinstance(unit, registry.Case):
        return "case", sweep.run_case(unit)
    if isinstance(unit, growth.GrowthJob):
        return "growth", growth.run_growth(unit)
    if isinstance(unit, defects.DefectUnit):
        return "defect", defects.run_unit(unit)
    if isinstance(unit, fp8_quant.QuantUnit):
        return "quant", unit.run()
    raise TypeError(type(unit).__name__)


def _unit_status(kind, rec):
    if kind == "case":
        extra = f" ratio {rec['ratio']:.3g}" if rec.get("ratio") is not None else ""
        return rec["status"] + extra
    if kind == "growth":
        extra = (f" worst ratio {rec['worst_ratio']:.3g}" if rec.get("worst_ratio") is not None
                 else "")
        return rec["status"] + extra
    if kind == "quant":
        return "not computed" if "detail" in rec else "computed"
    return rec["status"]


class Progress:
    """A text progress bar over work units, one line per finished unit (stderr)."""

    def __init__(self, total, enabled=True, stream=sys.stderr):
        self.total, self.done, self.enabled, self.stream = total, 0, enabled, stream
        self.start = time.time()

    def update(self, label, status):
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.time() - self.start
        self.stream.write(f"[{bar}] {self.done:>4}/{self.total} {elapsed:6.0f}s  {label}: "
                          f"{status}\n")
        self.stream.flush()


def build_units(args, device):
    """(units, early case records, broken suite records, config) for this run."""
    import attention  # noqa: F401
    from validation import defects, growth, registry, report, simfast, sweep

    simfast.install()
    small = device == "sim"
    quick = small if args.quick is None else args.quick
    seeds = args.seeds if args.seeds else ([0] if (quick or small) else [0, 1, 2])
    dtypes = args.dtypes or list(registry.SIM_DTYPES if small else registry.GPU_DTYPES)
    for dt in dtypes:
        if dt not in registry.GPU_DTYPES:
            _usage(f"--dtypes: unknown dtype {dt!r} (float32, float16, bfloat16)")
    steps = args.steps or (growth.SIM_STEPS if small else growth.GPU_STEPS)

    kmatch = _matcher(args.kernels)
    specs = [k for k in registry.KERNELS if kmatch is None or kmatch(k.name)]
    if args.kernels and args.kernels != "none" and not specs:
        _usage(f"--kernels {args.kernels!r} matches none of "
               f"{', '.join(k.name for k in registry.KERNELS)}")
    early, runnable = [], []
    for spec in specs:
        status, why = registry.resolve(spec)
        if status == "ok":
            runnable.append(spec)
        else:
            early.append(sweep.not_available_record(spec, status, why))
    shape_match, fixture_match = _matcher(args.shapes), _matcher(args.fixtures)
    if args.mutants == "none":
        mutant_seeds = []
    elif args.mutants == "first":
        mutant_seeds = seeds[:1]
    else:
        mutant_seeds = _seeds(args.mutants)
    case_list = registry.cases(runnable, small=small, quick=quick, seeds=seeds, dtypes=dtypes,
                               shape_filter=shape_match, fixture_filter=fixture_match,
                               mutant_seeds=mutant_seeds)
    if quick:  # hostile fixtures only on each kind's first quick shape
        first = {}
        for c in case_list:
            first.setdefault(registry.KERNELS_BY_NAME[c.kernel].kind, c.shape)
        case_list = [c for c in case_list
                     if c.fixture == "normal" or first[registry.KERNELS_BY_NAME[c.kernel].kind]
                     == c.shape]

    gmatch = _matcher(args.growth)
    default_growth = growth.DEFAULT_SIM if small else growth.DEFAULT_GPU
    growth_names = [k for k in growth.GROWTH_KERNELS
                    if (k in default_growth if gmatch is None else gmatch(k))]
    growth_jobs = [growth.GrowthJob(k, dt, seeds[0], steps, small)
                   for k in growth_names for dt in dtypes]

    dmatch = None if args.defects in (None, "none") else _matcher(args.defects)
    modules = [] if args.defects == "none" else defects.discover()
    modules += [m for m in args.suite_module if m not in modules]
    defect_units, broken = defects.units(modules, small=small, family_filter=dmatch)

    # the fp8 format's quantization-error rows (host numpy, no kernel), for the fp8
    # entries that run
    from validation import fp8_quant

    kernel_names = [s.name for s in specs]
    quant_units = fp8_quant.units(
        decode=any(n.startswith("decode_fp8") for n in kernel_names),
        mla=any(n.startswith("mla_fp8") for n in kernel_names),
        small=small, seed=seeds[0], quick=quick)
    # long units first (the growth runs are the longest), so worker processes
    # overlap them with the many short cases
    units = (growth_jobs + [c for c in case_list if c.mutants] + defect_units + quant_units
             + [c for c in case_list if not c.mutants])
    config = {
        "command": " ".join(["scripts/validate"] + sys.argv[1:]),
        "device": device, "small": small, "quick": quick, "seeds": seeds, "dtypes": dtypes,
        "steps": steps, "kernels": [s.name for s in specs],
        "growth": growth_names, "suites": modules, "mutant_seeds": mutant_seeds,
        "shard": list(args.shard) if args.shard else None,
        # the whole run's units, before a shard is picked: a merge of shard and
        # resume parts checks that they hold every one (``report.merge``)
        "plan": report.plan_of(u.id for u in units),
    }
    groups = bundles(units)
    if args.costs:  # longest expected bundle first; shards balanced on the same costs
        from validation import schedule

        try:
            table, digest = schedule.load_costs(args.costs)
        except (OSError, ValueError) as exc:
            _usage(f"--costs: {exc}")
        # the shards of a run must share the table (merge compares "costs"), by
        # content: the same file may be named by another path
        config["costs"], config["costs_from"] = digest, str(args.costs)

        def estimate(groups):
            return [table.estimate(group_label([units[j] for j in b]), len(b), _case_keys(
                [units[j] for j in b])) for b in groups]

        est = estimate(groups)
        shards = args.shard[1] if args.shard else 1
        config["split_by_seed"] = split_by_seed(
            [[units[j] for j in b] for b in groups], est,
            shards * (args.jobs or default_jobs(device)))
        if config["split_by_seed"]:
            groups = bundles(units, config["split_by_seed"])
            est = estimate(groups)
        if args.shard:
            picked = schedule.shard(est, args.shard[1])[args.shard[0]]
        else:
            picked = schedule.order(est)
        groups = [groups[j] for j in picked]
    elif args.shard:  # every n-th bundle, in build order
        groups = groups[args.shard[0]::args.shard[1]]
    # whole bundles a shard, so no kernel compiles in two shards; the pool takes
    # the bundles in this order (``bundles`` keeps the order of first appearance)
    units = [units[j] for b in groups for j in b]
    if args.shard and args.shard[0] != 0:
        early, broken = [], []
    return units, early, broken, config


# the detail of a unit a --deadline cut (``validation.runs_index`` counts them by it)
NOT_RUN_DETAIL = "not run: the --deadline was reached first"


class DeadlineReached(Exception):
    """A unit not run because the run's --deadline passed (it counts as failed)."""


def _share_key(unit, index):
    """Sweep cases with one key share their inputs and oracle (the kernels of a kind
    on the same shape, fixture, seed and dtype): they run together in one process,
    so the float64 oracle is computed once (``sweep._refs`` caches it). Cases that
    run precision mutants group by kernel and dtype instead (compiles shared).
    Every other unit is its own group."""
    from validation import registry

    if isinstance(unit, registry.Case) and unit.mutants:
        # a product kernel's mutant cases of one dtype and head geometry share one
        # process: every mutant compiles its own kernels, once a process and
        # geometry (the MLA GEMMs' take tens of seconds each). Not one process a
        # dtype: the fast decode's 23 mutant cases of a dtype (7 head dims) then
        # ran in one worker for over 530 s on the H100, past the --deadline of a
        # two-shard GPU run, while the other workers were idle
        return ("mutants", unit.kernel, unit.dtype, unit.small, _geometry(unit))
    if isinstance(unit, registry.Case):
        spec = registry.KERNELS_BY_NAME.get(unit.kernel)
        kind = spec.kind if spec else unit.kernel
        return ("case", kind, unit.shape, unit.fixture, unit.seed, unit.dtype, unit.small)
    return ("unit", index)


def _geometry(case):
    """What a case's kernels specialise on besides the dtype: the head dim of a
    decode or prefill shape, the MLA shape's dimensions (``registry.Shape.dims``);
    None when the shape is not listed."""
    from validation import registry

    spec = registry.KERNELS_BY_NAME.get(case.kernel)
    try:
        shape = registry.find_shape(spec.kind, case.shape, case.small)
    except (AttributeError, KeyError, LookupError, ImportError):
        return None
    dims = shape.dims
    if "dims" in dims:  # MLA: the geometry, named compactly for the report
        g = dims["dims"]
        return f"nh{g.n_head}_nope{g.d_nope}_rope{g.d_rope}_v{g.d_v}_r{g.kv_rank}"
    return dims.get("d")


def _bundle_key(unit, index):
    """Sweep groups (``_share_key``) whose kernels compile the same, those of one
    kind, shape and dtype (every fixture and seed), form one bundle; every other
    group is its own. A bundle runs in one worker process, one group after
    another, so that process compiles the kind's kernels once for all of them.
    Spread group by group over the workers, each worker compiled them again: in
    the H200 run of 99a23ab about 1,000 of the sweep's 1,726 worker-seconds were
    such repeated compiles (a kernel's first case in a worker took seconds, the
    others hundredths)."""
    key = _share_key(unit, index)
    if key[0] == "case":
        _, kind, shape, _fixture, _seed, dtype, small = key
        return ("bundle", kind, shape, dtype, small)
    return key


def split_by_seed(groups, est, workers):
    """The sweep bundles to run as one bundle a seed, as sorted [kind, shape,
    dtype, small] lists (``_bundle_key``; JSON for the report's config): those
    of several seeds expected to take longer than both the
    longest bundle that cannot be split (growth, mutants, defects: one unit or
    one process) and an even share of the work (all of it over ``workers``, the
    shards' worker processes together). A bundle runs in one worker, so its
    seconds bound a shard's wall time from below: in the H100 run of 3e31c82
    (--seeds 0,1,2, three shards of 16 workers) the ``long_d128`` decode
    bundles took 317-421 s against an even share of 337 s, and the longest
    growth run 344 s. Split, each seed's bundle compiles the kernels again (the
    bundle's point was to compile them once); the estimates of the parts price
    that (``schedule.Table.estimate``)."""
    floor = max([e for g, e in zip(groups, est) if not _case_keys(g)], default=0.0)
    share = sum(est) / max(workers, 1)
    return sorted(list(_bundle_key(g[0], 0)[1:]) for g, e in zip(groups, est)
                  if _case_keys(g) and len({u.seed for u in g}) > 1 and e > max(floor, share))


def _case_keys(units):
    """(kernel, shape, dtype, fixture, seed) of each unit of a sweep bundle, for
    the cost estimate (``schedule.Table.estimate``); () for any other bundle."""
    from validation import registry

    if not all(isinstance(u, registry.Case) and not u.mutants for u in units):
        return ()
    return [(u.kernel, u.shape, u.dtype, u.fixture, u.seed) for u in units]


def bundles(units, by_seed=()):
    """The units' indices in bundles (``_bundle_key``): a list of index lists, in
    the order of each bundle's first unit; inside a bundle the units of one
    share group (``_share_key``) stay together, in unit order. ``by_seed``: the
    sweep bundles, as [kind, shape, dtype, small], run as one bundle a seed
    (``split_by_seed``)."""
    out = {}
    split = {tuple(k) for k in by_seed}
    for i, u in enumerate(units):
        key = _bundle_key(u, i)
        if key[0] == "bundle" and key[1:] in split:
            key = key + (u.seed,)
        groups = out.setdefault(key, {})
        groups.setdefault(_share_key(u, i), []).append(i)
    return [[i for g in groups.values() for i in g] for groups in out.values()]


def run_units(units):
    """Run a group of units in this process, in order."""
    return [run_unit(u) for u in units]


def run_timed(units):
    """``run_units`` and its wall seconds: (records, seconds)."""
    import time

    start = time.perf_counter()
    recs = run_units(units)
    return recs, time.perf_counter() - start


def _cases(n):
    return f"{n} case" if n == 1 else f"{n} cases"


def group_label(units):
    """A work group's name in the report's work-group row: a sweep bundle as
    ``kernels/shape/dtype (n cases)`` (its kernels, comma-separated),
    precision-mutant cases as ``mutants kernel/dtype/geometry (n cases)``, any
    other unit by its id."""
    u = units[0]
    key = _share_key(u, 0)
    if key[0] == "mutants":
        return f"mutants {u.kernel}/{u.dtype}/{key[4]} ({_cases(len(units))})"
    if key[0] == "case":
        kernels = sorted({v.kernel for v in units})
        return f"{','.join(kernels)}/{u.shape}/{u.dtype} ({_cases(len(units))})"
    return u.id if len(units) == 1 else f"{u.id} (+{len(units) - 1})"


def default_jobs(device):
    """Worker processes when ``--jobs`` is not given: on a GPU one a CPU core, at
    most 8 (each compiles its own kernels, which is most of a GPU run's time; a
    one-process full sweep takes over 330 s on the H200 machine); on the
    simulator, whose kernels run as Python threads, up to 2."""
    cores = os.cpu_count() or 1
    return min(2, cores) if device == "sim" else min(8, cores)


def execute(units, jobs, progress, deadline=None, timings=None, by_seed=()):
    """Run units (in worker processes when jobs > 1); returns [(kind, record)] in unit order.

    Units that share inputs and oracle run as one group (``_share_key``), and the
    groups whose kernels compile the same as one bundle in one worker
    (``bundles``). ``deadline`` (a ``time.monotonic()`` value): units not finished
    by then are recorded as errors ("not run: deadline reached") and the report is
    still written. ``timings`` (a list): one dict a work group appended, its
    ``group`` (``group_label``), ``units``, ``seconds`` (its wall time in its
    worker) and ``state``: ``done``, ``crashed``, or at the deadline
    ``running`` (started, or queued to a worker; seconds None) or ``not
    started``: where a run's time went, and its long poles.
    """
    import time

    results = [None] * len(units)
    late = DeadlineReached(NOT_RUN_DETAIL)
    groups = {}
    for i, u in enumerate(units):
        groups.setdefault(_share_key(u, i), []).append(i)
    groups = list(groups.values())

    def record(idxs, recs):
        for i, r in zip(idxs, recs):
            results[i] = r
            progress.update(units[i].id, _unit_status(*r))

    timings = [] if timings is None else timings

    def timed(idxs, state, seconds=None):
        timings.append({"group": group_label([units[i] for i in idxs]), "units": len(idxs),
                        "seconds": None if seconds is None else round(seconds, 2),
                        "state": state})

    if jobs <= 1 or len(groups) <= 1:
        for idxs in groups:
            if deadline is not None and time.monotonic() > deadline:
                record(idxs, [_crashed(units[i], late) for i in idxs])
                timed(idxs, "not started")
            else:
                recs, seconds = run_timed([units[i] for i in idxs])
                record(idxs, recs)
                timed(idxs, "done", seconds)
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, TimeoutError, as_completed

    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)
    futures = {pool.submit(run_timed, [units[i] for i in idxs]): idxs
               for idxs in bundles(units, by_seed)}
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        for fut in as_completed(futures, timeout=timeout):
            idxs = futures[fut]
            try:
                recs, seconds = fut.result()
                timed(idxs, "done", seconds)
            except Exception as exc:  # noqa: BLE001 - a worker crash fails its units
                recs = [_crashed(units[i], exc) for i in idxs]
                timed(idxs, "crashed")
            record(idxs, recs)
    except TimeoutError:
        for fut, idxs in futures.items():
            if not fut.done():
                timed(idxs, "running" if fut.running() else "not started")
        for i, r in enumerate(results):
            if r is None:
                results[i] = _crashed(units[i], late)
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()  # units still running are abandoned
        pool.shutdown(wait=False, cancel_futures=True)
        return results
    pool.shutdown()
    return results


def _crashed(unit, exc):
    from validation import defects, fp8_quant, growth, registry, sweep

    detail = str(exc) if isinstance(exc, DeadlineReached) else \
        f"worker process failed: {type(exc).__name__}: {exc}"
    if isinstance(unit, fp8_quant.QuantUnit):
        return "quant", unit.failed(detail)
    if isinstance(unit, registry.Case):
        rec = sweep.base_record(unit)
        rec.update(status="error", detail=detail)
        return "case", rec
    if isinstance(unit, growth.GrowthJob):
        return "growth", {"id": unit.id, "kernel": unit.kernel, "dtype": unit.dtype,
                          "seed": unit.seed, "steps": unit.steps, "status": "error",
                          "passed": False, "detail": detail}
    assert isinstance(unit, defects.DefectUnit)
    return "defect", {"id": unit.id, "module": unit.module, "family": unit.module,
                      "defect": unit.defect, "status": "error", "failing": [],
                      "detail": detail, "seconds": 0.0}


# ---------------------------------------------------------------------------
# resuming a run cut by its deadline
# ---------------------------------------------------------------------------


def resume_by_seed(units, by_seed, parts):
    """The sweep bundles a resumed run runs one bundle a seed, as ``split_by_seed``
    gives them: ``by_seed`` (this plan's split), those the parts' runs split, and
    every bundle of ``units`` (the units left to run) that a part reports as
    running when its deadline struck (a ``work_groups`` entry of state
    "running" and the bundle's ``group_label``): a bundle that did not fit in
    one part's time should not be started whole again."""
    split = {tuple(k) for k in by_seed}
    split |= {tuple(k) for p in parts for k in p["config"].get("split_by_seed") or []}
    running = {g["group"] for p in parts for g in p.get("work_groups") or []
               if g.get("state") == "running"}
    for b in bundles(units, sorted(split)):
        group = [units[i] for i in b]
        if (_case_keys(group) and len({u.seed for u in group}) > 1
                and group_label(group) in running):
            split.add(_bundle_key(group[0], 0)[1:])
    return sorted(list(k) for k in split)


def resume_plan(out, units, config):
    """(units left, by_seed, names of the parts read) for ``--resume``: the plan's
    ``units`` (``build_units``, no shard) less every unit some part in
    ``out/shards`` holds a finished record for (``report.finished``: a crash is
    a result; a unit the deadline cut is run again). Raises ValueError naming
    what differs when there are no parts or a part is not of this run: other
    kernel sources or criterion than the tree's, other ``report.MERGE_SAME``
    settings or another plan than this command's."""
    from validation import report
    from validation.provenance import criterion_hash, kernel_source_hash

    files = report.part_files(out)
    if not files:
        raise ValueError(f"no parts in {Path(out) / 'shards'}: start the run with --shard 0/N")
    parts = [report.read_part(f) for f in files]
    tree = {"provenance": {"kernel_source_hash": kernel_source_hash(),
                           "criterion_hash": criterion_hash()}, "config": config}
    report.check_one_run([(f.name, p) for f, p in zip(files, parts)]
                         + [("this tree and command", tree)])
    done = report.finished_ids(parts)
    left = [u for u in units if u.id not in done]
    by_seed = resume_by_seed(left, config.get("split_by_seed", ()), parts)
    return left, by_seed, [f.name for f in files]


def _resume_conflict(args):
    """The first option given with --resume that it cannot be combined with, or None."""
    for flag in ("shard", "merge", "list", "rebuild", "index", "archive", "check_fresh",
                 "mark_stale"):
        if getattr(args, flag):
            return "--" + flag.replace("_", "-")
    return None


def _write_part(path, part):
    """Write a shard or resume part; returns its failing records (cases, growth
    runs, defect units, broken suites)."""
    from validation import report

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(part, indent=1, default=report._json_default))
    bad = [r for r in part["cases"] if r["status"] in report.FAILING_CASE]
    bad += [g for g in part["growth"] if g["status"] in report.FAILING_GROWTH]
    bad += [u for u in part["defect_units"] if u["status"] in ("escaped", "error", "clean-fail")]
    return bad + part["broken_suites"]


def main(argv=None):
    args = parser().parse_args(argv)
    from validation import report

    if args.resume and _resume_conflict(args):
        _usage(f"--resume cannot be combined with {_resume_conflict(args)}")

    if args.check_fresh or args.mark_stale:
        out = Path(args.out) if args.out else ROOT / "reports"
        f = report.mark_stale(out) if args.mark_stale else report.freshness(out)
        runs = out / "gpu" / "runs"
        if args.mark_stale and runs.is_dir():  # the runs' index states freshness too
            from validation import runs_index

            print(f"validate: wrote {runs_index.write_index(runs)}")
        if f["state"] == "missing":
            print(f"missing: no {report.JSON_NAME} in {out}")
            return 1
        if f["state"] == "fresh":
            print(f"fresh: {out} measured kernel sources {f['code_hash']}")
        else:
            print(f"stale: {out} measured kernel sources {f['report_hash']}, the code hashes "
                  f"to {f['code_hash']}; summary.md {'carries' if f['marked'] else 'lacks'} "
                  f"the STALE banner")
        if args.mark_stale:
            return 0
        from validation import gpu_reports

        rows = gpu_reports.inventory(out)
        rest = [r for r in rows if r["kind"] != "validation"]
        others = [r for r in rest if r["state"] != "fresh"]
        print(f"GPU reports in {out} (state, file, commit, kernel sources, GPU, time):")
        print("\n".join("  " + line for line in gpu_reports.table(rows)))
        if others:
            cut = sum(r["state"] == "partial" for r in others)
            print(f"{len(others) - cut} of the {len(rest)} other GPU reports measured other "
                  f"kernel sources or state none, {cut} measured these in a run cut short: "
                  f"rerun their scripts/gpu_all stages on a GPU")
        return 0 if f["state"] == "fresh" and not others else 1

    if args.index:
        from validation import runs_index

        path = runs_index.write_index(Path(args.out) if args.out else ROOT / "reports/gpu/runs")
        print(f"validate: wrote {path}")
        return 0

    if args.archive:
        if not args.out:
            print("validate --archive: name the run folder with --out", file=sys.stderr)
            return 2
        try:
            path = report.archive(Path(args.out))
        except (OSError, ValueError) as exc:
            print(f"validate --archive: {exc}", file=sys.stderr)
            return 2
        print(f"validate: wrote {path}")
        return 0

    if args.rebuild:
        out = Path(args.out) if args.out else ROOT / "reports"
        try:
            rep = report.read(out)
        except OSError as exc:
            print(f"validate --rebuild: {exc}", file=sys.stderr)
            return 2
        report.write(rep, out)  # the same results; plots and summary.md written anew
        _print_verdict(rep, out)
        return 0 if rep["verdict"]["passed"] else 1

    if args.merge:
        out = Path(args.out) if args.out else ROOT / "reports"
        try:
            rep = report.merge(out)
        except ValueError as exc:
            print(f"validate --merge: {exc}", file=sys.stderr)
            return 2
        report.write(rep, out)
        _print_verdict(rep, out)
        return 0 if rep["verdict"]["passed"] else 1

    device = select_device(args.device)
    start = time.time()
    units, early, broken, config = build_units(args, device)
    if args.list:
        for u in units:
            print(u.id)
        for r in early:
            print(f"{r['id']}: {r['status']}")
        return 0
    out = Path(args.out) if args.out else ROOT / ("reports/sim" if device == "sim" else "reports")
    by_seed, plan_units = config.get("split_by_seed", ()), config["plan"]["units"]
    if args.resume:
        try:
            units, by_seed, names = resume_plan(out, units, config)
        except ValueError as exc:
            print(f"validate --resume: {exc}", file=sys.stderr)
            return 2
        if not units:
            print(f"validate: nothing remains: every unit of the plan has a finished record "
                  f"in {out / 'shards'}; combine with --merge --out {out}")
            return 0
        config.update(resumed_from=names, **({"split_by_seed": by_seed} if by_seed else {}))
    jobs = args.jobs if args.jobs else default_jobs(device)
    progress = Progress(len(units), enabled=not args.no_progress)
    if not args.no_progress:
        print(f"validate: {len(units)} units on {device} ({jobs} worker"
              f"{'s' if jobs > 1 else ''})", file=sys.stderr)
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    timings = []
    results = execute(units, jobs, progress, deadline, timings, by_seed=by_seed)
    cases = early + [r for kind, r in results if kind == "case"]
    growth_recs = [r for kind, r in results if kind == "growth"]
    unit_recs = [r for kind, r in results if kind == "defect"]
    wall = time.time() - start
    from validation.provenance import provenance

    prov = provenance(seeds=config["seeds"], wall_seconds=round(wall, 2))
    quant = [r for kind, r in results if kind == "quant"]
    if args.shard or args.resume:
        part = {"schema": report.SCHEMA, "provenance": prov, "config": config,
                "wall_seconds": wall, "cases": cases, "growth": growth_recs,
                "defect_units": unit_recs, "broken_suites": broken, "quantization": quant,
                "work_groups": timings}
        if args.shard:
            path = report.shard_path(out, *args.shard)
            bad = _write_part(path, part)
            print(f"validate: shard {args.shard[0]}/{args.shard[1]} written to {path} "
                  f"({len(bad)} failing unit(s)); combine with --merge --out {out}")
        else:
            k, path = report.next_resume(out)
            bad = _write_part(path, part)
            print(f"validate: resume part {k} written to {path} ({len(units)} of {plan_units} "
                  f"units run, {len(bad)} failing); combine with --merge --out {out}")
        return 1 if bad else 0
    rep = report.build(cases=cases, growth=growth_recs, defect_units=unit_recs,
                       broken_suites=broken, config=config, provenance=prov, wall_seconds=wall,
                       quantization=quant, work_groups=timings)
    report.write(rep, out)
    _print_verdict(rep, out)
    return 0 if rep["verdict"]["passed"] else 1


def _print_verdict(rep, out):
    from validation import report

    v = rep["verdict"]
    print(f"validate: {'PASS' if v['passed'] else 'FAIL'}: report in {out}/"
          f"{'summary.md'} ({rep['wall_seconds']:.0f} s)")
    for text in v["failures"][:20]:
        print(f"  {text}")
    if len(v["failures"]) > 20:
        print(f"  ... {len(v['failures']) - 20} more in {report.report_file(out)}")
