"""Change ``ax.settings`` fields for the length of a ``with`` block (tests only)."""
import contextlib

import axonhpc as ax


@contextlib.contextmanager
def override(**values):
    """Set the named settings fields, and put the old values back afterwards."""
    saved = {name: getattr(ax.settings, name) for name in values}
    try:
        for name, value in values.items():
            setattr(ax.settings, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(ax.settings, name, value)
