"""The package's layers import one way: kernels below the IR, the IR below the passes, the passes below remat and
run. Every module under autosp/ is parsed (not imported), and each `autosp.*` import it makes, at the top or inside
a function, is held to the layer rules. A lazy import inside a function is still an arrow: it only hides the loop
from Python's import machinery."""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autosp"

# layer -> the layers it must not import (a layer is autosp's subpackage or top module: autosp.<layer>...)
FORBIDDEN = {
    "kernels": {"ir", "passes", "remat", "run"},
    "ir": {"passes", "remat", "run"},
    "passes": {"remat", "run"},
}
BOTTOM = ("autosp.errors", "autosp.units")          # import nothing of autosp: any layer may use them

# Arrows that break a rule today, each with where it belongs: (importing module, imported module). Remove an entry
# when its arrow is gone; the test fails while an entry is no longer needed, so the list stays what is true.
KNOWN = {
    # remat.liveness._ranks, the size of a collective's group estimated from its rows: the split collectives'
    # buffers must be the memory model's, so both want one function, below both (beside collectives.group_size)
    ("autosp.passes.schedule", "autosp.remat.liveness"),
    # overlaps / overlap_summary, explain's report of the scheduled collectives, priced by remat's cost model:
    # a report above both (remat or run/explain.py), which api.py and run/explain.py would import from there
    ("autosp.passes.schedule", "autosp.remat.cost"),
}


def module_name(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent) -> list[tuple[str, int]]:
    """(module imported, line) for every autosp import in the file, wherever it stands (functions included);
    `from autosp.x import y` counts as autosp.x.y, which is a module or a name in autosp.x: same layer either way."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                       # relative: from the package, up level - 1
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
    return sorted((m, line) for m, line in found if m == "autosp" or m.startswith("autosp."))


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@functools.cache
def arrows(package: pathlib.Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(importer, imported module) -> where: every arrow of `package` that breaks a layer rule."""
    root = package.parent
    bad: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        importer = module_name(path, root)
        for target, line in imports(path, root):
            if layer(target) in FORBIDDEN.get(layer(importer), ()):
                # the imported module: the longest prefix of the name that is a module of the package
                parts = target.split(".")
                mod = next((".".join(parts[:k]) for k in range(len(parts), 1, -1)
                            if root.joinpath(*parts[:k]).with_suffix(".py").is_file()
                            or (root.joinpath(*parts[:k]) / "__init__.py").is_file()), target)
                bad.setdefault((importer, mod), []).append(f"{path.relative_to(root)}:{line} imports {target}")
    return bad


def test_the_import_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative import are found and resolved."""
    pkg = tmp_path / "autosp" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text("import torch\n\ndef f():\n    from autosp.ir.core import Eqn\n"
                              "    from ..passes import shard\n    import autosp.run.text\n")
    assert imports(pkg / "m.py", tmp_path) == [("autosp.ir.core.Eqn", 4), ("autosp.passes.shard", 5),
                                               ("autosp.run.text", 6)]


@pytest.mark.parametrize("lower", sorted(FORBIDDEN))
def test_no_layer_imports_a_layer_above_it(lower):
    found = {k: v for k, v in arrows().items() if layer(k[0]) == lower}
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, ("imports that run upwards (move the shared part down, or the caller up):\n"
                     + "\n".join(w for v in new.values() for w in v))
    gone = {k for k in KNOWN if layer(k[0]) == lower} - set(found)
    assert not gone, f"no longer imported: remove {sorted(gone)} from KNOWN"


def test_the_bottom_modules_import_nothing_of_autosp():
    for name in BOTTOM:
        path = PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py")
        assert imports(path) == [], name


def test_one_byte_formatter_serves_every_report():
    """remat's plans, explain's collectives and `autosp plan` print sizes with the same function, from the bottom."""
    from autosp.remat import plan as remat_plan
    from autosp.run import plan as run_plan
    from autosp.units import fmt_bytes
    assert remat_plan._fmt is fmt_bytes and run_plan.fmt is fmt_bytes
    assert [fmt_bytes(n) for n in (None, 512, 3 * 2**20, 2**40 + 2**39)] == ["none", "512 B", "3.00 MiB", "1.50 TiB"]
