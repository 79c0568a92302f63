"""The template files: ``slurm/`` beside the package, finding one by name or path, rendering it with ``SlurmOptions``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from ..errors import MissingValueError, TemplateError, TemplateNotFoundError
from .options import SlurmOptions, option_flag
from .syntax import render, template_names

TEMPLATE_SUFFIX = ".sbatch"


def template_dir() -> Path:
    """``slurm/`` beside the package: the repository root of a clone (``pip install -e .``)."""
    return Path(__file__).resolve().parent.parent.parent / "slurm"


def available_templates(directory: Optional[Path] = None) -> List[str]:
    """Names of the templates in ``directory`` (default ``template_dir()``), sorted."""
    directory = template_dir() if directory is None else Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p.name[: -len(TEMPLATE_SUFFIX)] for p in directory.glob("*" + TEMPLATE_SUFFIX) if p.is_file())


def find_template(name_or_path: str, directory: Optional[Path] = None) -> Path:
    """The template file for a name (``cpu-ddp``, ``cpu-ddp.sbatch``) or a path.

    A word with a ``/`` is a path; a word ending in ``.sbatch`` is looked for
    in the current directory, then in ``slurm/``; any other word is a name.

    Raises:
        TemplateNotFoundError: no such template; the message lists the
            available ones.
    """
    directory = template_dir() if directory is None else Path(directory)
    candidates = []
    if "/" in name_or_path or os.sep in name_or_path:
        candidates.append(Path(name_or_path))
    else:
        if name_or_path.endswith(TEMPLATE_SUFFIX):
            candidates += [Path(name_or_path), directory / name_or_path]
        elif name_or_path and name_or_path not in (".", ".."):
            candidates.append(directory / (name_or_path + TEMPLATE_SUFFIX))
    for path in candidates:
        if path.is_file():
            return path
    names = available_templates(directory)
    if names:
        where = f"available: {', '.join(names)} (in {directory})"
    else:
        where = (f"no templates found in {directory} (slurm/ ships with a clone of the repository; "
                 "install with pip install -e . or give the path of a template file)")
    raise TemplateNotFoundError(f"no SLURM template {name_or_path!r}; {where}")


def template_name(path: Path) -> str:
    """The name a template file goes by (its file name without ``.sbatch``)."""
    name = path.name
    return name[: -len(TEMPLATE_SUFFIX)] if name.endswith(TEMPLATE_SUFFIX) else path.stem


def render_options(template_text: str, options: SlurmOptions, name: str = "job") -> str:
    """Render a template with validated options; what ``axonhpc slurm render`` prints.

    Unlike ``render``, an option set explicitly that the template never uses is an error
    (``--gpus-per-node`` for a CPU template is a mistake, not a detail to drop).

    Raises:
        TemplateError: as ``render``, or an option the template does not use.
    """
    used = template_names(template_text)
    if "args" in used:
        used.add("command")
    unused = sorted(options.given() - used)
    if unused:
        what = ["script arguments after --" if n == "command" else option_flag(n) for n in unused]
        raise TemplateError(f"template {name!r} does not use {', '.join(what)}")
    try:
        return render(template_text, **options.placeholders(name))
    except MissingValueError as exc:
        if exc.name == "command":
            raise MissingValueError(exc.name, f"template {name!r} runs a program: give it after --, e.g. "
                                    "-- examples/train_digits.py --epochs 5") from None
        raise MissingValueError(exc.name, _named(str(exc), name)) from None
    except TemplateError as exc:
        raise TemplateError(_named(str(exc), name)) from None


def _named(message: str, name: str) -> str:
    if message.startswith("this template "):
        return f"template {name!r} " + message[len("this template "):]
    return f"template {name!r}: {message}"


def render_file(template: str, options: SlurmOptions) -> str:
    """Find a template by name or path (``find_template``) and render it (``render_options``)."""
    path = find_template(template)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"cannot read template {str(path)!r}: {exc}") from None
    return render_options(text, options, template_name(path))


__all__ = ["template_dir", "available_templates", "find_template", "template_name", "render_options", "render_file"]
