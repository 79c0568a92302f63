"""The layer picture of docs/architecture.md, enforced by import-linter; no import cycles; public docstrings."""
import ast
import inspect
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import axonhpc as ax
from support.paths import ROOT


def test_import_layers_hold():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(lint):
        lint = shutil.which("lint-imports")
    assert lint, "import-linter is part of the test extra"
    out = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broken" not in out.stdout.lower() or "0 broken" in out.stdout.lower()


# (file under axonhpc/, import appended, the violation lint-imports must report)
VIOLATIONS = [
    ("backends/local.py", "from ..collectives import all_reduce", "axonhpc.backends.local -> axonhpc.collectives"),
    # the namespaces cuda/ and observe/ span layers: their low modules may not import their high ones
    ("cuda/capture.py", "from . import graphs", "axonhpc.cuda.capture -> axonhpc.cuda.graphs"),
    ("observe/log.py", "from . import timeline", "axonhpc.observe.log -> axonhpc.observe.timeline"),
    # a forbidden contract: the core helpers never import mpi4py
    ("observe/tracing.py", "import mpi4py", "axonhpc.observe.tracing is not allowed to import mpi4py"),
]


def test_contracts_catch_upward_and_forbidden_imports(tmp_path):
    """The checker is live: each of ``VIOLATIONS``, made in a copy of the package, must fail it."""
    src = os.path.join(ROOT, "axonhpc")
    dst = tmp_path / "axonhpc"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for path, line, _ in VIOLATIONS:
        with open(dst / path, "a") as f:
            f.write(f"\n{line}  # on purpose\n")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode != 0, out.stdout
    for _, _, reported in VIOLATIONS:
        assert reported in out.stdout, reported


@pytest.mark.parametrize("package", ["cuda", "observe"])
def test_namespace_packages_import_nothing(package):
    """``axonhpc.cuda`` and ``axonhpc.observe`` are in no layer (their modules are): importing one must not load them."""
    with open(os.path.join(ROOT, "axonhpc", package, "__init__.py")) as f:
        tree = ast.parse(f.read())
    imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not imports, imports


def test_moved_modules_keep_their_top_level_names():
    assert ax.tracing.__name__ == "axonhpc.observe.tracing"
    assert ax.profiling.__name__ == "axonhpc.observe.timeline" and ax.timeline is ax.profiling.timeline
    assert ax.graphs.__name__ == "axonhpc.cuda.graphs" and ax.graph_step is ax.graphs.graph_step


def import_cycles(package):
    """The import cycles of ``package``: each strongly connected component of more than one module.

    Built with grimp, as import-linter builds its graph: imports inside
    functions and under ``TYPE_CHECKING`` count. Returns a list of lines,
    one a cycle: its modules, then the direct imports between them (with the
    importing line), so that whoever made the cycle sees where to cut it.
    (Run on its own in a subprocess too: it imports what it needs itself.)
    """
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    # Tarjan's algorithm, iterative (a package's import chains may be deeper than Python's recursion limit).
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.find_modules_directly_imported_by(target)))))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    lines = []
    for component in sorted(components):
        edges = []
        for importer in component:
            for imported in sorted(graph.find_modules_directly_imported_by(importer) & set(component)):
                where = ", ".join(str(d["line_number"]) for d in graph.get_import_details(importer=importer,
                                                                                        imported=imported))
                edges.append(f"{importer} -> {imported} (line {where})")
        lines.append(f"{', '.join(component)}: {'; '.join(edges)}")
    return lines


def test_no_import_cycles():
    """Every dependency inside the package is one-way: no module reaches itself through its imports."""
    cycles = import_cycles("axonhpc")
    assert not cycles, f"{len(cycles)} import cycle(s) in axonhpc:\n" + "\n".join(cycles)


def test_cycle_check_catches_a_cycle(tmp_path):
    """The cycle check is live: a backend importing back from a module that imports it must fail it."""
    src = os.path.join(ROOT, "axonhpc")
    dst = tmp_path / "axonhpc"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(dst / "backends" / "base.py", "a") as f:  # dispatch.py imports base: now base imports dispatch
        f.write("\nfrom . import dispatch  # a cycle on purpose\n")
    script = textwrap.dedent(inspect.getsource(import_cycles)) + textwrap.dedent("""
        import sys
        cycles = import_cycles("axonhpc")
        print("\\n".join(cycles))
        sys.exit(1 if cycles else 0)
        """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "axonhpc.backends.base, axonhpc.backends.dispatch:" in out.stdout, out.stdout
    assert "axonhpc.backends.base -> axonhpc.backends.dispatch" in out.stdout, out.stdout


@pytest.mark.parametrize("name", sorted(ax.__all__))
def test_public_names_have_docstrings(name):
    obj = getattr(ax, name)
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
        assert inspect.getdoc(obj), f"axonhpc.{name} has no docstring"
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if not attr.startswith("_") and inspect.isfunction(member):
                assert inspect.getdoc(member), f"axonhpc.{name}.{attr} has no docstring"
