"""AxoNN 4D: data x Agarwal 3D tensor parallelism on a (data, depth, row, col) mesh (AxoNN-4D Secs. III-V).

Read first: ``linear.py`` (Algorithm 1 with consistent axis names, the 2BP split, switches B-E), then
``ops.py`` (the ops object injected into the unchanged model; optimization A), ``sharding.py`` (where
each parameter lives, divisibility rules), ``jaxhybrid.runtime.engines.tensor`` (the GradEngine), ``hlo.py`` (collective bytes
from compiled HLO against eqs. 4-8 of ``jaxhybrid.planner.comm_model``).

Multi-process launch. The mesh is built from ``jax.devices()``, which after
``jax.distributed.initialize`` lists the devices of every process, so the same engine spans nodes.
``jaxhybrid train --distributed`` starts the runtime (``distributed.py`` finds the peers from srun, from
mpirun / ``jaxhybrid launch``, or from ``--coordinator --num-processes --process-id``)::

    srun -N 4 --ntasks-per-node=1 jaxhybrid train --distributed --config run.yaml     # Slurm
    jaxhybrid launch -n 2 -- --distributed --config run.yaml                          # one node, MPI

Every process computes the same global batch (the engine's ``device_put`` then takes its addressable
shards); only process 0 (``is_writer``) writes metrics, and orbax writes one checkpoint directory
together from all processes. Device order follows ``jax.devices()``: process-major, so with one process
per node the outer mesh axes (data, then depth) cross nodes and column, the innermost axis, stays
inside a node, which is the hierarchy of AxoNN Sec. V. ``tests/mpi/test_mpi_resume.py`` trains a
(2, 1, 2, 2) mesh over two CPU processes against the one-process run and resumes it.
"""
from jaxhybrid.parallel.tensor.linear import NORMAL, TRANSPOSED, Layout, Linear3D, Switches
from jaxhybrid.parallel.tensor.mesh import AXES, factorizations, make_mesh
from jaxhybrid.parallel.tensor.ops import TensorOps
from jaxhybrid.parallel.tensor.sharding import check_layout, param_shardings, param_spec

__all__ = ["NORMAL", "TRANSPOSED", "Layout", "Linear3D",
           "Switches", "AXES", "factorizations", "make_mesh", "TensorOps", "check_layout",
           "param_shardings", "param_spec"]
