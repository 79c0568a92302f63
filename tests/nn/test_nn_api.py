"""Public surface of nn, optim and data: exported names, docstrings, and no communication imports."""
import ast
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

import axonhpc.data as data
import axonhpc.nn as nn
import axonhpc.optim as optim

PACKAGES = {"nn": nn, "optim": optim, "data": data}
EXPECTED = {
    "nn": {"Parameter", "Module", "Sequential", "Linear", "ReLU", "GELU", "Tanh", "Dropout", "LayerNorm",
           "Embedding", "MultiHeadAttention", "CrossEntropyLoss", "MSELoss"},
    "optim": {"Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm"},
    "data": {"DistributedSampler", "DataLoader"},
}
# What these packages may import (the layer rule; lazily imported cupy counts as numpy's twin).
# threading: nn.autocast's state is per thread (each rank of the thread backend is a thread).
# functools: the optimizers' work before a CUDA graph's replay is a partial of a method.
ALLOWED_ROOTS = {"numpy", "cupy", "cupyx", "math", "sys", "typing", "collections", "__future__", "threading",
                 "functools", "numbers"}
# observe.tracing records timeline spans (it knows nothing of communication); settings holds
# allow_tf32, which nn.matmul applies to cupy; cuda.capture says whether a CUDA graph is being captured and
# cuda.kernels builds the fused device kernels; _ext finds the compiled host kernels; observe.log gives the
# sampler the caller's rank and world size when it is not given them (``world_facts``, which never builds a
# world: it knows nothing of communication either)
ALLOWED_AXONHPC = {"axonhpc._dtypes", "axonhpc._ext", "axonhpc.cuda.kernels", "axonhpc.cuda.capture", "axonhpc.errors",
                   "axonhpc.observe.tracing", "axonhpc.settings", "axonhpc.observe.log"}
# data/text.py reads the standard library's own source files from disk; data/files.py a user's corpus.
ALLOWED_PER_FILE = {os.path.join("data", "text.py"): {"os", "sysconfig"}, os.path.join("data", "files.py"): {"os"},
                    # cuBLAS called through ctypes (see nn.gemm), found in /proc/self/maps
                    os.path.join("nn", "gemm.py"): {"ctypes", "os", "logging", "cupy_backends"}}


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_exports(pkg):
    module = PACKAGES[pkg]
    assert EXPECTED[pkg] <= set(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_public_names_and_methods_have_docstrings(pkg):
    module = PACKAGES[pkg]
    for name in module.__all__:
        obj = getattr(module, name)
        assert inspect.getdoc(obj), f"{pkg}.{name} has no docstring"
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and callable(member):
                    assert inspect.getdoc(member), f"{pkg}.{name}.{attr} has no docstring"


def _source_files():
    root = os.path.dirname(os.path.dirname(nn.__file__))
    for pkg in PACKAGES:
        folder = os.path.join(root, pkg)
        for fname in sorted(os.listdir(folder)):
            if fname.endswith(".py"):
                yield pkg, os.path.join(folder, fname)


def test_sources_import_only_numpy_and_core_helpers():
    for pkg, path in _source_files():
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    continue  # inside the same package
                if node.level == 2:  # from ..pkg import x: the module ``axonhpc.pkg.x`` where x is one
                    base = os.path.join(os.path.dirname(os.path.dirname(path)), *(node.module or "").split("."))
                    prefix = "axonhpc." + f"{node.module}." * bool(node.module)
                    names = [prefix + a.name if os.path.exists(os.path.join(base, a.name + ".py"))
                             or os.path.isdir(os.path.join(base, a.name)) else prefix.rstrip(".") for a in node.names]
                else:
                    names = [node.module]
            else:
                continue
            for name in names:
                extra = ALLOWED_PER_FILE.get(os.path.join(pkg, os.path.basename(path)), set())
                ok = name.split(".")[0] in ALLOWED_ROOTS | extra or name in ALLOWED_AXONHPC
                assert ok, f"{path} imports {name}"


def test_importing_models_loads_no_communication_code():
    # Import the three packages without running axonhpc/__init__.py, so only their own imports count.
    root = os.path.dirname(os.path.dirname(os.path.dirname(nn.__file__)))
    code = textwrap.dedent(f"""
        import sys, types
        pkg = types.ModuleType("axonhpc")
        pkg.__path__ = [{os.path.join(root, "axonhpc")!r}]
        sys.modules["axonhpc"] = pkg
        import axonhpc.nn, axonhpc.optim, axonhpc.data
        # The compiled host kernels (_layers, _updates) are arithmetic only; the other compiled modules are not.
        kernels = ("axonhpc._ext", "axonhpc._ext._layers", "axonhpc._ext._updates")
        bad = sorted(m for m in sys.modules if m not in kernels and (m.split(".")[0] in ("mpi4py", "cupy")
                     or m.startswith(("axonhpc.backends", "axonhpc.groups", "axonhpc.collectives",
                                      "axonhpc.comm", "axonhpc.bucketing", "axonhpc.parallel", "axonhpc._ext"))))
        print(bad)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
