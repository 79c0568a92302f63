"""SLURM batch scripts from the templates in ``slurm/``: ``axonhpc slurm render``.

``options`` (``SlurmOptions`` and [Note: quoting]), ``syntax`` ([Note: template syntax]) and
``templates`` (the files in ``slurm/``).
"""
from ..errors import MissingValueError, TemplateError, TemplateNotFoundError
from . import options, templates
from .options import LAUNCHER_CHOICES, MPI_CHOICES, SlurmOptions, option_flag, parse_time, shell_join, shell_quote
from .syntax import render, template_names
from .templates import available_templates, find_template, render_file, render_options, template_dir, template_name

# Public names outside ``__all__``, importable from here as before the package was split.
DEFAULT_SIGNAL_SECONDS = options.DEFAULT_SIGNAL_SECONDS
MAX_SIGNAL_SECONDS = options.MAX_SIGNAL_SECONDS
TEMPLATE_SUFFIX = templates.TEMPLATE_SUFFIX

__all__ = [
    "SlurmOptions", "TemplateError", "MissingValueError", "TemplateNotFoundError", "render", "render_options",
    "render_file", "template_names", "template_dir", "available_templates", "find_template", "template_name",
    "shell_quote", "shell_join", "parse_time", "option_flag", "MPI_CHOICES", "LAUNCHER_CHOICES",
]
