"""Every error axonhpc raises on purpose is an ``AxonError`` reachable as ``ax.errors.<Name>``.

``test_every_raise_is_an_axon_error`` walks every ``raise`` statement of the
package (ast) and resolves what it raises in its module's namespace. A class
must derive from ``AxonError`` and be the very class ``axonhpc.errors``
exports under its name (so ``except ax.errors.X`` catches it wherever it was
raised), unless it is one of the protocol exceptions in ``ALLOWED`` (each
with its reason and the condition it is allowed under). A call of a function
that builds the exception (``raise self.fail(...)``) must be listed in
``FACTORIES``. Re-raising a caught or collected exception (``raise problem``)
is not a new error and is not checked.
"""
import ast
import builtins
import importlib
import pathlib

import pytest

import axonhpc as ax
from axonhpc import errors
from support import paths

ROOT = pathlib.Path(paths.ROOT)
PACKAGE = ROOT / "axonhpc"

# Built-in exceptions a raise may use, why, and under which condition (checked).
ALLOWED = {
    "NotImplementedError": ("an abstract method that subclasses implement: the whole body is the raise",
                            "abstract"),
    "AttributeError": ("Python's attribute protocol: __getattr__ must raise it for hasattr() and getattr(x, n, "
                       "default) to work", "__getattr__"),
    "SystemExit": ("ending the process with a chosen exit status on purpose (a backend's abort without a "
                   "communicator; the trainer's preemption exit code)", None),
}

# Functions that build the exception a raise statement raises: (file, callee as written) -> what they return.
FACTORIES = {
    ("backends/base.py", "self._timeout_error"): "CollectiveTimeoutError (Work._timeout_error)",
    ("backends/base.py", "explain"): "CollectiveTimeoutError naming the missing ranks (Work.explain_timeout)",
    ("collectives/watch.py", "timed_out"): "CollectiveTimeoutError naming the missing ranks (watch.timed_out)",
    ("collectives/engine_calls.py", "_lagging_error"): "CollectiveTimeoutError naming the ranks a call waits for",
    ("checkpoint/format.py", "self.fail"): "CheckpointError naming the file and the metadata path",
    ("backends/mpi.py", "backend._size_problem"): "ShapeError naming the message's and the buffer's sizes",
    ("backends/mpi.py", "self._problem"): "ShapeError naming the message's and the buffer's sizes",
    ("backends/mpi.py", "refuse_other"): "ShapeError naming both dtypes (backends.mpi_p2p.refuse_other)",
    # errors.replacing returns the AxonError it is given (here the CollectiveTimeoutError that
    # watch.engine_timed_out or shm_path.timed_out makes), its internal cause unchained (issue 42)
    ("collectives/agreement.py", "replacing"): "CollectiveTimeoutError or CollectiveMismatchError",
    ("collectives/core.py", "replacing"): "CollectiveTimeoutError naming the missing ranks",
    ("collectives/shm_path.py", "replacing"): "CollectiveTimeoutError naming the missing ranks",
    # the PeerFailedError that backends.failures.peer_failed makes of a dead peer's MPI error (issue 39)
    ("backends/mpi_work.py", "replacing"): "PeerFailedError naming the lost ranks",
    # errors.everywhere returns the CollectiveMismatchError it is given, marked with the ranks raising it
    ("collectives/agreement.py", "everywhere"): "CollectiveMismatchError",
    ("collectives/fingerprint.py", "everywhere"): "CollectiveMismatchError or CollectiveRefusedError",
    ("parallel/grad_norm.py", "everywhere"): "CollectiveMismatchError (clip_grad_norm's arguments)",
    ("groups/world.py", "everywhere"): "GroupMismatchError",
    ("groups/mesh.py", "everywhere"): "GroupMismatchError",
    ("groups/process_group.py", "everywhere"): "GroupMismatchError",
    # groups.agreement.agree raises what its caller's factories make (issue 41): ModelMismatchError in
    # parallel.same_model, CheckpointError in checkpoint
    ("groups/agreement.py", "refused"): "the caller's error for the ranks that did not fail",
    ("groups/agreement.py", "differ"): "the caller's error for ranks that give different texts",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(expr: ast.expr, namespace: dict):
    """The object ``expr`` (a name or a dotted attribute) names in ``namespace``, or None."""
    if isinstance(expr, ast.Name):
        if expr.id in namespace:
            return namespace[expr.id]
        return getattr(builtins, expr.id, None)
    if isinstance(expr, ast.Attribute):
        base = _resolve(expr.value, namespace)
        return None if base is None else getattr(base, expr.attr, None)
    return None


def _functions(tree: ast.AST):
    """(raise node, innermost enclosing function or None) for every raise in ``tree``."""
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child)
            else:
                if isinstance(child, ast.Raise):
                    out.append((child, func))
                visit(child, func)

    visit(tree, None)
    return out


def _is_abstract_body(func) -> bool:
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def _raise_sites():
    """(file relative to axonhpc/, line, callee text, resolved object or None, enclosing function) per raise."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        module = importlib.import_module(_module_name(path))
        tree = ast.parse(path.read_text(), str(path))
        for node, func in _functions(tree):
            if node.exc is None:
                continue  # a bare ``raise`` re-raises what is being handled
            call = isinstance(node.exc, ast.Call)
            target = node.exc.func if call else node.exc
            obj = _resolve(target, vars(module))
            if not call and not isinstance(obj, type):
                continue  # ``raise problem``: an exception made (and checked) elsewhere
            sites.append((str(path.relative_to(PACKAGE)), node.lineno, ast.unparse(target), obj, call, func))
    return sites


def test_every_raise_is_an_axon_error():
    wrong, used_allowed, used_factories = [], set(), set()
    for rel, line, text, obj, call, func in _raise_sites():
        where = f"axonhpc/{rel}:{line}: raise {text}"
        if isinstance(obj, type) and issubclass(obj, BaseException):
            if issubclass(obj, errors.AxonError):
                if getattr(errors, obj.__name__, None) is obj:
                    continue
                wrong.append(f"{where}: {obj.__module__}.{obj.__name__} is an AxonError but not "
                             f"ax.errors.{obj.__name__} (define it in axonhpc/errors.py and import it from there)")
                continue
            name = "SystemExit" if issubclass(obj, SystemExit) else obj.__name__  # e.g. trainer's PreemptedExit
            if name in ALLOWED:
                condition = ALLOWED[name][1]
                if condition == "abstract" and not (func is not None and _is_abstract_body(func)):
                    wrong.append(f"{where}: NotImplementedError outside an abstract method (whose whole body is "
                                 f"the raise); raise an ax.errors class instead")
                elif condition == "__getattr__" and not (func is not None and func.name == "__getattr__"):
                    wrong.append(f"{where}: AttributeError outside __getattr__; use ax.errors."
                                 f"ModuleNotInitializedError or another AxonError subclass")
                else:
                    used_allowed.add(name)
                continue
            wrong.append(f"{where}: {name} is not an axonhpc error; raise a subclass of ax.errors.AxonError "
                         f"(e.g. InvalidArgumentError for a ValueError, ArgumentTypeError for a TypeError)")
            continue
        if (rel, text) in FACTORIES:
            used_factories.add((rel, text))
            continue
        wrong.append(f"{where}: raises what {text}(...) returns; list it in FACTORIES with what it returns, or "
                     f"raise an ax.errors class directly")
    assert not wrong, "raise sites that are not axonhpc errors:\n" + "\n".join(wrong)
    # The lists must stay true: an entry nothing uses is stale.
    assert set(FACTORIES) == used_factories, f"unused FACTORIES entries: {set(FACTORIES) - used_factories}"
    assert used_allowed == set(ALLOWED), f"unused ALLOWED entries: {set(ALLOWED) - used_allowed}"


# The compiled modules that axonhpc.buffers exports (cython_src/, which ast cannot parse): their raise
# sites, found by a pattern, resolved in the compiled module. Allowed: what is not a caller's mistake.
COMPILED = ("_bucket", "_pack", "_shard")
COMPILED_ALLOWED = {
    ("_pack.pyx", "RuntimeError"): "a buffer rejected that passes every check: a bug in axonhpc, not the caller's",
    ("_pack.pyx", "MemoryError"): "the process is out of memory (PyMem_Malloc failed), as Python itself says it",
    ("_shard.pyx", "OverflowError"): "a count past Py_ssize_t, as Cython's own argument conversion raises it",
}


def _compiled_raise_sites(root: pathlib.Path = ROOT):
    """(file, line, name, resolved object or None) per ``raise Name(`` in the compiled modules' sources."""
    import re

    sites = []
    for name in COMPILED:
        module = importlib.import_module(f"axonhpc._ext.{name}")
        path = root / "cython_src" / f"{name}.pyx"
        for line, text in enumerate(path.read_text().splitlines(), 1):
            for found in re.finditer(r"\braise\s+([A-Za-z_][A-Za-z_0-9]*)\s*\(", text):
                cls = found.group(1)
                sites.append((path.name, line, cls, vars(module).get(cls, getattr(builtins, cls, None))))
    return sites


def test_every_raise_of_the_exported_compiled_modules_is_an_axon_error():
    wrong, used = [], set()
    sites = _compiled_raise_sites()
    assert len(sites) > 5, sites  # the pattern finds the raise sites
    for file, line, name, obj in sites:
        if (file, name) in COMPILED_ALLOWED:
            used.add((file, name))
        elif not (isinstance(obj, type) and issubclass(obj, errors.AxonError) and getattr(errors, name, None) is obj):
            wrong.append(f"cython_src/{file}:{line}: raise {name}(...) is not an ax.errors class")
    assert not wrong, "compiled raise sites that are not axonhpc errors:\n" + "\n".join(wrong)
    assert used == set(COMPILED_ALLOWED), f"unused COMPILED_ALLOWED entries: {set(COMPILED_ALLOWED) - used}"


def test_the_compiled_walk_sees_a_plain_value_error(tmp_path):
    """The pattern walk itself: a plain ``raise ValueError(`` in a compiled module's source is found."""
    (tmp_path / "cython_src").mkdir()
    for name in COMPILED:
        text = (ROOT / "cython_src" / f"{name}.pyx").read_text()
        if name == "_shard":
            text += '\n    raise ValueError(f"x {x}")\n'
        (tmp_path / "cython_src" / f"{name}.pyx").write_text(text)
    found = [(f, n, o) for f, _, n, o in _compiled_raise_sites(tmp_path) if n == "ValueError"]
    assert found == [("_shard.pyx", "ValueError", ValueError)]


def test_the_walk_sees_a_plain_value_error(tmp_path, monkeypatch):
    """The walk itself: a module with ``raise ValueError`` is found (so the test above can fail)."""
    import sys

    pkg = tmp_path / "walked"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text("def f(x):\n    x += 1\n    raise ValueError(x)\n\n\ndef g():\n    \"\"\"Doc.\"\"\"\n"
                                "    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    sites = _raise_sites()
    assert [(rel, text, obj) for rel, _, text, obj, _, _ in sites] == [("bad.py", "ValueError", ValueError),
                                                                      ("bad.py", "NotImplementedError",
                                                                       NotImplementedError)]
    assert _is_abstract_body(sites[1][5]) and not _is_abstract_body(sites[0][5])


def test_every_error_class_is_exported_documented_and_keeps_its_builtin_base():
    names = [n for n in errors.__all__]
    assert len(names) == len(set(names))
    concepts = (ROOT / "docs" / "concepts.md").read_text()
    for name in names:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.AxonError), name
        assert cls.__doc__ and cls.__doc__.strip(), f"{name} has no docstring"
        assert f"`{name}`" in concepts, f"docs/concepts.md's errors section does not list {name}"
        assert ax.errors is errors
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)}
    assert defined == set(names), f"defined but not in __all__: {defined - set(names)}"
    # ``except ValueError`` / ``except TypeError`` keep working where a built-in says the same thing.
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.InvalidGroupError, TypeError)
    assert issubclass(errors.ConfigurationError, ValueError)
    assert issubclass(errors.NotFoundError, FileNotFoundError)
    assert issubclass(errors.UsageError, RuntimeError)
    assert issubclass(errors.InvalidKeyError, KeyError)
    assert issubclass(errors.GroupMismatchError, errors.CollectiveMismatchError)
    assert issubclass(errors.GroupDestroyedError, errors.UsageError)  # so also a RuntimeError
    assert str(errors.InvalidKeyError("mesh has no 'x'")) == "mesh has no 'x'"  # not KeyError's quoted repr


@pytest.mark.parametrize("module,names", [
    ("axonhpc.slurm", ["TemplateError", "MissingValueError", "TemplateNotFoundError"]),
    ("axonhpc.bench.jobs", ["BenchError"]),
    ("axonhpc.backends.local", ["LocalAbort"]),
    ("axonhpc.backends", ["LocalAbort"]),
    ("axonhpc.parallel.ddp", ["UnusedParameterError", "GradientAfterReductionError"]),
    ("axonhpc.parallel.parameter_server", ["ParameterServerError", "PeerFailedError"]),
    ("axonhpc.parallel", ["UnusedParameterError", "GradientAfterReductionError", "ParameterServerError",
                          "PeerFailedError"]),
])
def test_moved_errors_stay_importable_where_they_were(module, names):
    mod = importlib.import_module(module)
    for name in names:
        assert getattr(mod, name) is getattr(errors, name)


def test_bad_op_and_bad_group_raise_axon_errors():
    world = ax.World.mock()
    with pytest.raises(errors.InvalidArgumentError, match="unknown reduce op 'median'"):
        ax.all_reduce(__import__("numpy").zeros(2), op="median", group=world.default_group)
    with pytest.raises(errors.InvalidGroupError, match="group must be a ProcessGroup or None, got str"):
        ax.all_reduce(__import__("numpy").zeros(2), group="world")
    with pytest.raises(ValueError):  # still a ValueError for code that catches those
        ax.all_reduce(__import__("numpy").zeros(2), op="median", group=world.default_group)
