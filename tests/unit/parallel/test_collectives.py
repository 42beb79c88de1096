"""The reduce-scatter every backend computes right (jaxhybrid.parallel.collectives): on gloo a psum and this
device's tile, which must equal ``lax.psum_scatter`` tile for tile, along any dimension. (That gloo's own
reduce-scatter is wrong, and this one right, across processes: tests/mpi's reduce-scatter test.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxhybrid.parallel import collectives


@pytest.mark.parametrize("dim", [0, 1])
def test_the_gloo_reduce_scatter_equals_psum_scatter(monkeypatch, dim):
    mesh = Mesh(np.array(jax.devices()[:4]), ("depth",))
    x = jax.device_put(jnp.arange(4 * 8 * 12, dtype=jnp.float32).reshape(4, 8, 12) % 11,
                       NamedSharding(mesh, P("depth")))
    out = P(None, "depth") if dim else P("depth")

    def scattered(gloo: bool):
        monkeypatch.setattr(collectives, "gloo_collectives", lambda: gloo)
        f = jax.shard_map(lambda r: collectives.psum_scatter(r[0], "depth", scatter_dimension=dim),
                          mesh=mesh, in_specs=P("depth"), out_specs=out)
        return np.asarray(jax.jit(f)(x))

    want = np.asarray(x).sum(0)
    assert np.array_equal(scattered(False), want) and np.array_equal(scattered(True), want)


def test_gloo_is_taken_only_for_a_multi_process_cpu_backend():
    assert collectives.gloo_collectives() is False  # this process: CPU without JAX's distributed runtime
