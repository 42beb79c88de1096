"""The parallel layout of a run: one validated, frozen record of its sizes and the arithmetic on them.

Myelin's process grid is ``G_inter x G_data`` (pipeline stages x data replicas, Fig. 2); under each stage
AxoNN's tensor grid is ``G_d x G_r x G_c`` (depth, row, column; Sec. V). The config, the MPI topology, the
tensor mesh and the planner all read their counts from :class:`ParallelDims` (modelled on torchtitan's
``ParallelDims``), so there is one place that multiplies them out and one wording for a wrong size.

Ranks: rank ``r`` of a ``G_inter x G_data`` job runs stage ``i = r % G_inter`` of replica ``j = r // G_inter``,
so one pipeline row occupies consecutive ranks (activations stay on a node when ranks are packed by node)
and a data column is strided by ``G_inter``.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxhybrid.core.errors import ConfigError

# The tensor mesh's axes, outermost first (AxoNN Sec. V's hierarchy: column innermost, the most tightly
# coupled devices); jaxhybrid.parallel.tensor.mesh names its axes with these.
MESH_AXES = ("data", "depth", "row", "col")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of a layout: ``pipeline`` = G_inter, ``data`` = G_data, ``tensor_col/row/depth`` = G_c, G_r, G_d,
    and ``mesh_data``: whether the data replicas are an axis of one JAX mesh rather than MPI ranks.

    Raises :class:`ConfigError` on construction unless every size is an integer >= 1.
    """

    pipeline: int = 1
    data: int = 1
    tensor_col: int = 1
    tensor_row: int = 1
    tensor_depth: int = 1
    mesh_data: bool = False

    def __post_init__(self):
        if not all(isinstance(v, int) and v >= 1 for v in (self.pipeline, self.data)):
            raise ConfigError(f"grid pipeline={self.pipeline} x data={self.data}: both must be >= 1")
        bad = {k: v for k, v in self.mesh_sizes().items() if not (isinstance(v, int) and v >= 1)}
        if bad:
            raise ConfigError(f"mesh axis sizes must be integers >= 1, got {bad}")

    @classmethod
    def from_mesh_shape(cls, shape: tuple[int, int, int, int]) -> "ParallelDims":
        """One stage's layout from its mesh shape ``(data, depth, row, col)`` (the inverse of :attr:`mesh_shape`)."""
        data, depth, row, col = shape
        return cls(data=data, tensor_depth=depth, tensor_row=row, tensor_col=col)

    # -- derived counts -------------------------------------------------------------------------------------
    @property
    def tensor_size(self) -> int:
        """G_tensor = G_d x G_r x G_c: the devices that share one model replica."""
        return self.tensor_depth * self.tensor_row * self.tensor_col

    @property
    def on_mesh(self) -> bool:
        """Tensor mode: one pipeline stage whose (data, depth, row, col) grid is one JAX mesh, because a
        tensor axis is > 1 or :attr:`mesh_data` puts the data replicas there."""
        return self.pipeline == 1 and (self.tensor_size > 1 or self.mesh_data)

    @property
    def replicas_on_ranks(self) -> bool:
        """Whether there are data replicas and each is an MPI rank (no whole-job mesh), of one device or of a
        local tensor mesh: the columns that ``optim.allreduce_backend: xla`` reduces over."""
        return self.data > 1 and not self.on_mesh

    @property
    def replicas_are_ranks(self) -> bool:
        """Whether there are data replicas and each is an MPI rank of one device (no tensor axis, no mesh): the
        columns that ``optim.shard_optimizer`` cuts its flat shards over."""
        return self.replicas_on_ranks and self.tensor_size == 1

    @property
    def grid_size(self) -> int:
        """Ranks of the process grid: G_inter x G_data."""
        return self.pipeline * self.data

    @property
    def world_size(self) -> int:
        """MPI ranks: G_inter x G_data. In tensor mode (:attr:`on_mesh`) the data axis is a mesh axis of one
        process (or of JAX's distributed runtime), not MPI ranks."""
        return 1 if self.on_mesh else self.grid_size

    @property
    def num_devices(self) -> int:
        """Devices of the whole job: G_inter x G_data x G_d x G_r x G_c."""
        return self.grid_size * self.tensor_size

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """``(data, depth, row, col)``: the sizes of one stage's tensor mesh, in :data:`MESH_AXES` order."""
        return self.data, self.tensor_depth, self.tensor_row, self.tensor_col

    @property
    def mesh_size(self) -> int:
        """Devices of one stage's mesh: G_data x G_tensor."""
        return self.data * self.tensor_size

    def mesh_sizes(self) -> dict[str, int]:
        """The mesh's axis sizes by axis name."""
        return dict(zip(MESH_AXES, self.mesh_shape))

    # -- rank arithmetic ------------------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of a world rank."""
        if not 0 <= rank < self.grid_size:
            raise ValueError(f"rank {rank} outside a {self.pipeline} x {self.data} grid of {self.grid_size} ranks")
        return rank % self.pipeline, rank // self.pipeline

    def rank(self, stage: int, replica: int) -> int:
        """World rank of ``(stage, replica)``: the one conversion between coordinates and ranks."""
        if not (0 <= stage < self.pipeline and 0 <= replica < self.data):
            raise ValueError(f"(stage {stage}, replica {replica}) outside a {self.pipeline} x {self.data} grid")
        return replica * self.pipeline + stage

    def row_ranks(self, replica: int) -> list[int]:
        """The pipeline row of ``replica``: its stages' ranks, first stage first."""
        return [self.rank(s, replica) for s in range(self.pipeline)]

    def column_ranks(self, stage: int) -> list[int]:
        """The data column of ``stage``: its replicas' ranks."""
        return [self.rank(stage, j) for j in range(self.data)]

    # -- checks against what was launched -------------------------------------------------------------------
    def check_world(self, world_size: int) -> None:
        """Raise ConfigError unless ``world_size`` MPI ranks are the grid's G_inter x G_data."""
        if world_size != self.grid_size:
            raise ConfigError(f"parallel.pipeline({self.pipeline}) x parallel.data({self.data}) = {self.grid_size} "
                              f"!= world size {world_size}; launch with -n {self.grid_size} or change the grid")

    def check_devices(self, n_devices: int) -> None:
        """Raise ValueError unless one stage's mesh (:attr:`mesh_size`) has exactly ``n_devices`` devices."""
        if self.mesh_size != n_devices:
            data, depth, row, col = self.mesh_shape
            raise ValueError(
                f"mesh data({data}) x depth({depth}) x row({row}) x col({col}) = "
                f"{self.mesh_size} != {n_devices} devices; the product of the four axis sizes must equal the "
                f"device count (on CPU, {self.mesh_size} fake devices: XLA_FLAGS="
                f"--xla_force_host_platform_device_count={self.mesh_size}, set before JAX starts)")
