"""The contract between a kernel family's falsification suite and the runner.

Each family has a module ``validation/suite_<family>.py`` exposing::

    FAMILY: str                       # e.g. "batched_decode"
    DEFECTS: tuple[str, ...]          # planted defects this suite must catch
    def run_suite(defect=None, *, small=True) -> list[Check]

``run_suite(None)`` must return only passing checks; ``run_suite(d)`` for each
``d`` in DEFECTS must return at least one failing check (the defect is
"caught"). ``small`` selects simulator-sized shapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str = ""


def caught(checks) -> bool:
    """A planted defect is caught when any check fails."""
    return any(not c.passed for c in checks)
