"""Which worker bundle runs first, and in which shard: longest expected first.

A validation run is a list of bundles (``cli.bundles``: index lists into the
units, each run by one worker process). Without measured costs the bundles go
to the worker pool in build order (growth runs, precision-mutant groups,
planted defects, the sweep) and shard ``i`` of ``n`` takes every n-th bundle.

With ``--costs`` (a previous report: its ``validation.json`` lists every work
group's wall seconds, ``work_groups``) each bundle gets an expected cost, and

- the shards are filled greedily, longest bundle first, each into the shard
  with the least expected work so far (so the shards' sums come out even);
- inside a shard (or an unsharded run) the bundles go to the pool longest
  first, so the long poles start at once and the short bundles fill the gaps.

Why: in the H100 run of 00e7132 (two shards, 16 workers each, a --deadline of
540 s) both shards held about 7,060 worker-seconds, 441 s a worker if spread
evenly, but the build order started the 33-case sweep bundles last, and 16 of
them were still running at the deadline. Replayed on the recorded seconds, the
shards take an estimated 455 s each with costs against 519 and 502 s in the build
order (``tests/test_validation.py::test_measured_costs_shorten_the_replayed_shards``).

A bundle's expected cost, the first rule that applies:

1. its label's measured seconds (``cli.group_label``);
2. a label measured at another seed (``growth/K/dtype/s1/1024`` from ``.../s0/...``):
   that label's seconds;
3. a sweep bundle whose cases' kernels, shapes and dtypes the report ran (at
   any seed; another seed list or another kernel list makes another label):
   each case the report ran (kernel, shape, dtype, fixture, seed) at its
   recorded seconds (``Table.exact``: a product kernel's first sweep case is
   at seed 1, its seed-0 cases running with the mutants, and takes the
   compile), every other case at the median of a
   (kernel, shape, dtype)'s cases but its dearest (``Table.case_costs``), and
   the dearest case of each (kernel, shape, dtype) in the bundle at least its
   dearest recorded case (the compile: a bundle without the case that compiled
   still pays one); plus each (fixture, seed) the bundle holds at the report's
   seconds a (fixture, seed) of that shape and dtype outside the cases' own
   (``Table.shared``: the float64 oracle the kernels of a case share, the
   worker's start). Cases run with precision mutants are left out (their
   seconds hold the mutants' compiles), unless a kernel has no other case (a
   seed-0 report's product kernels). The case seconds alone make 87 % of the
   sweep bundles' seconds in the H100 run of 48965b3, 58 % of ``long_d128``'s
   at float32;
4. the median seconds per unit of its class (the label up to its first ``/``:
   ``growth``, a mutant kernel, a sweep bundle's kernel list, ``defects``) times
   its units; a class not measured, the median seconds per unit of all groups.

Rule 3 is what makes a run of other seeds plannable: rule 4 alone priced the
sweep of ``--seeds 1,2`` (no mutants, defects or growth) at 13,338
worker-seconds and rule 3 at 3,900, against the seed-0 sweep's measured 2,345 s
for half as many cases: most of a bundle's time is its compiles, which more
seeds in the bundle do not repeat.

How good the estimate was: the H100 run of 48965b3, sharded on 00e7132's
seconds (455 s a shard expected), took 552 and 514 s. Replayed on its own
seconds the pool model gives 538 and 493 s, so the model is within 4 %. The
miss was the prices: four decode sweep bundles that 00e7132 never reached (its
deadline) took the class median, 56 s, ran 92-164 s, and being priced short
they started last and made the tail. A report with every unit run prices the
next run's bundles from measurements.

Rule 3 on the next run, ``--seeds 0,1,2`` in three shards on 48965b3's seconds
(H100, 3e31c82): priced 372, 323 and 324 s, measured 408, 432 and 397 s; the
pool model on the run's own seconds gives 398, 421 and 387 s. In all, 16,193
worker-seconds against 15,405 priced: the defect suites took 352 s more than at
48965b3 (the same units), the three ``long_d128`` decode sweep bundles 324 s more
(priced 189 / 321 / 276 s, measured 317 / 421 / 372 s) and the MLA sweep bundles
223 s more. In ``long_d128`` the cases were priced about right (208 s priced,
175 s measured at float16); the time outside them was not: about 27 s a
(fixture, seed) against the 13 s of 48965b3's bundle. A seed-0 bundle holds no
product kernel (their seed-0 cases run with the mutants), and seeds 1 and 2 bring
them in, with the float32 baselines in their own summation orders. A report of
several seeds prices that share from bundles that hold them, and its cases at
their recorded seconds (``Table.exact``), so a run of the same seeds prices from
it as it ran. The longest bundle (421 s)
bounds a shard from below: ``cli.split_by_seed`` now runs such a bundle one seed
a bundle, trading recompiles for a shorter tail.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
import statistics
from pathlib import Path

_SEED = re.compile(r"/s\d+/")
_SWEEP = re.compile(r"^([^/ ]+)/([^/]+)/([^/ ]+) \(\d+ cases?\)$")  # cli.group_label's


def load_costs(path):
    """The cost ``Table`` of a report folder or its ``validation.json`` (a merged
    or a shard file: any JSON with ``work_groups``; an archived
    ``validation.json.gz`` too): its groups' seconds, its cases' seconds, the
    sweep bundles' seconds outside their cases; and the sha256 of its JSON text
    (first 16 hex digits; the same whether the file is compressed or not).
    Groups without seconds (cut by a deadline, crashed) are left out. Raises
    ValueError when the file has no timed work groups."""
    from validation.report import read_bytes

    p = Path(path)
    raw = read_bytes(p)
    rep = json.loads(raw)
    groups = rep.get("work_groups") or []
    costs = {}
    for g in groups:
        if g.get("seconds") is not None:
            costs[g["group"]] = max(costs.get(g["group"], 0.0), float(g["seconds"]))
    if not costs:
        raise ValueError(f"{p} lists no timed work groups (a report written "
                         f"before work-group timing, or every group cut short)")
    units = {g["group"]: g.get("units") or 1 for g in groups}
    cases, by_bundle, exact, mutated = {}, {}, {}, {}
    for c in rep.get("cases") or []:
        key = (c.get("kernel"), c.get("shape"), c.get("dtype"))
        if None in key:
            continue
        if c.get("mutants"):
            # a case run with its precision mutants ran in the mutants' group and
            # its seconds hold the mutants' compiles and runs too: they price the
            # kernel's sweep cases only where the report has no plain case of it
            # (a seed-0 run: the product kernels), high, as before
            if c.get("seconds") is not None and c.get("status") in ("pass", "fail"):
                mutated.setdefault(key, []).append(float(c["seconds"]))
            continue
        by_bundle.setdefault(key[1:], []).append(c)
        if c.get("status") == "unsupported":  # rejected before any work
            cases.setdefault(key, [])
            exact[key + (c.get("fixture"), c.get("seed"))] = 0.0
        elif c.get("seconds") is not None and c.get("status") in ("pass", "fail"):
            cases.setdefault(key, []).append(float(c["seconds"]))
            exact[key + (c.get("fixture"), c.get("seed"))] = float(c["seconds"])
    for key, secs in mutated.items():
        if key not in cases:
            cases[key] = secs
    # a sweep bundle's seconds outside its cases' own, a (fixture, seed) it held
    shared = {}
    for label, secs in costs.items():
        m = _SWEEP.match(label)
        if not m:
            continue
        kernels = set(m.group(1).split(","))
        mine = [c for c in by_bundle.get((m.group(2), m.group(3)), []) if c["kernel"] in kernels]
        pairs = {(c.get("fixture"), c.get("seed")) for c in mine}
        if pairs:
            own = sum(float(c.get("seconds") or 0.0) for c in mine)
            shared[(m.group(2), m.group(3))] = max(secs - own, 0.0) / len(pairs)
    return Table(costs, units, cases, shared, exact), hashlib.sha256(raw).hexdigest()[:16]


def _class(label):
    return label.split("/", 1)[0]


def _seedless(label):
    return _SEED.sub("/s*/", label)


class Table:
    """Measured seconds by group label, with what the estimate of an unmeasured
    label falls back on (module docstring): the labels' seconds by seedless
    label, each (kernel, shape, dtype)'s (first case, further case) seconds
    (``cases``: {(kernel, shape, dtype): [judged cases' seconds]}; an empty
    list, a dtype the kernel rejects: no cost), the seconds a (fixture, seed)
    outside the cases (``shared``: {(shape, dtype): seconds}), each recorded
    case's seconds (``exact``: {(kernel, shape, dtype, fixture, seed):
    seconds}) and the per-unit medians."""

    def __init__(self, seconds, units, cases=None, shared=None, exact=None):
        self.seconds = dict(seconds)
        self.seedless = {}
        per = {}
        for label, s in self.seconds.items():
            per.setdefault(_class(label), []).append(s / max(units.get(label, 1), 1))
            key = _seedless(label)
            self.seedless[key] = max(self.seedless.get(key, 0.0), s)
        self.per_unit = {c: statistics.median(v) for c, v in per.items()}
        self.overall = statistics.median(v for vs in per.values() for v in vs)
        rest = [x for v in (cases or {}).values() for x in sorted(v)[:-1]]
        self.further = statistics.median(rest) if rest else 0.0
        self.case_costs = {k: (max(v), statistics.median(sorted(v)[:-1]) if len(v) > 1
                               else self.further) if v else (0.0, 0.0)
                           for k, v in (cases or {}).items()}
        self.shared = dict(shared or {})
        self.exact = dict(exact or {})

    def estimate(self, label, units, cases=()):
        """Expected seconds of a group named ``label`` with ``units`` units;
        ``cases``: a sweep bundle's (kernel, shape, dtype, fixture, seed) a
        unit, in order."""
        if label in self.seconds:
            return self.seconds[label]
        if _seedless(label) in self.seedless:
            return self.seedless[_seedless(label)]
        if cases and all(c[:3] in self.case_costs for c in cases):
            # each (kernel, shape, dtype): its cases at their recorded seconds (a
            # case the report did not run: the further-case price), the dearest
            # of them raised to the compile (the dearest recorded case). So a
            # bundle the report ran costs what its cases took, a compile they took
            # included, and one without the compiling case still pays one compile
            by_key = {}
            for c in cases:
                further = self.case_costs[c[:3]][1]
                by_key.setdefault(c[:3], []).append(self.exact.get(tuple(c), further))
            total = sum(sum(x) - max(x) + max(max(x), self.case_costs[k][0])
                        for k, x in by_key.items())
            pairs = {(c[1], c[2], c[3], c[4]) for c in cases}
            return total + sum(self.shared.get(p[:2], 0.0) for p in pairs)
        return self.per_unit.get(_class(label), self.overall) * max(units, 1)


def order(bundle_costs):
    """Bundle positions, longest expected first (ties: build order)."""
    return sorted(range(len(bundle_costs)), key=lambda j: (-bundle_costs[j], j))


def shard(bundle_costs, count):
    """Positions of the bundles in each of ``count`` shards: longest first, each
    into the shard with the least expected work so far (ties: the lower shard);
    inside a shard, longest first. Every position lands in exactly one shard."""
    heap = [(0.0, s) for s in range(count)]
    parts = [[] for _ in range(count)]
    for j in order(bundle_costs):
        load, s = heapq.heappop(heap)
        parts[s].append(j)
        heapq.heappush(heap, (load + bundle_costs[j], s))
    return parts


def makespan(costs, workers):
    """Wall seconds of running bundles of these costs, in this order, on a pool
    of ``workers`` that hands each free worker the next bundle (the process
    pool's first-in first-out queue)."""
    free = [0.0] * max(workers, 1)
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)
