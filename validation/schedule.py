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

A bundle's expected cost: its label's measured seconds (``cli.group_label``);
a label not measured (another kernel list, another case count) takes the median
seconds per unit of its class (the label up to its first ``/``: ``growth``, a
mutant kernel, a sweep bundle's kernel list, ``defects``) times its units; a
class not measured, the median seconds per unit of all groups.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import statistics
from pathlib import Path


def load_costs(path):
    """{group label: seconds} from a report folder or its ``validation.json``
    (a merged or a shard file: any JSON with ``work_groups``; an archived
    ``validation.json.gz`` too), and the sha256 of its JSON text (first 16 hex
    digits; the same whether the file is compressed or not). Groups without
    seconds (cut by a deadline, crashed) are left out. Raises ValueError when the file has no work groups."""
    from validation.report import read_bytes

    p = Path(path)
    raw = read_bytes(p)
    groups = json.loads(raw).get("work_groups") or []
    costs = {}
    for g in groups:
        if g.get("seconds") is not None:
            costs[g["group"]] = max(costs.get(g["group"], 0.0), float(g["seconds"]))
    if not costs:
        raise ValueError(f"{p} lists no timed work groups (a report written "
                         f"before work-group timing, or every group cut short)")
    units = {g["group"]: g.get("units") or 1 for g in groups}
    return Table(costs, units), hashlib.sha256(raw).hexdigest()[:16]


def _class(label):
    return label.split("/", 1)[0]


class Table:
    """Measured seconds by group label, with the per-unit medians the estimate
    of an unmeasured label falls back on."""

    def __init__(self, seconds, units):
        self.seconds = dict(seconds)
        per = {}
        for label, s in self.seconds.items():
            per.setdefault(_class(label), []).append(s / max(units.get(label, 1), 1))
        self.per_unit = {c: statistics.median(v) for c, v in per.items()}
        self.overall = statistics.median(v for vs in per.values() for v in vs)

    def estimate(self, label, units):
        """Expected seconds of a group named ``label`` with ``units`` units."""
        if label in self.seconds:
            return self.seconds[label]
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
