"""Process groups: the world, subgroups, splits, meshes, and the current world."""
from .mesh import Mesh, MeshCoords, mesh_coords
from .process_group import ProcessGroup
from .runtime import current_world, init, install_abort_on_exception, is_initialized, resolve_group, run_local
from .world import World

__all__ = [
    "World",
    "ProcessGroup",
    "Mesh",
    "MeshCoords",
    "mesh_coords",
    "init",
    "run_local",
    "current_world",
    "resolve_group",
    "is_initialized",
    "install_abort_on_exception",
]
