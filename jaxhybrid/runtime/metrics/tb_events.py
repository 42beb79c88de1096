"""TensorBoard scalars written without tensorboardX's background writer: :class:`EventFile` and the tag
:func:`tb_tag` gives each ``metrics.jsonl`` key (see :mod:`jaxhybrid.runtime.metrics.writer`)."""
from __future__ import annotations

import itertools
import socket
import struct
import time
from pathlib import Path


def tb_tag(key: str) -> str:
    """The TensorBoard tag of a ``metrics.jsonl`` key (module docstring)."""
    for prefix in ("val_", "eval_"):
        if key.startswith(prefix):
            return f"val/{key[len(prefix):]}"
    return f"train/{key}"


EVENTS_PREFIX = "events.out.tfevents."  # TensorBoard finds event files by this prefix


class EventFile:
    """A TensorBoard event file written in the caller's thread: a step's scalars are one record of the file
    when :meth:`scalars` returns, and :meth:`flush` hands them to the OS (as ``metrics.jsonl``'s flush; no
    fsync). Why not tensorboardX's ``SummaryWriter``: it queues events for a background thread that
    flushes every 120 s, so a killed run lost its last steps, and even a ``flush()`` after each
    ``add_scalar`` misses events still in the queue (the newest step, in a kill test). Records are
    TFRecord-framed ``Event`` protos (tensorboardX's protos and checksum).

    Args:
      logdir: the folder (created); the file is ``events.out.tfevents.<time>.<host>[.n]``, never an
        existing one.
      purge_step: on a resumed run, TensorBoard hides the events of this step and later ones that an
        earlier file holds (SummaryWriter's ``purge_step``: a session-start event at that step).
    """

    def __init__(self, logdir: str | Path, purge_step: int | None = None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        base = f"{EVENTS_PREFIX}{int(time.time())}.{socket.gethostname()}"
        for n in itertools.count():
            self.path = logdir / (f"{base}.{n}" if n else base)
            try:
                self._f = open(self.path, "xb")
                break
            except FileExistsError:
                continue
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._write(Event(wall_time=time.time(), step=int(purge_step),
                              session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event of ``step`` holding every ``tag -> value`` of ``values``."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()])
        self._write(Event(wall_time=time.time(), step=int(step), summary=summary))

    def _write(self, event) -> None:
        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", masked_crc32c(header)) + data +
                      struct.pack("<I", masked_crc32c(data)))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()
