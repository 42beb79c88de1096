"""AxoNN 4D: data x Agarwal 3D tensor parallelism on a (data, depth, row, col) mesh (AxoNN-4D Secs. III-V).

Read first: ``linear.py`` (Algorithm 1 with consistent axis names, the 2BP split, switches B-E), then
``ops.py`` (the ops object injected into the unchanged model; optimization A), ``sharding.py`` (where
each parameter lives, divisibility rules), ``engine.py`` (the GradEngine), ``hlo.py`` (collective bytes
from compiled HLO against eqs. 4-8 of ``jaxhybrid.planner.comm_model``).

Multi-process launch (item 6). The mesh is built from ``jax.devices()``, which after
``jax.distributed.initialize`` lists the devices of every process, so the same engine spans nodes: start
one process per node (or per GPU) with the same command, e.g. under Slurm::

    srun -N 4 --ntasks-per-node=1 python -c "import jax; jax.distributed.initialize(); \\
        from jaxhybrid.cli import main; main(['train', '--config', 'run.yaml'])"

``jax.distributed.initialize()`` reads the coordinator address, process count and id from Slurm (or
pass ``coordinator_address=host:port, num_processes=N, process_id=i``). Every process must feed the same
global batch (the engine's ``device_put`` of the batch then takes each process's addressable shards) and
only ``is_writer`` (process 0) writes files. Device order follows ``jax.devices()``: process-major, so
with one process per node the outer mesh axes (data, then depth) cross nodes and column, the innermost
axis, stays inside a node, which is the hierarchy of AxoNN Sec. V. See the report in this package's
tests for the status of the two-process CPU test.
"""
from jaxhybrid.tensor.engine import TensorEngine, order_microbatches, tensor_remat
from jaxhybrid.tensor.linear import NORMAL, TRANSPOSED, Layout, Linear3D, Switches
from jaxhybrid.tensor.mesh import AXES, MeshShape, factorizations, make_mesh
from jaxhybrid.tensor.ops import TensorOps
from jaxhybrid.tensor.sharding import check_layout, param_shardings, param_spec

__all__ = ["TensorEngine", "order_microbatches", "tensor_remat", "NORMAL", "TRANSPOSED", "Layout", "Linear3D",
           "Switches", "AXES", "MeshShape", "factorizations", "make_mesh", "TensorOps", "check_layout",
           "param_shardings", "param_spec"]
