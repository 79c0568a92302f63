"""The version of axonhpc: read by the package, ``ax.info()`` and the build (pyproject.toml)."""

__version__ = "0.1.0"
