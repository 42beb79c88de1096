"""Tied embeddings across stages (pipeline/tied.py): the first and last stage end with the same summed
table gradient, bit for bit, and the global norm counts it once. A fake row communicator pairs the two
ranks in one process; the MPI parity test (tests/mpi, tied config) runs the real exchange."""
import jax.numpy as jnp
import numpy as np

from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.model.transformer import TIED_KEY
from jaxhybrid.parallel.pipeline.tied import norm_view, sum_tied


class _Pair:
    """Both ends of one Sendrecv: ``peer_buf`` is what the other rank sends."""

    def __init__(self, peer_buf):
        self.peer_buf, self.calls = peer_buf, []

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag):  # noqa: N802 (mpi4py's name)
        self.calls.append((dest, source, sendtag == recvtag))
        recvbuf[...] = self.peer_buf


def test_first_and_last_stage_hold_the_same_summed_table_gradient():
    rng = np.random.default_rng(0)
    g_first, g_last = (rng.standard_normal((8, 4)).astype(np.float32) for _ in range(2))
    first = {"embed": {"wte": jnp.asarray(g_first), "wpe": jnp.ones((3, 4))}, "block_000": {"w": jnp.ones(2)}}
    last = {TIED_KEY: jnp.asarray(g_last), "head": {"w": jnp.ones(2)}}
    row0, row3 = _Pair(g_last), _Pair(g_first)
    out0 = sum_tied(first, (0, 1, 2, 3), 0, True, row0)
    out3 = sum_tied(last, (0, 1, 2, 3), 3, True, row3)
    assert row0.calls == [(3, 3, True)] and row3.calls == [(0, 0, True)]
    np.testing.assert_array_equal(np.asarray(out0["embed"]["wte"]), np.asarray(out3[TIED_KEY]))
    assert_tree_close(np.asarray(out0["embed"]["wte"]), g_first + g_last, "exact", "summed table")
    assert out0["embed"]["wpe"] is first["embed"]["wpe"] and out3["head"] is last["head"]
    # The global norm counts the summed table once: on the first stage.
    assert TIED_KEY not in norm_view(out3) and norm_view(out0) is out0


def test_untied_middle_and_single_stage_exchange_nothing():
    g = {"embed": {"wte": jnp.ones((2, 2))}}
    idle = _Pair(None)
    for stage, n, tied in ((0, 4, False), (1, 4, True), (0, 1, True)):
        assert sum_tied(g, tuple(range(n)), stage, tied, idle) is g
    assert idle.calls == []


def test_the_v_placement_sums_both_copies_on_one_rank_without_an_exchange():
    """ZB-V's placement (rank r holds stages r and 2p-1-r) puts the embedding and the head on rank 0: its two
    copies of the table are summed in place, first + last as an exchange sums them, and the norm counts one."""
    rng = np.random.default_rng(1)
    g_first, g_last = (rng.standard_normal((8, 4)).astype(np.float32) for _ in range(2))
    both = {"embed": {"wte": jnp.asarray(g_first)}, TIED_KEY: jnp.asarray(g_last), "head": {"w": jnp.ones(2)}}
    idle = _Pair(None)
    out = sum_tied(both, (0, 1, 1, 0), 0, True, idle)
    assert idle.calls == []
    np.testing.assert_array_equal(np.asarray(out["embed"]["wte"]), np.asarray(out[TIED_KEY]))
    assert_tree_close(np.asarray(out[TIED_KEY]), g_first + g_last, "exact", "summed table")
    assert set(norm_view(out)) == {"embed", "head"}
    assert sum_tied({"block_001": {"w": jnp.ones(2)}}, (0, 1, 1, 0), 1, True, idle)["block_001"] is not None
