"""Import layering of the kernel packages, checked from the source with ``ast``.

Rules (every ``import`` / ``from ... import`` of a module counts, at module level
or inside a function, class or ``if`` block; relative imports are resolved;
``importlib.import_module("...")`` with a literal name counts too):

(a) kernels (every module under ``attention/`` and ``mla/``) never import the
    validation or bench packages or the float64 oracles (``attention.oracle``,
    ``mla.oracle``): a kernel judged by an oracle must not compute with it. The
    oracle modules themselves may import each other (``mla.oracle`` builds on
    ``attention.oracle``); they are still held to the rest of (a).
(b) the product path (``attention.core``, ``attention.decode``,
    ``attention.cache``, ``attention.prefill``, ``attention.gemm``, ``mla``)
    never imports ``attention.reference`` (the seed designs, kept as readable
    references and defect carriers: attention/reference/README.md).

``from pkg import name`` is also read as an import of the module that
``pkg/__init__.py`` takes ``name`` from, so a re-export does not hide a
forbidden import. What these rules do not see: ``attention/__init__.py`` (the
package's public API, outside the product sub-packages) re-exports the
reference decode kernels, so importing any ``attention`` submodule loads
``attention.reference`` at run time; the rules are about which code a module
depends on directly.

Every check runs on the source alone (plain process; nothing is imported).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_PACKAGES = ("attention", "mla")

# rule (a)
NOT_FOR_KERNELS = ("validation", "bench", "attention.oracle", "mla.oracle")
ORACLE_MODULES = ("attention.oracle", "mla.oracle")
ORACLES = ("attention.oracle", "mla.oracle")
# rule (b)
PRODUCT_PACKAGES = ("attention.core", "attention.decode", "attention.cache",
                    "attention.prefill", "attention.gemm", "mla")
REFERENCE = "attention.reference"

# Known violations in modules this test's author does not maintain, each a
# (module, imported module) pair with the reason; the imported module covers its
# attributes and submodules (``from attention.reference.warp_decode import X``).
# A pair listed here is tolerated; any other import by the same module is still
# checked. An entry whose import is gone draws a warning
# (test_allow_list_entries_are_still_needed): delete it then.
ALLOWED = {}


def allowed(module, target):
    """Whether ``ALLOWED`` lists the import of ``target`` by ``module``."""
    return any(module == m and _within(target, (t,)) for m, t in ALLOWED)


# ---------------------------------------------------------------------------
# the checker
# ---------------------------------------------------------------------------

def module_name(path, root=ROOT):
    """``attention/prefill/kernels.py`` -> ``("attention.prefill.kernels", False)``;
    a package's ``__init__.py`` -> ``(package, True)``."""
    parts = list(Path(path).relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _resolve_relative(module, is_package, level, name):
    """The absolute name of ``from <level dots><name> import ...`` in ``module``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(package):
        raise ImportError(f"{module}: relative import beyond the top-level package")
    base = package[:len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_import_module_call(node):
    func = node.func
    return ((isinstance(func, ast.Attribute) and func.attr == "import_module")
            or (isinstance(func, ast.Name) and func.id == "import_module"))


def reexports(package, root=ROOT):
    """``{name: module}`` for the ``from X import name`` lines of ``package/__init__.py``
    (absolute and relative); empty when the package has no such file."""
    init = root.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return {}
    found = {}
    for node in ast.walk(ast.parse(init.read_text(), str(init))):
        if isinstance(node, ast.ImportFrom):
            origin = (_resolve_relative(package, True, node.level, node.module)
                      if node.level else node.module)
            for alias in node.names:
                found[alias.asname or alias.name] = origin
    return found


def is_module(name, root=ROOT):
    """Whether ``name`` is a module or package file under ``root``."""
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(source, module, is_package=False, root=ROOT):
    """Every module ``source`` (the text of module ``module``) imports, as a list of
    ``(line, module name)``: ``import a.b`` gives ``a.b``; ``from a import b`` gives
    ``a``, ``a.b`` when that is a module, and, when ``a/__init__.py`` re-exports
    ``b`` from module ``c``, ``c``; ``import_module("x")`` gives ``x``. Imports
    anywhere in the file count (functions, classes, conditionals)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(module, is_package, node.level, node.module)
                    if node.level else node.module)
            found.append((node.lineno, base))
            origins = reexports(base, root)
            for alias in node.names:
                if alias.name == "*":
                    continue
                if is_module(f"{base}.{alias.name}", root):
                    found.append((node.lineno, f"{base}.{alias.name}"))
                if alias.name in origins:
                    found.append((node.lineno, origins[alias.name]))
        elif (isinstance(node, ast.Call) and _is_import_module_call(node) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _within(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layering_violations(source, module, is_package=False, root=ROOT):
    """Breaches of rules (a) and (b) by module ``module`` with text ``source``:
    a sorted list of ``(line, imported module, rule text)``; empty when it keeps
    both. Modules outside ``attention`` and ``mla`` are bound by neither."""
    if not _within(module, KERNEL_PACKAGES):
        return []
    forbidden = []
    barred = NOT_FOR_KERNELS
    if module in ORACLE_MODULES:
        barred = tuple(p for p in NOT_FOR_KERNELS if p not in ORACLES)
    forbidden.append((barred, "(a) kernels never import validation, bench or the oracles"))
    if _within(module, PRODUCT_PACKAGES):
        forbidden.append(((REFERENCE,), "(b) the product path never imports attention.reference"))
    hits = set()
    for line, target in imported_modules(source, module, is_package, root):
        for prefixes, rule in forbidden:
            if _within(target, prefixes):
                hits.add((line, target, rule))
    return sorted(hits)


def kernel_modules(root=ROOT):
    """``[(path, module, is_package)]`` for every .py file under the kernel packages."""
    out = []
    for pkg in KERNEL_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            name, is_package = module_name(path, root)
            out.append((path, name, is_package))
    return out


def repository_violations(root=ROOT):
    """``{(module, imported module): [(file:line, rule)]}`` over every kernel module."""
    found = {}
    for path, name, is_package in kernel_modules(root):
        for line, target, rule in layering_violations(path.read_text(), name, is_package, root):
            rel = path.relative_to(root)
            found.setdefault((name, target), []).append((f"{rel}:{line}", rule))
    return found


# ---------------------------------------------------------------------------
# the repository
# ---------------------------------------------------------------------------

def test_the_checker_sees_every_kernel_module():
    names = {name for _, name, _ in kernel_modules()}
    for expected in ("attention.prefill.kernels", "attention.decode.fast",
                     "attention.reference.prefill_paths", "attention.oracle", "mla.pipeline",
                     "mla.oracle", "attention.core"):
        assert expected in names, expected


def test_kernels_keep_the_layering():
    found = repository_violations()
    bad = {pair: where for pair, where in found.items() if not allowed(*pair)}
    lines = [f"{loc}: {module} imports {target}: {rule}"
             for (module, target), where in sorted(bad.items()) for loc, rule in where]
    assert not lines, "\n".join(lines)


def test_allow_list_entries_are_still_needed():
    """A listed import that is gone draws a warning (the entry should go), not a
    failure, so the module's owner can remove the import first."""
    found = repository_violations()
    stale = [(m, t) for m, t in ALLOWED
             if not any(m == fm and _within(ft, (t,)) for fm, ft in found)]
    for module, target in stale:
        warnings.warn(f"tests/test_layering.py ALLOWED: {module} no longer imports {target}; "
                      "delete the entry", UserWarning, stacklevel=1)
    assert all(_within(m, KERNEL_PACKAGES) and reason for (m, _), reason in ALLOWED.items())


def test_product_prefill_imports_nothing_from_the_reference_paths():
    """The fused product path stands alone; the reference paths build on it."""
    for rel in ("attention/prefill/kernels.py", "attention/prefill/debug.py",
                "attention/prefill/__init__.py"):
        path = ROOT / rel
        name, is_package = module_name(path)
        targets = {t for _, t in imported_modules(path.read_text(), name, is_package)}
        assert not any(_within(t, (REFERENCE,)) for t in targets), (rel, sorted(targets))
    for gone in ("attention/prefill/layout.py", "attention/prefill/softmax.py",
                 "attention/gemm/tiled.py"):
        assert not (ROOT / gone).exists(), gone


# ---------------------------------------------------------------------------
# the checker's controls (synthetic sources, the same functions)
# ---------------------------------------------------------------------------

POSITIVE = {
    "module level": "import validation.tolerance\n",
    "bench": "from bench.gpu import Timer\n",
    "inside a function": "def f():\n    from attention.oracle import prefill_attention_ref\n",
    "inside a method under a conditional": (
        "class C:\n    def m(self):\n        if True:\n            import mla.oracle as o\n"),
    "package attribute": "from attention import oracle\n",
    "relative import": "from ..oracle import decode_attention_ref\n",
    "import_module with a literal": (
        "import importlib\ndef f():\n    return importlib.import_module('validation.suite')\n"),
}


@pytest.mark.parametrize("label", sorted(POSITIVE))
def test_positive_control_a_forbidden_import_is_flagged(label):
    """Rule (a): a synthetic product module importing validation, bench or an
    oracle is flagged, wherever and however the import is written."""
    found = layering_violations(POSITIVE[label], "attention.prefill.synthetic")
    assert found and all(rule.startswith("(a)") for _, _, rule in found), (label, found)


@pytest.mark.parametrize("source", [
    "from attention.reference.prefill_paths import prefill_attention_reference\n",
    "def f():\n    import attention.reference.warp_decode\n",
    "from ..reference import split_decode\n",
])
def test_positive_control_a_reference_import_in_the_product_is_flagged(source):
    found = layering_violations(source, "attention.decode.synthetic")
    assert any(rule.startswith("(b)") and target.startswith(REFERENCE)
               for _, target, rule in found), found


def test_controls_what_is_allowed():
    """The rules do not fire on what they allow: the reference may import the
    reference and the product; an oracle may import an oracle; validation is no
    kernel; names in strings and docstrings are not imports."""
    reference = "from attention.reference.warp_decode import KERNEL_DEFECTS\n"
    assert not layering_violations(reference, "attention.reference.synthetic")
    assert layering_violations(reference, "attention.decode.synthetic")  # same text, product
    assert not layering_violations("from attention.oracle import softmax_attend\n", "mla.oracle")
    assert layering_violations("from attention.oracle import softmax_attend\n", "mla.pipeline")
    assert layering_violations("import validation\n", "mla.oracle")  # oracles: rest of (a)
    assert not layering_violations("import attention.oracle\n", "validation.suite_prefill")
    quoted = '"""See attention.oracle and validation.suite."""\nX = "import validation"\n'
    assert not layering_violations(quoted, "attention.prefill.synthetic")
    clean = ("import numpy as np\nfrom numba import cuda\n"
             "from attention.core.device import jit\nfrom . import debug\n")
    assert not layering_violations(clean, "attention.prefill.synthetic")


def test_relative_imports_resolve():
    assert _resolve_relative("mla.cache", False, 1, "dims") == "mla.dims"
    assert _resolve_relative("attention.prefill", True, 1, "kernels") == "attention.prefill.kernels"
    assert _resolve_relative("attention.prefill.kernels", False, 2, "oracle") == "attention.oracle"
    assert _resolve_relative("attention.prefill.kernels", False, 2, None) == "attention"
