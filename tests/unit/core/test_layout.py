"""ParallelDims: the sizes, the counts derived from them, the rank arithmetic both ways, and the errors."""
import pytest

from jaxhybrid.core.config.schema import Config, ParallelConfig
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.core.layout import MESH_AXES, ParallelDims


def test_sizes_default_to_one_device():
    d = ParallelDims()
    assert (d.pipeline, d.data, d.tensor_col, d.tensor_row, d.tensor_depth, d.mesh_data) == (1, 1, 1, 1, 1, False)
    assert (d.tensor_size, d.grid_size, d.world_size, d.num_devices, d.mesh_size) == (1, 1, 1, 1, 1)
    assert not d.on_mesh


def test_derived_counts_of_a_hybrid_layout():
    d = ParallelDims(pipeline=3, data=2, tensor_col=5, tensor_row=7, tensor_depth=11)
    assert d.tensor_size == 5 * 7 * 11
    assert d.grid_size == d.world_size == 6  # pipeline > 1: the replicas are MPI ranks, each with its own mesh
    assert d.num_devices == 6 * 385
    assert d.mesh_shape == (2, 11, 7, 5)
    assert d.mesh_size == 2 * 385
    assert d.mesh_sizes() == dict(zip(MESH_AXES, (2, 11, 7, 5))) == {"data": 2, "depth": 11, "row": 7, "col": 5}
    assert not d.on_mesh


@pytest.mark.parametrize("dims,on_mesh,world", [
    (ParallelDims(data=4), False, 4),  # replicas as MPI ranks
    (ParallelDims(data=4, mesh_data=True), True, 1),  # the same replicas on one mesh
    (ParallelDims(data=2, tensor_row=2), True, 1),  # tensor mode: data is a mesh axis
    (ParallelDims(pipeline=2, data=2, tensor_row=2), False, 4),  # hybrid: one mesh per rank
])
def test_tensor_mode_puts_data_on_the_mesh_and_counts_one_rank(dims, on_mesh, world):
    assert dims.on_mesh is on_mesh
    assert dims.world_size == world
    assert dims.num_devices == dims.pipeline * dims.data * dims.tensor_size


def test_from_mesh_shape_is_the_inverse_of_mesh_shape():
    d = ParallelDims.from_mesh_shape((2, 3, 5, 7))
    assert d.mesh_shape == (2, 3, 5, 7)
    assert (d.pipeline, d.data, d.tensor_depth, d.tensor_row, d.tensor_col) == (1, 2, 3, 5, 7)


def test_ranks_round_trip_and_rows_are_consecutive():
    d = ParallelDims(pipeline=4, data=3)
    assert [d.coords(r) for r in range(4)] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert [d.coords(r) for r in (4, 7, 11)] == [(0, 1), (3, 1), (3, 2)]
    assert all(d.rank(*d.coords(r)) == r for r in range(d.grid_size))
    assert all(d.coords(d.rank(s, j)) == (s, j) for s in range(4) for j in range(3))
    assert d.row_ranks(1) == [4, 5, 6, 7]
    assert d.column_ranks(2) == [2, 6, 10]


def test_ranks_outside_the_grid_are_named():
    with pytest.raises(ValueError, match=r"rank 8 outside a 2 x 4 grid of 8 ranks"):
        ParallelDims(2, 4).coords(8)
    with pytest.raises(ValueError, match=r"rank -1 outside"):
        ParallelDims(2, 4).coords(-1)
    with pytest.raises(ValueError, match=r"\(stage 2, replica 0\) outside a 2 x 4 grid"):
        ParallelDims(2, 4).rank(2, 0)
    with pytest.raises(ValueError, match=r"\(stage 0, replica 4\) outside a 2 x 4 grid"):
        ParallelDims(2, 4).rank(0, 4)


def test_wrong_world_size_names_the_grid_and_the_fix():
    with pytest.raises(ConfigError, match=r"parallel.pipeline\(2\) x parallel.data\(2\) = 4 != world size 3; "
                                          r"launch with -n 4 or change the grid"):
        ParallelDims(2, 2).check_world(3)
    ParallelDims(2, 2).check_world(4)
    ParallelDims(2, 2, tensor_row=2).check_world(4)  # the tensor grid is devices of each rank, not ranks


def test_wrong_device_count_names_the_mesh_and_the_cpu_flag():
    with pytest.raises(ValueError, match=r"mesh data\(1\) x depth\(2\) x row\(2\) x col\(1\) = 4 != 8 devices; .*"
                                         r"xla_force_host_platform_device_count=4"):
        ParallelDims.from_mesh_shape((1, 2, 2, 1)).check_devices(8)
    ParallelDims.from_mesh_shape((1, 2, 2, 1)).check_devices(4)
    # One stage's mesh: the pipeline's other stages are other ranks' devices.
    ParallelDims(pipeline=4, data=2, tensor_col=2).check_devices(4)


@pytest.mark.parametrize("kwargs,match", [
    ({"pipeline": 0}, r"grid pipeline=0 x data=1: both must be >= 1"),
    ({"data": -2}, r"grid pipeline=1 x data=-2: both must be >= 1"),
    ({"tensor_row": 0}, r"mesh axis sizes must be integers >= 1, got \{'row': 0\}"),
    ({"tensor_col": 2.0, "tensor_depth": 0}, r"got \{'depth': 0, 'col': 2.0\}"),
])
def test_sizes_below_one_are_refused_with_their_numbers(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelDims(**kwargs)


def test_frozen():
    with pytest.raises(AttributeError):
        ParallelDims().data = 2


def test_config_layout_is_built_from_parallel_and_its_counts_delegate():
    p = ParallelConfig(pipeline=2, data=3, tensor_col=2, tensor_row=1, tensor_depth=2)
    cfg = Config(parallel=p)
    assert cfg.layout == ParallelDims(2, 3, 2, 1, 2, False)
    assert (cfg.tensor_size, cfg.world_size, cfg.num_devices, cfg.on_mesh) == (4, 6, 24, False)
    mesh = Config(parallel=ParallelConfig(data=4, mesh_data=True))
    assert (mesh.on_mesh, mesh.world_size, mesh.num_devices) == (True, 1, 4)
