"""Host-offloaded optimizer in buckets, overlapped with the bucketed all-reduce (Myelin Sec. V-B, V-C).

Only the compute-precision parameters and gradients stay on the device, as flat vectors of ``phi``
elements. The fp32 master weights and the optax state live in host memory as buckets of ``bsize``
elements; per step, for each bucket: fetch it (asynchronously, ``prefetch`` buckets ahead), descale
and clip its gradient slice, apply the inner optax transform, write the compute-precision copy into
the device parameter vector in place, and send the bucket back to the host without waiting. Device
memory for model state is ``4 phi + 16 bsize`` bytes for half precision (V-B) plus ``12 bsize`` per
prefetched bucket.

V-C: with ``chunks=iter_reduced_chunks(flat_local_grads, comm, k * bsize)`` the ``k`` buckets of a
chunk update once it is reduced, without waiting for the whole vector. The pipeline engine hands over
chunks reduced by a thread of their own (``allreduce.reduced_beside``), so chunk ``k + 1``'s reduction
runs while chunk ``k``'s buckets are fetched, updated and written back (Fig. 7). Global-norm clipping
needs every reduced gradient first, so with ``grad_clip > 0`` the chunks are all reduced before the first
update, the first ``prefetch + 1`` fetches issued before them.

The state is host data only (:class:`OffloadState`), and ``step`` is functional: it never modifies its
input state, so a skipped step (overflow agreed across ranks) simply keeps the old state, and
:meth:`OffloadedOptimizer.state_dict` gives a numpy pytree for orbax that does not depend on the bucket
size or host backend.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxhybrid.optim.bucket_programs import Prefetcher, counted_sq, programs
from jaxhybrid.optim.buckets import BucketLayout, check_bucketable, decay_bounds
from jaxhybrid.optim.hoststore import make_store
from jaxhybrid.optim.updater import DecayMask
from jaxhybrid.parallel.data.flat import FlatSpec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class OffloadState:
    """Host-resident optimizer state: per bucket ``(master, *per_param_leaves)``, plus shared leaves."""

    buckets: tuple
    shared: tuple


class OffloadedOptimizer:
    """Wraps an elementwise optax transform (AdamW, Adam, SGD, ...) and runs it on host-resident buckets.

    Args:
      inner: the optax transform; verified bucketable at construction (ValueError naming it otherwise).
      bucket_size: elements per bucket (Myelin's bsize), > 0; more than the parameter count makes one bucket.
      grad_clip: global-norm clip over all gradients (0 disables), applied before any bucket update.
      compute_dtype: dtype of the device parameter copy ("float32", "bfloat16", "float16").
      backend: host store, "numpy" or "pinned_host"; None picks per platform (``hoststore``).
      prefetch: buckets fetched ahead of the one updating.
      name: label for error messages (e.g. "adamw").
      decay: which parameters the weight decay applies to (``updater.decay_mask``; None: all), for a
        transform whose only read of the parameters is its decoupled decay (AdamW): where no decay
        applies, each bucket's program takes the step in which the transform saw zeros for the masters.
    """

    def __init__(self, inner: optax.GradientTransformation, bucket_size: int, *, grad_clip: float = 0.0,
                 compute_dtype: str = "float32", backend: str | None = None, prefetch: int = 1,
                 name: str | None = None, device: Any = None, decay: DecayMask | None = None):
        if bucket_size <= 0:
            raise ValueError(f"optim.bucket_size={bucket_size} must be > 0 (elements per offload bucket)")
        if grad_clip < 0:
            raise ValueError(f"grad_clip={grad_clip} must be >= 0 (0 disables clipping)")
        if compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype!r}; choose one of {', '.join(DTYPES)}")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch} must be >= 0")
        self.inner, self.bucket_size, self.grad_clip = inner, int(bucket_size), float(grad_clip)
        self.compute_dtype, self.prefetch = DTYPES[compute_dtype], int(prefetch)
        self.split = check_bucketable(inner, name)
        self.device = device or jax.local_devices()[0]  # under jax.distributed, jax.devices()[0] is process 0's
        self.store = make_store(backend, self.device)
        self.decay = decay
        self.spec: FlatSpec | None = None
        self.layout: BucketLayout | None = None
        self._decay_rows: list[jax.Array | None] = []
        self.on_bucket: Callable[[int], None] | None = None  # instrumentation (memory probes)
        (self._update, self._upcast, self._write, self._factor, self._sq,
         self._init_bucket) = programs(inner, self.split, self.compute_dtype, self.grad_clip)

    # -- set-up ------------------------------------------------------------------------------------
    def init(self, params: Any) -> OffloadState:
        """Copy fp32 ``params`` (a pytree) to host buckets and build the inner state bucket by bucket."""
        spec = FlatSpec(params)
        bad = [f"{k} {d}" for k, d in spec.dtypes().items() if d != np.float32]
        if bad:
            raise ValueError(f"offloaded master weights must be float32; got {', '.join(bad[:3])}")
        # A bucket larger than this process's parameters is one bucket of all of them (a pipeline stage holds
        # a fraction of the model, so the configured bsize is an upper bound, not a size every rank can fill).
        self.spec, self.layout = spec, BucketLayout(spec.n, min(self.bucket_size, spec.n))
        self._decay_rows = [None] * self.layout.count  # every element decays
        if self.decay is not None:  # a few numbers per bucket, kept on the device
            rows = decay_bounds(spec.sizes, jax.tree.leaves(self.decay(params)), self.layout)
            self._decay_rows = [jax.device_put(r, self.device) for r in rows]
        flat = spec.ravel_host(params)
        buckets, shared = [], None
        for s, e in self.layout.all_bounds():
            per, sh = self._init_bucket(jnp.asarray(flat[s:e]))
            shared = shared if shared is not None else tuple(np.asarray(x) for x in sh)
            buckets.append(self.store.from_numpy((flat[s:e], *per)))
        return OffloadState(tuple(buckets), shared)

    def _need(self) -> BucketLayout:
        if self.layout is None:
            raise ValueError("OffloadedOptimizer.init(params) must be called before this method")
        return self.layout

    # -- device parameters -------------------------------------------------------------------------
    def device_params(self, state: OffloadState) -> jax.Array:
        """Flat compute-precision parameters on the device, built bucket by bucket from the masters."""
        layout = self._need()
        params = jnp.zeros((layout.n,), self.compute_dtype, device=self.device)
        for i, (s, _) in enumerate(layout.all_bounds()):
            (m,) = self.store.fetch((state.buckets[i][0],))
            params = self._write(params, m, s)
        return params

    def params_tree(self, flat: jax.Array) -> Any:
        """The model's pytree view of a flat device vector (a copy; engines that take flat params avoid it)."""
        return self.spec.unravel(flat)

    def flatten(self, tree: Any) -> jax.Array:
        """Flatten a gradient pytree on the device, keeping its dtype."""
        self._need()
        return self.spec.ravel(tree)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, state: OffloadState, grads: Any = None, params: jax.Array | None = None, *,
             loss_scale: float = 1.0, finite: bool = True, sq: Any = None,
             chunks: Iterable[tuple[int, int, jax.Array]] | None = None,
             global_sum: Callable[[jax.Array], jax.Array] | None = None,
             uncounted: tuple[tuple[int, int], ...] = ()) -> tuple[OffloadState, jax.Array, dict]:
        """One optimizer step over all buckets (Myelin V-B), optionally fed by reduced chunks (V-C).

        Args:
          state: the host state (not modified).
          grads: gradients of ``loss * loss_scale``: flat ``(phi,)`` device vector or the params pytree.
          params: flat device parameters to update in place (donated); None builds a new vector.
          loss_scale: divided out inside each bucket.
          finite: the overflow decision agreed over all ranks; False skips the step (state unchanged).
          sq: squared global gradient norm of the scaled gradients (summed over stages); computed here
            from the gradients (and summed with ``global_sum``) when None.
          chunks: instead of ``grads``, an iterator of ``(start, end, reduced)`` in order covering
            ``[0, phi)`` with starts on bucket boundaries (``iter_reduced_chunks``). Always drained.
          global_sum: sums a scalar over the model-parallel group (pipeline stages).
          uncounted: flat ``[start, end)`` ranges left out of the norm computed here (a leaf another rank
            holds too and counts: the last stage's tied-embedding copy, ``FlatSpec.dropped_ranges``).

        Returns:
          ``(new_state, params, info)``; ``info`` has ``grad_norm``, ``skipped`` and ``nonfinite``
          (1.0 when a reduced gradient was non-finite: the step was rolled back on this rank and the
          trainer must agree it with ``global_max`` and keep the old state everywhere).
        """
        layout = self._need()
        if (grads is None) == (chunks is None):
            raise ValueError("pass exactly one of grads= (flat or pytree) or chunks= (reduced chunk iterator)")
        pieces = self._pieces(grads, chunks, layout)
        if not finite:
            for _ in pieces:  # chunks are collectives: every rank drains them in the same order
                pass
            params = params if params is not None else self.device_params(state)
            return state, params, {"grad_norm": float("nan"), "skipped": True, "nonfinite": 1.0}
        scale = jnp.float32(loss_scale)
        fetch = Prefetcher(self.store, state.buckets, self.prefetch + 1)
        fetch.top_up(0)
        own_sq = sq is None
        if own_sq and self.grad_clip > 0:
            # The clip factor needs the norm of every reduced gradient before the first bucket update.
            pieces = list(pieces)
            sq = self._sum_sq(pieces, global_sum, uncounted)
        params = params if params is not None else jnp.zeros((layout.n,), self.compute_dtype, device=self.device)
        factor, gnorm = self._factor(scale, jnp.float32(sq if sq is not None else 0.0))
        nonfinite = jnp.zeros((), bool)
        acc_sq, new_shared, landed, pending = [], None, [None] * layout.count, deque()
        for s, e, arr in pieces:
            if own_sq and self.grad_clip == 0:
                acc_sq.append(self._counted_sq(s, e, arr, uncounted))
            for i in layout.covered(s, e):
                bs, _ = layout.bounds(i)
                g, goff = arr, bs - s
                if arr.dtype != jnp.float32:
                    # Myelin's 4 bsize descale buffer: upcast this bucket's slice in its own program, so
                    # the update sees float32 gradients exactly as the on-device mixed-precision step.
                    g, goff = self._upcast(arr, goff, layout.bounds(i)[1] - bs), 0
                out, sh, params, nonfinite = self._update(fetch.get(i), state.shared, g, goff, params, bs,
                                                          factor, nonfinite, self._decay_rows[i])
                new_shared = new_shared if new_shared is not None else sh
                pending.append((i, self.store.send_back(out)))
                del out
                if self.on_bucket is not None:
                    self.on_bucket(i)
                while len(pending) > 1:  # at most one bucket in flight back to the host
                    j, h = pending.popleft()
                    landed[j] = self.store.land(h)
        for j, h in pending:
            landed[j] = self.store.land(h)
        if acc_sq:
            total = sum(acc_sq[1:], acc_sq[0])
            _, gnorm = self._factor(scale, global_sum(total) if global_sum else total)
        if bool(nonfinite):
            return state, self.device_params(state), {"grad_norm": float(gnorm), "skipped": True, "nonfinite": 1.0}
        new_state = OffloadState(tuple(landed), tuple(np.asarray(x) for x in new_shared))
        return new_state, params, {"grad_norm": float(gnorm), "skipped": False, "nonfinite": 0.0}

    def _sum_sq(self, pieces: list, global_sum, uncounted=()) -> jax.Array:
        parts = [self._counted_sq(s, e, a, uncounted) for s, e, a in pieces]
        total = sum(parts[1:], parts[0])
        return global_sum(total) if global_sum else total

    def _counted_sq(self, s: int, e: int, arr: jax.Array, uncounted) -> jax.Array:
        """Squared norm of the piece ``arr`` = flat ``[s, e)``, less the ``uncounted`` ranges it overlaps."""
        return counted_sq(s, e, arr, uncounted)

    def _pieces(self, grads, chunks, layout: BucketLayout) -> Iterator[tuple[int, int, jax.Array]]:
        if grads is not None:
            flat = grads if isinstance(grads, jax.Array) and grads.ndim == 1 else self.spec.ravel(grads)
            if flat.shape != (layout.n,):
                raise ValueError(f"flat gradients have shape {tuple(flat.shape)}; expected ({layout.n},)")
            return iter([(0, layout.n, flat)])
        return layout.in_order(chunks)

    # -- checkpoints and inspection ----------------------------------------------------------------
    def state_dict(self, state: OffloadState) -> dict:
        """Numpy pytree: ``master`` (phi,) and each inner leaf (phi,) or shared scalar, by leaf index."""
        self._need()
        host = [self.store.to_numpy(b) for b in state.buckets]
        cols = [np.concatenate([b[c] for b in host]) for c in range(len(host[0]))]
        out, per, shared = {"master": cols[0]}, iter(cols[1:]), iter(state.shared)
        out["state"] = {f"{j:03d}": next(per) if p else np.asarray(next(shared))
                        for j, p in enumerate(self.split.per_param)}
        return out

    def load_state_dict(self, saved: dict) -> OffloadState:
        """Rebuild host buckets from :meth:`state_dict` output (any bucket size may have written it)."""
        layout = self._need()
        master = np.asarray(saved["master"], np.float32)
        if master.shape != (layout.n,):
            raise ValueError(f"checkpoint master has shape {master.shape}; this model has {layout.n} parameters")
        leaves = [np.asarray(saved["state"][f"{j:03d}"]) for j in range(len(self.split.per_param))]
        per = [x for x, p in zip(leaves, self.split.per_param) if p]
        shared = tuple(x for x, p in zip(leaves, self.split.per_param) if not p)
        buckets = tuple(self.store.from_numpy((master[s:e], *(x[s:e] for x in per))) for s, e in layout.all_bounds())
        return OffloadState(buckets, shared)

    def master_params(self, state: OffloadState) -> Any:
        """fp32 master weights as the params pytree (numpy)."""
        return self.spec.unravel_host(self.state_dict(state)["master"])

    def inner_state(self, state: OffloadState) -> Any:
        """The inner optax state with per-parameter leaves as params pytrees (compare with plain optax)."""
        sd = self.state_dict(state)["state"]
        leaves = [self.spec.unravel_host(sd[f"{j:03d}"]) if p else sd[f"{j:03d}"]
                  for j, p in enumerate(self.split.per_param)]
        return self.split.treedef.unflatten(leaves)
