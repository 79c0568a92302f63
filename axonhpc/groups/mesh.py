"""Device mesh: dp/tp/pp groups for hybrid parallelism, tp fastest-varying."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, NamedTuple

from ..errors import ConfigurationError, GroupMismatchError, InvalidKeyError, everywhere
from .agreement import compare, who_passed

if TYPE_CHECKING:  # pragma: no cover
    from .process_group import ProcessGroup, WorldFacts

DIMENSIONS = ("pp", "dp", "tp")  # slowest to fastest varying


class MeshCoords(NamedTuple):
    """This rank's index along each mesh dimension."""

    pp: int
    dp: int
    tp: int


def mesh_coords(rank: int, dp: int, tp: int) -> MeshCoords:
    """Coordinates of a global rank: ``rank == (pp * dp_size + dp) * tp_size + tp``.

    The slowest dimension (pp) needs no size to decode, so only dp and tp sizes are taken.
    """
    return MeshCoords(rank // (dp * tp), (rank // tp) % dp, rank % tp)


def _check_sizes(sizes: Dict[str, int], world_size: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"mesh dimension {name} must be a positive integer, got {value!r}")
    dp, tp, pp = sizes["dp"], sizes["tp"], sizes["pp"]
    if dp * tp * pp != world_size:
        raise ConfigurationError(f"mesh dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, but the world has "
                                 f"{world_size}")


class Mesh:
    """One ProcessGroup per dimension, plus this rank's coordinates.

    Neighbouring ranks share a tensor-parallel group (tp varies fastest), so
    with ranks placed node by node a tp group stays inside a node.
    """

    def __init__(self, world: "WorldFacts", dp: int = 1, tp: int = 1, pp: int = 1):
        """Collective over the world: every rank must pass the same sizes (compared first, see ``agreement``).

        Raises:
            ConfigurationError: a size is not a positive integer, or the sizes do not multiply to the world size.
            GroupMismatchError: ranks passed different sizes (on every rank, naming them).
        """
        sizes = {"dp": dp, "tp": tp, "pp": pp}
        problem = None
        try:
            _check_sizes(sizes, world.world_size)
        except ConfigurationError as exc:
            problem = exc
        if world.world_size > 1:
            seen = compare(world.default_group, problem is None, f"dp={dp!r}, tp={tp!r}, pp={pp!r}", same=True)
            if seen is not None and len({text for _, text in seen}) > 1:
                passed = who_passed(seen, world.default_group.ranks, "mesh({})")
                raise everywhere(GroupMismatchError(f"mesh: the ranks passed different sizes ({passed}); every rank "
                                                    f"must pass the same, and every rank raises this"),
                                 world.default_group.ranks) from problem
        if problem is not None:
            raise problem
        self.shape: Dict[str, int] = sizes
        self.coords = mesh_coords(world.rank, dp, tp)
        c = self.coords
        # Every rank takes part in every split, in the same order.
        world_group = world.default_group
        self.tp: "ProcessGroup" = world_group.split(c.pp * dp + c.dp, c.tp, name="mesh.tp")
        self.dp: "ProcessGroup" = world_group.split(c.pp * tp + c.tp, c.dp, name="mesh.dp")
        self.pp: "ProcessGroup" = world_group.split(c.dp * tp + c.tp, c.pp, name="mesh.pp")

    def destroy(self) -> None:
        """Collective over the world: destroy the mesh's tp, dp and pp groups, in that order on every rank.

        See ``ProcessGroup.destroy``; a group of the mesh destroyed already is skipped. Afterwards each of
        ``mesh.tp``, ``mesh.dp`` and ``mesh.pp`` raises ``GroupDestroyedError`` when used.
        """
        for name in ("tp", "dp", "pp"):  # the order they were made in
            getattr(self, name).destroy()

    def __getitem__(self, name: str) -> "ProcessGroup":
        if name not in DIMENSIONS:
            raise InvalidKeyError(f"mesh has dimensions {DIMENSIONS}, not {name!r}")
        return getattr(self, name)

    def __repr__(self) -> str:
        return f"Mesh(dp={self.shape['dp']}, tp={self.shape['tp']}, pp={self.shape['pp']}, coords={tuple(self.coords)})"
