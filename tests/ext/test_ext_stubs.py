"""The compiled modules and their .pyi stubs name the same things, and every public name has a docstring."""
import ast
import importlib
import inspect
import os

import pytest

import axonhpc.bucketing

MODULES = ["_pack", "_bucket", "_shard", "_shm", "_layers", "_updates"]


def _public_defined_in(module):
    return {name for name, obj in vars(module).items()
            if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__}


@pytest.mark.parametrize("name", MODULES)
def test_stub_matches_module(name):
    module = importlib.import_module(f"axonhpc._ext.{name}")
    stub = os.path.join(os.path.dirname(module.__file__), f"{name}.pyi")
    tree = ast.parse(open(stub).read())
    stubbed = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert stubbed == _public_defined_in(module)


@pytest.mark.parametrize("name", MODULES)
def test_public_names_have_docstrings(name):
    module = importlib.import_module(f"axonhpc._ext.{name}")
    assert module.__doc__
    for attr in sorted(_public_defined_in(module)):
        obj = getattr(module, attr)
        assert inspect.getdoc(obj), attr
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if not member.startswith("_"):
                    # plain attributes are documented in the class's Attributes section
                    assert inspect.getdoc(value) or f"{member}:" in inspect.getdoc(obj), f"{attr}.{member}"


def test_bucketing_exports_have_docstrings():
    for name in axonhpc.bucketing.__all__:
        assert inspect.getdoc(getattr(axonhpc.bucketing, name)), name
