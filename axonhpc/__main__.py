"""``python -m axonhpc`` is the ``axonhpc`` command."""
import sys

from .cli import main

sys.exit(main())
