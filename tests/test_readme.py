"""The README's "Start here" snippets run as written (on the simulator where
there is no GPU), and print what their comments say they print."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def start_here_snippets():
    text = README.read_text()
    start = text.index("## Start here")
    section = text[start:text.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_start_here_has_the_product_and_mla_snippets():
    snippets = start_here_snippets()
    assert len(snippets) == 2
    assert "DecodePlan" in snippets[0] and "mla_decode" in snippets[1]


@pytest.mark.device
@pytest.mark.parametrize("index", [0, 1])
def test_snippet_runs_and_prints_what_it_says(index):
    code = start_here_snippets()[index]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": "readme"})
    want = [c.strip() for c in re.findall(r"print\(.*\)[ \t]+#[ \t]*(.*)", code)]
    assert printed.getvalue().split("\n")[:len(want)] == want
