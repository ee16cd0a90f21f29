"""Process groups as an explicit object: which ranks talk to which, for every kind of parallelism.

Ranks are laid out Megatron-Core's way (``RankGenerator``, order ``tp-cp-ep-dp-pp``, the first
dimension varying fastest), so a checkpoint or a log line from Megatron means the same rank here.
Two grids share the world and the pipeline groups:

* decoder grid ``(tp, cp, dp, pp)``, with ``dp = world / (tp * cp * pp)`` (ep is 1 here);
* expert grid ``(etp, ep, edp, pp)``, with ``etp`` defaulting to ``tp`` and
  ``edp = world / (etp * ep * pp)`` (cp is 1 here).

Nothing here is global: code that needs a group takes the ``ParallelContext`` it was given. With one
process, or when ``torch.distributed`` is not initialised, every group handle is ``None`` and the
helpers in :mod:`plugtron.core.parallel.comm` treat ``None`` as "nothing to communicate".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeGuard

import torch
import torch.distributed as dist
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.sharding import forget_meshes

# Where the virtual pipeline stages live. The model is cut into ``pp * chunks`` virtual stages
# and the schedule chooses their placement: ``looped`` (Megatron's interleaving, and every
# schedule without a V): chunk ``c`` on rank ``p`` is stage ``c * pp + p``, the stages go round
# the ranks ``chunks`` times; ``v`` (the V-shape of ZB-V and DualPipeV): two chunks per rank,
# rank ``p`` holds stages ``p`` and ``2 * pp - 1 - p``. Activations go down the ranks and back
# up, so the first and the last stage share rank 0 and the two middle stages share the last rank
# (their hand-over is local).
Placement = Literal["looped", "v"]
LOOPED: Final = "looped"
V_SHAPE: Final = "v"
PLACEMENTS: tuple[str, ...] = (LOOPED, V_SHAPE)


def check_placement(placement: str, pp: int, chunks: int) -> None:
    if placement not in PLACEMENTS:
        raise ConfigError(f"pipeline placement {placement!r} is not one of "
                          f"{', '.join(PLACEMENTS)}")
    if placement == V_SHAPE and chunks != 2:
        raise ConfigError(f"a V-shape placement holds exactly two model chunks per pipeline "
                          f"rank; got --vp {chunks}: leave --vp out or give --vp 2")


def virtual_stage(pp_rank: int, chunk: int, pp_size: int, placement: str = LOOPED) -> int:
    """The virtual stage that chunk ``chunk`` of rank ``pp_rank`` holds."""
    if placement == V_SHAPE and chunk == 1:
        return 2 * pp_size - 1 - pp_rank
    return chunk * pp_size + pp_rank


def stage_owner(stage: int, pp_size: int, placement: str = LOOPED) -> tuple[int, int]:
    """(pp rank, chunk) that holds virtual stage ``stage``."""
    if placement == V_SHAPE and stage >= pp_size:
        return 2 * pp_size - 1 - stage, 1
    return stage % pp_size, stage // pp_size


# Group kinds in creation order. Every rank creates the groups in this order (torch requires that
# all ranks call ``new_group`` for every group, in the same order).
GROUP_KINDS = ("tp", "cp", "dp", "dp-cp", "tp-cp", "pp", "model-parallel", "embedding",
               "etp", "ep", "edp")

_ORDER = ("tp", "cp", "ep", "dp", "pp")  # Megatron's order; the first varies fastest.


def validate_sizes(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                   etp: int | None = None, vp: int | None = None) -> None:
    """Raise :class:`ConfigError` naming the values and the rule when the sizes cannot be laid out.

    Called by the CLI before any process is launched, and by :meth:`ParallelContext.build`.
    """
    if not _is_int(world_size) or world_size < 1:
        raise ConfigError(f"world size must be an integer >= 1, got {world_size!r}")
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp), ("vp", vp)):
        if value is None and name in ("etp", "vp"):
            continue
        if not _is_int(value) or value < 1:
            raise ConfigError(f"--{name} must be an integer >= 1, got {value!r}")
    etp = tp if etp is None else etp
    if world_size % (tp * pp * cp):
        raise ConfigError(f"world size {world_size} is not divisible by "
                          f"tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp}")
    if world_size % (etp * ep * pp):
        raise ConfigError(f"world size {world_size} is not divisible by "
                          f"etp {etp} x ep {ep} x pp {pp} = {etp * ep * pp} (expert layout)")
    if vp is not None and pp < 2:
        raise ConfigError(f"--vp needs --pp > 1 (got --vp {vp} with --pp {pp})")


# Groups already created in the current default world, by rank list. Several runs in one
# process (a test pool's rank, a notebook) reuse them: each gloo group holds threads and
# connections until the world is destroyed, and creating one is a collective.
_GROUPS: dict = {"world": None, "by_ranks": {}}


def _world_groups() -> dict[tuple[int, ...], Any]:
    """The rank-list -> group map of the current default world (empty for a new world).

    Every rank creates every group in the same order, so every rank's map has the same keys and
    a cache hit on one rank is a hit on all: the collective order is kept.
    """
    world = dist.group.WORLD
    if _GROUPS["world"] is not world:
        _GROUPS["world"], _GROUPS["by_ranks"] = world, {}
        forget_meshes()  # DTensor's caches still name the old world's groups
    return _GROUPS["by_ranks"]


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _grid_groups(sizes: dict[str, int], kinds: tuple[str, ...]) -> list[list[int]]:
    """All groups that vary the dimensions in ``kinds`` with the others held fixed.

    Groups are listed with the fixed dimensions' first one varying fastest, and inside a group
    ranks are listed with the varied dimensions' first one varying fastest (as Megatron does).
    """
    dims = list(sizes)
    strides = [math.prod(sizes[d] for d in dims[:i]) for i in range(len(dims))]
    inner = [i for i, d in enumerate(dims) if d in kinds]
    outer = [i for i, d in enumerate(dims) if d not in kinds]

    def combos(axes: list[int]):
        # itertools.product varies its last argument fastest; reverse so the first axis does.
        for idx in itertools.product(*(range(sizes[dims[a]]) for a in reversed(axes))):
            yield sum(i * strides[a] for i, a in zip(idx, reversed(axes)))

    return [[base + off for off in combos(inner)] for base in combos(outer)]


def rank_groups(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, placement: str = LOOPED) -> dict[str, list[list[int]]]:
    """Every group of every kind (keys: :data:`GROUP_KINDS`), as lists of global ranks.

    A pure function: the same answer on every rank and without any process running, which is what
    the topology CLI prints and what :class:`ParallelContext` creates groups from.
    """
    validate_sizes(world_size, tp, pp, cp, ep, etp)
    etp = tp if etp is None else etp
    dp = world_size // (tp * cp * pp)
    edp = world_size // (etp * ep * pp)
    dec = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    exp = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    pp_groups = _grid_groups(dec, ("pp",))
    # The rank of the last stage (a V-shape placement puts it on the first rank, beside stage 0)
    last_stage_rank = stage_owner(pp * (2 if placement == V_SHAPE else 1) - 1, pp, placement)[0]
    return {
        "tp": _grid_groups(dec, ("tp",)),
        "cp": _grid_groups(dec, ("cp",)),
        "dp": _grid_groups(dec, ("dp",)),
        "dp-cp": _grid_groups(dec, ("dp", "cp")),
        "tp-cp": _grid_groups(dec, ("tp", "cp")),
        "pp": pp_groups,
        "model-parallel": _grid_groups(dec, ("tp", "pp")),
        # First and last stage of each pipeline: they share the tied word embedding.
        "embedding": [sorted({g[0], g[last_stage_rank]}) for g in pp_groups],
        "etp": _grid_groups(exp, ("tp",)),
        "ep": _grid_groups(exp, ("ep",)),
        "edp": _grid_groups(exp, ("dp",)),
    }


def _mine(groups: list[list[int]], rank: int) -> list[int]:
    """The group holding ``rank``; empty if none does (middle stages have no embedding group)."""
    return next((g for g in groups if rank in g), [])


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's place in every parallel layout, and the process groups it belongs to.

    Build it with :meth:`build`. ``*_ranks`` are the global ranks of this rank's group of that
    kind; ``*_group`` the matching ``torch.distributed`` handle (``None`` with one process or
    without an initialised process group); ``*_rank`` this rank's index inside that group.
    """

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    vp_size: int | None
    cp_size: int
    ep_size: int
    etp_size: int
    dp_size: int
    edp_size: int
    device: torch.device
    ranks: dict[str, list[int]] = field(repr=False)
    groups: dict[str, Any] = field(repr=False)
    #: Where the virtual stages live (``core/pipeline/layout.py``): the schedule chooses.
    pipeline_placement: str = LOOPED

    @classmethod
    def build(cls, world_size: int, rank: int, tp: int = 1, pp: int = 1, vp: int | None = None,
              cp: int = 1, ep: int = 1, etp: int | None = None, create_groups: bool = True,
              device: torch.device | str = "cpu", placement: str = LOOPED) -> ParallelContext:
        """Lay out the ranks and, in a multi-process run, create the process groups.

        When ``torch.distributed`` is initialised, ``world_size > 1`` and ``create_groups`` is
        true, this is a collective: every rank must call it with the same sizes, because each rank
        calls ``new_group`` for every distinct rank list (of every kind, in :data:`GROUP_KINDS`
        order), including groups it is not part of. Kinds with identical rank lists (dp and dp-cp
        when cp is 1, say) share one handle.
        """
        validate_sizes(world_size, tp, pp, cp, ep, etp, vp)
        check_placement(placement, pp, vp or 1)
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is outside world size {world_size}")
        etp = tp if etp is None else etp
        all_groups = rank_groups(world_size, tp, pp, cp, ep, etp, placement)
        ranks = {kind: _mine(groups, rank) for kind, groups in all_groups.items()}

        handles: dict[str, Any] = dict.fromkeys(all_groups)
        if create_groups and world_size > 1 and dist.is_available() and dist.is_initialized():
            if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
                raise ValueError(f"ParallelContext for rank {rank} of {world_size} built in "
                                 f"rank {dist.get_rank()} of {dist.get_world_size()}")
            created = _world_groups()
            for kind in GROUP_KINDS:
                for group in all_groups[kind]:
                    key = tuple(group)
                    if key not in created:
                        created[key] = dist.new_group(list(group))
                if ranks[kind]:
                    handles[kind] = created[tuple(ranks[kind])]

        return cls(world_size=world_size, rank=rank, tp_size=tp, pp_size=pp, vp_size=vp,
                   cp_size=cp, ep_size=ep, etp_size=etp, dp_size=world_size // (tp * cp * pp),
                   edp_size=world_size // (etp * ep * pp), device=torch.device(device),
                   ranks=ranks, groups=handles, pipeline_placement=placement)

    # Rank lists of this rank's groups.
    tp_ranks = property(lambda self: self.ranks["tp"])
    pp_ranks = property(lambda self: self.ranks["pp"])
    cp_ranks = property(lambda self: self.ranks["cp"])
    dp_ranks = property(lambda self: self.ranks["dp"])
    dp_cp_ranks = property(lambda self: self.ranks["dp-cp"])
    tp_cp_ranks = property(lambda self: self.ranks["tp-cp"])
    mp_ranks = property(lambda self: self.ranks["model-parallel"])
    embedding_ranks = property(lambda self: self.ranks["embedding"])
    etp_ranks = property(lambda self: self.ranks["etp"])
    ep_ranks = property(lambda self: self.ranks["ep"])
    edp_ranks = property(lambda self: self.ranks["edp"])

    # Process-group handles (None: single process, or not a member, as for embedding_group).
    tp_group = property(lambda self: self.groups["tp"])
    pp_group = property(lambda self: self.groups["pp"])
    cp_group = property(lambda self: self.groups["cp"])
    dp_group = property(lambda self: self.groups["dp"])
    dp_cp_group = property(lambda self: self.groups["dp-cp"])
    tp_cp_group = property(lambda self: self.groups["tp-cp"])
    mp_group = property(lambda self: self.groups["model-parallel"])
    embedding_group = property(lambda self: self.groups["embedding"])
    etp_group = property(lambda self: self.groups["etp"])
    ep_group = property(lambda self: self.groups["ep"])
    edp_group = property(lambda self: self.groups["edp"])

    # This rank's index inside each group.
    tp_rank = property(lambda self: self.ranks["tp"].index(self.rank))
    pp_rank = property(lambda self: self.ranks["pp"].index(self.rank))
    cp_rank = property(lambda self: self.ranks["cp"].index(self.rank))
    dp_rank = property(lambda self: self.ranks["dp"].index(self.rank))
    dp_cp_rank = property(lambda self: self.ranks["dp-cp"].index(self.rank))
    etp_rank = property(lambda self: self.ranks["etp"].index(self.rank))
    ep_rank = property(lambda self: self.ranks["ep"].index(self.rank))
    edp_rank = property(lambda self: self.ranks["edp"].index(self.rank))

    def virtual_stage(self, vp_rank: int | None = None) -> int:
        """The virtual stage that this rank's chunk ``vp_rank`` (default 0) holds."""
        return virtual_stage(self.pp_rank, vp_rank or 0, self.pp_size, self.pipeline_placement)

    @property
    def num_virtual_stages(self) -> int:
        return self.pp_size * (self.vp_size or 1)

    def is_pipeline_first_stage(self, vp_rank: int | None = None) -> bool:
        """This rank holds the first stage; with ``vp_rank`` given: its chunk ``vp_rank`` is
        the first stage."""
        if vp_rank is None:
            return self.pp_rank == 0
        return self.virtual_stage(vp_rank) == 0

    def is_pipeline_last_stage(self, vp_rank: int | None = None) -> bool:
        """This rank holds the last stage (the last rank; the first under a V-shape placement);
        with ``vp_rank`` given: its chunk ``vp_rank`` is the last stage."""
        last = self.num_virtual_stages - 1
        if vp_rank is None:
            return stage_owner(last, self.pp_size, self.pipeline_placement)[0] == self.pp_rank
        return self.virtual_stage(vp_rank) == last

    @property
    def pp_prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (the last stage for the first: it wraps)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def pp_next_rank(self) -> int:
        """Global rank of the next pipeline stage (the first stage for the last: it wraps)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def in_embedding_group(self) -> bool:
        """Whether this rank holds a copy of the word embedding (first or last stage)."""
        return bool(self.ranks["embedding"])

    def describe(self) -> dict:
        """Sizes and every group, JSON-ready; what the topology CLI prints."""
        sizes = {"tp": self.tp_size, "pp": self.pp_size, "vp": self.vp_size, "cp": self.cp_size,
                 "ep": self.ep_size, "etp": self.etp_size, "dp": self.dp_size,
                 "edp": self.edp_size}
        return {"world_size": self.world_size, "sizes": sizes,
                "pipeline_placement": self.pipeline_placement,
                "groups": rank_groups(self.world_size, self.tp_size, self.pp_size, self.cp_size,
                                      self.ep_size, self.etp_size, self.pipeline_placement)}
