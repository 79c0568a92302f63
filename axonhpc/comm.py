"""``axonhpc.comm``: the collectives under the name users of other libraries expect."""
from .collectives import *  # noqa: F401,F403
from .collectives import __all__  # noqa: F401
