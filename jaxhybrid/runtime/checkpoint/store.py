"""Atomic, per-rank checkpoints with orbax; resume restores params, optimizer, loss scale and sampler.

Layout: ``<run.dir>/checkpoints/rank_<r>/<step>/`` written by an orbax ``CheckpointManager`` (it writes
to a temporary directory and renames it on commit, so a crash mid-save leaves nothing that loads).
Under mpirun each rank owns its directory, which its own process writes alone, even where every rank
joined one JAX distributed runtime (``optim.allreduce_backend=xla``); the step to resume from is the
newest one that *every* rank committed, agreed through the engine. One rank over several processes
(``--distributed``) writes its one directory from all of them.

Each step's ``meta`` records digests of its arrays and of itself (:mod:`.digest`), committed with the step;
a restore checks them. Rotation keeps the newest ``keep`` steps and, beyond them, the newest step saved
after a finite training step, so a run that went non-finite cannot rotate its last good state away.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import multihost
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from jaxhybrid.core.errors import ConfigError, DiskFull, is_disk_full, says_disk_full
from jaxhybrid.optim.updater import spans_processes
from jaxhybrid.runtime.checkpoint import digest
from jaxhybrid.runtime.memory_check import free_disk_bytes, size_text


def _to_host(tree):
    return jax.tree.map(lambda x: x if spans_processes(x) else np.asarray(x), tree)


def _abstract(x):
    """The restore target of one leaf: global arrays (across processes, or over a one-process mesh) come back
    with their live sharding, the rest as numpy. Why the one-process mesh too: a checkpoint that
    ``--distributed`` processes wrote records its arrays' shardings, and orbax refuses to restore those
    without a sharded target ("Topology mismatch"), so one process could not resume it on the same mesh."""
    if isinstance(x, jax.ShapeDtypeStruct):  # already a target
        return x
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:  # spans_processes(x) included
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return np.zeros((), x.dtype) if x.ndim == 0 else jax.ShapeDtypeStruct(x.shape, x.dtype)


def _bytes_written(x) -> int:
    """The bytes this process writes of one leaf: its own shards of an array spanning processes."""
    if isinstance(x, jax.Array) and spans_processes(x):
        return sum(int(sh.data.nbytes) for sh in x.addressable_shards if sh.replica_id == 0)
    return int(np.asarray(x).nbytes)


class _PrimaryHostNumpyHandler(ocp.type_handlers.NumpyHandler):
    """orbax's numpy leaf writer, writing from the checkpoint's primary host. Why: orbax 0.12's own
    (``NumpyHandler._background_serialize``) writes only where ``multihost.process_index() == 0``, whatever
    ``MultiprocessingOptions.primary_host`` says, so where every rank joined one JAX runtime no rank but 0
    wrote the arrays of its own checkpoint. Reads are orbax's."""

    def __init__(self, primary_host: int):
        super().__init__()
        self.primary_host = primary_host

    async def _background_serialize(self, values, infos, args=None):
        # orbax's body, with the primary host in place of process 0.
        writes = []
        for value, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            spec = ts_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
                use_ocdbt=info.is_ocdbt_checkpoint, metadata_key=self._metadata_key,
                process_index=ocdbt_utils.get_process_index_for_subdir(
                    use_ocdbt=info.is_ocdbt_checkpoint, override_ocdbt_process_id=self._override_ocdbt_process_id))
            if multihost.is_primary_host(self.primary_host):
                writes.append(self._open_and_write(value, spec.json, info.ts_context))
        await asyncio_utils.cancellable(asyncio.gather(*writes), message="[process=%s] numpy writes were cancelled.",
                                        process_index=multihost.process_index())


def _state_handler(options: ocp.options.MultiprocessingOptions) -> ocp.PyTreeCheckpointHandler:
    """The ``state`` item's handler: orbax's, with :class:`_PrimaryHostNumpyHandler` for the numpy leaves
    (jax.Arrays spanning processes keep orbax's writer, each process writing its own shards)."""
    types = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, _PrimaryHostNumpyHandler(options.primary_host)),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))
    return ocp.PyTreeCheckpointHandler(multiprocessing_options=options, type_handler_registry=types)


def _restore_args(target: Any) -> ocp.args.PyTreeRestore:
    """Restore arguments for :func:`_abstract`'s target: numpy where it has no sharding, else its sharding."""
    return ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


class UnreadableCheckpoint(ValueError):
    """A saved state that cannot be read; ``reason`` alone, for callers that give their own fix (a resume's
    depends on the steps its rank holds: :meth:`Checkpointer.restore`)."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path} holds no readable checkpoint ({reason}); restore the folder from a copy, or use "
                         f"another step")
        self.reason = reason


class DamagedStep(ValueError):
    """A step this rank cannot restore: unreadable, or its contents differ from the digests saved with it.
    A resume falls back to an earlier step on it (:meth:`jaxhybrid.runtime.trainer.Trainer.restore`)."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


def state_metadata(path: str | Path) -> Any:
    """The tree of shapes and dtypes of one saved ``state`` (``<rank dir>/<step>/state``), no array loaded."""
    # orbax looks for the step's metadata file in the item's own folder and logs a warning per read.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        meta = ocp.StandardCheckpointer().metadata(Path(path).absolute())
    except FileNotFoundError:
        meta = None
    finally:
        absl.setLevel(level)
    meta = getattr(meta, "item_metadata", meta)
    # orbax returns None when it cannot read the metadata: its file gone, or the array store it reads from
    # truncated (a damaged or copied-in-part save); "missing" alone sent users looking for a file that is there.
    if meta is None:
        raise UnreadableCheckpoint(path, "its orbax metadata is missing or damaged")
    return meta


def tree_differences(saved: Any, like: Any) -> list[str]:
    """``"path: saved (shape), this run (shape)"`` for each array that :func:`state_metadata`'s tree
    ``saved`` and the pytree ``like`` do not share in the same shape (paths as orbax names its arrays:
    dict keys, sequence indices and attribute names joined by dots; dtypes may differ, as a resume casts)."""
    def shapes(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {digest.leaf_name(path): tuple(x.shape) if hasattr(x, "shape") else np.shape(x) for path, x in leaves}

    old, new = shapes(saved), shapes(like)
    out = [f"{k}: saved {old[k]}, this run {new[k]}" for k in old if k in new and old[k] != new[k]]
    out += [f"{k}: saved {old[k]}, not in this run" for k in old if k not in new]
    out += [f"{k}: not saved, this run {new[k]}" for k in new if k not in old]
    return sorted(out, key=lambda line: not line.startswith("params"))  # the weights first: the clearest sign


def read_state(path: str | Path) -> Any:
    """One saved ``state`` (``<rank dir>/<step>/state``) as numpy, in this process, whatever mesh and
    process count wrote it (tools, tests, export). orbax alone refuses a checkpoint of global arrays written
    on another topology without a target, so the target is built from its metadata, on one device. Where
    the step's ``meta`` records digests, the state is checked against them. Raises
    :class:`UnreadableCheckpoint` for a state that cannot be read or differs from its digests."""
    reader = ocp.StandardCheckpointer()
    tree = state_metadata(path)
    # This process's device: under --distributed jax.devices()[0] is process 0's, which another process
    # cannot fill ("no addressable shards"), and the restore's collective barrier then hangs process 0.
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree)
    try:
        state = jax.tree.map(np.asarray, reader.restore(Path(path).absolute(), target))
    except Exception as e:  # noqa: BLE001 (orbax wraps tensorstore's read errors in a bare Exception)
        why = read_error(e)
        if why is None:
            raise
        raise UnreadableCheckpoint(path, why) from None
    meta = _step_meta(Path(path).parent)
    bad = digest.mismatches(state, meta) if meta is not None else None
    if bad:
        raise UnreadableCheckpoint(path, f"its contents differ from the digests saved with it: {'; '.join(bad[:3])}"
                                         f"{f'; and {len(bad) - 3} more' if len(bad) > 3 else ''}")
    return state


def read_error(e: BaseException) -> str | None:
    """The reason, in one short line, of an error reading a saved array: tensorstore raises ValueErrors
    (OUT_OF_RANGE for a truncated file, DATA_LOSS for damaged bytes) that orbax may wrap in a bare
    ``Exception`` with the whole TensorStore spec in its text; None for any other error."""
    cause = e if isinstance(e, (KeyError, OSError, ValueError)) else e.__cause__
    if not isinstance(cause, (KeyError, OSError, ValueError)):
        return None
    why = " ".join(str(cause).split())
    return why[:240] + ("..." if len(why) > 240 else "")


def _step_meta(step_dir: Path) -> dict | None:
    """The ``meta`` item orbax wrote beside a step's ``state`` (its JSON file), or None where there is none
    (an export's parts) or it cannot be read (the digests then have nothing to check against)."""
    try:
        return json.loads((step_dir / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return None


def saved_meta(run_dir: str | Path, rank: str, step: int) -> dict | None:
    """The ``meta`` item (step, loss scale, sampler) that :meth:`Checkpointer.save` wrote for ``rank``
    (``"rank_<r>"``) at ``step``, read as the JSON file orbax keeps it in, without orbax; None if unreadable."""
    return _step_meta(Path(run_dir) / "checkpoints" / rank / str(step))


def committed_steps(run_dir: str | Path) -> dict[str, list[int]]:
    """The steps checkpointed in each rank's folder of ``run_dir`` (from the folder names; orbax names a
    step's folder by its number once committed, and an unfinished save by a temporary name)."""
    out = {}
    for d in sorted((Path(run_dir) / "checkpoints").glob("rank_*")):
        steps = sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())
        if steps:
            out[d.name] = steps
    return out


class _DropDiskFull(logging.Filter):
    """Drops the records of a write that found the disk full: orbax's writer threads and asyncio log each
    with its traceback, hundreds of lines that hid the one :class:`DiskFull` line that matters."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (is_disk_full(record.exc_info[1] if record.exc_info else None)
                    or says_disk_full(record.getMessage()))


_DROP_DISK_FULL = _DropDiskFull()


def _drop_closed_loop_reports() -> None:
    """From now on, drop the "Event loop is closed" errors that the writes of a failed save report as
    unraisable (each with its traceback); every other unraisable error is reported as before. Installed
    once, however many saves fail."""
    hook = sys.unraisablehook
    if getattr(hook, "drops_closed_loop", False):
        return

    def quiet(u) -> None:
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
            hook(u)

    quiet.drops_closed_loop = True
    sys.unraisablehook = quiet


class Checkpointer:
    """Saves ``{"state": pytree, "meta": json}`` per step for this rank, keeping ``keep`` steps (see
    :meth:`rotate`).

    ``ranks``: the job's rank count. With more than one, each rank is one process that writes and reads its
    folder alone, without waiting for the others, also where all of them joined one JAX distributed runtime
    (``optim.allreduce_backend=xla``: orbax would otherwise write from JAX process 0 only). With one, every
    JAX process of the run writes the one folder together (``--distributed``: each its shards)."""

    def __init__(self, run_dir: str | Path, rank: int = 0, keep: int = 2, ranks: int = 1):
        self.dir = Path(run_dir).absolute() / "checkpoints" / f"rank_{rank}"
        self.keep = keep
        # Several ranks: this process is the folder's primary host and meets no other process at orbax's barriers.
        me = jax.process_index()
        processes = (ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}) if ranks > 1
                     else ocp.options.MultiprocessingOptions())
        # create=False: orbax refuses to create the folder for a subset of processes; every process may make it.
        self.dir.mkdir(parents=True, exist_ok=True)
        # cleanup_tmp_directories: a save cut off mid-write (a killed job) leaves <step>.orbax-checkpoint-tmp-*;
        # kept, orbax's later deletion of that step removed the stale folder instead of the step saved again,
        # which then outlived checkpoint.keep. No save of this job is under way yet when the manager opens.
        # max_to_keep None: orbax would delete the oldest step whatever it held; :meth:`rotate` chooses instead.
        opts = ocp.CheckpointManagerOptions(max_to_keep=None, create=False, cleanup_tmp_directories=True,
                                            enable_async_checkpointing=False, multiprocessing_options=processes)
        # The items' handlers are given: orbax's defaults would ignore the processes chosen above.
        self.manager = ocp.CheckpointManager(self.dir, options=opts, item_handlers={
            "state": _state_handler(processes), "meta": ocp.JsonCheckpointHandler(multiprocessing_options=processes)})
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(_DROP_DISK_FULL)  # a filter object is added once however often

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def save(self, step: int, state: Any, meta: dict, finite: bool = True) -> None:
        """Save ``step`` with the digests of its contents in its meta (one commit: the step folder is renamed
        into place with both), then :meth:`rotate`. ``finite``: the step that produced this state updated the
        parameters (not skipped as non-finite)."""
        # Host copies: offloaded optimizer state is numpy already; device arrays are fetched once here, except
        # those spanning other processes, which orbax writes shard by shard from every process.
        host = _to_host(state)
        meta = digest.record(host, {**meta, "finite": bool(finite)})
        need = sum(_bytes_written(x) for x in jax.tree.leaves(host))
        free = free_disk_bytes(self.dir)
        if free is not None and need > free:  # refused before a byte is written: nothing half-saved to clean up
            raise self._disk_full(step, f"its arrays need {size_text(need)} and the disk has {size_text(free)} free")
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(host),
                                                             meta=ocp.args.JsonSave(meta)))
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 (orbax wraps tensorstore's write errors in a bare Exception)
            if not is_disk_full(e):
                raise
            # Other ranks' saves can fill a disk shared with them after the check above. The writes still in
            # flight then call back into orbax's closed event loop, each reported with a traceback.
            _drop_closed_loop_reports()
            for tmp in self.dir.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._disk_full(step, f"the disk filled up while writing its {size_text(need)} "
                                        f"({size_text(free_disk_bytes(self.dir) or 0)} free now)") from None
        self.rotate()

    def _disk_full(self, step: int, why: str) -> DiskFull:
        kept = self.steps()
        return DiskFull(f"cannot save step {step} in {self.dir}: {why}; free some space or set run.dir on a larger "
                        f"disk, then resume ({f'the steps saved before, {kept}, are kept' if kept else 'no step was saved before'})")

    def _finite(self, step: int) -> bool:
        """Whether ``step`` was saved after a finite training step (steps saved before this was recorded: yes)."""
        try:
            return bool(json.loads((self.dir / str(step) / "meta" / "metadata").read_text()).get("finite", True))
        except (OSError, ValueError, AttributeError):
            return False

    def rotate(self) -> list[int]:
        """Delete all but the newest ``keep`` steps and the newest step saved after a finite training step,
        returning the steps deleted. Why the latter: a run whose steps stay non-finite would otherwise rotate
        the last good state away with saves of a state no resume can use."""
        steps = self.steps()
        kept = set(steps[-self.keep:])
        kept.update(next(([s] for s in reversed(steps) if self._finite(s)), []))
        old = [s for s in steps if s not in kept]
        for s in old:
            self.manager.delete(s)
        return old

    def set_aside(self, step: int) -> Path:
        """Move a damaged ``step`` out of the manager's sight, to ``checkpoints/damaged/rank_<r>/<step>`` (kept
        for a look; a resume neither reads nor rotates it, and the run may save that step again)."""
        dest = self.dir.parent / "damaged" / self.dir.name / str(step)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.dir / str(step)), dest)
        self.manager.reload()
        return dest

    def discard_after(self, step: int) -> list[int]:
        """Delete this rank's checkpoints newer than ``step`` (the newest one every rank has), returning
        their steps. Why: a job that died mid-save leaves some ranks a step ahead; kept, that step would
        stay the old run's on those ranks (orbax does not save a step it holds) while the others write the
        resumed run's, and a later resume would load one checkpoint made of two trajectories."""
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            self.manager.delete(s)
        return newer

    def state_metadata(self, step: int) -> Any:
        """The saved state's tree of shapes and dtypes at ``step`` (nothing loaded)."""
        return state_metadata(self.dir / str(step) / "state")

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore ``step`` into arrays shaped like ``like`` (numpy, bit-identical; leaves spanning other
        processes come back as global arrays sharded like ``like``'s). The saved tree is compared with
        ``like`` first: orbax returns a numpy leaf in its saved shape whatever the target's, so another
        model's checkpoint (a run folder without the config.yaml that the layout check reads) failed
        later, in flax. A step that cannot be read, or whose contents differ from the digests saved with it,
        is a :class:`DamagedStep` naming its folder (and the arrays that differ), not in orbax's words."""

        where = self.dir / str(step)

        def unreadable(e: Exception | str) -> DamagedStep:
            # What to do depends on what the rank holds: deleting its only step leaves nothing to resume.
            why, older = " ".join(str(e).split()), [s for s in self.steps() if s < step]
            fix = (f"or delete it to resume from an earlier step (this rank also holds {older})" if older else
                   "or start a new run (this rank holds no earlier step)")
            return DamagedStep(step, f"{where} cannot be read ({why[:240]}{'...' if len(why) > 240 else ''}); if "
                                     f"it is damaged or incomplete, restore the folder from a copy, {fix}")

        try:
            saved = self.state_metadata(step)
        except UnreadableCheckpoint as e:
            raise unreadable(e.reason) from None
        diff = tree_differences(saved, like)
        if diff:
            raise ConfigError(f"{where} holds another model or layout than this run's ({len(diff)} arrays differ: "
                              f"{'; '.join(diff[:3])}{'; ...' if len(diff) > 3 else ''}); resume with the settings "
                              f"that wrote it, or train into another run.dir")
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=_restore_args(jax.tree.map(_abstract, like)), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 (orbax wraps tensorstore's read errors in a bare Exception)
            why = read_error(e)
            if why is None:
                raise
            raise unreadable(why) from None
        bad = digest.mismatches(out["state"], out["meta"])
        if bad:
            raise unreadable(f"its contents differ from the digests saved with it: {'; '.join(bad[:3])}"
                             f"{f'; and {len(bad) - 3} more' if len(bad) > 3 else ''}")
        return out["state"], out["meta"]

    def close(self) -> None:
        """Wait for and close the manager (idempotent: the trainer closes before its stop barrier too)."""
        if not getattr(self, "_closed", False):
            self._closed = True
            self.manager.close()
