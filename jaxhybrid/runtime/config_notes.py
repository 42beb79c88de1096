"""Settings a run sets but does not read, named in a note when the run starts (:data:`RULES`).

The pipeline section and ``metrics.trace`` belong to the MPI pipeline engine (``jaxhybrid.runtime.engines.build``: a run of
more than one rank). A one-process run (the single-device engine, or one tensor mesh) has no schedule,
event loop, transport or watchdog, so it would drop them without a word: ``pipeline.split_backward=true``
would not split the backward and ``metrics.trace=true`` would write no trace. They are not config errors,
because a run config and a plan file set them for the layouts that read them, and a one-process override
of the layout (``--set parallel.pipeline=1``) should not have to reset them too. Likewise the settings of
a feature the run has off: ``pipeline.weight_join`` without 2BP's split (a plan may turn it off), the data
all-reduce's without MPI data replicas, the dynamic loss scale's, evaluation's, the tensor axes', RoPE's.
"""
from __future__ import annotations

from jaxhybrid.core.config.parse import lookup
from jaxhybrid.core.config.schema import Config

PIPELINE_ENGINE_KEYS = ("pipeline.schedule", "pipeline.split_backward", "pipeline.pipeline_limit",
                        "pipeline.virtual_stages", "pipeline.placement", "pipeline.stage_to_rank", "pipeline.pattern",
                        "pipeline.transport", "pipeline.dispatch", "pipeline.weight_join", "pipeline.watchdog_s",
                        "pipeline.watchdog_compile_s", "metrics.trace")
# Myelin's all-reduce of the gradients over data replicas that are MPI ranks (IV-B, V-C); where they stream
# and where not is Trainer.overlap_note's.
REPLICA_KEYS = ("optim.allreduce_coarsening", "optim.stream_allreduce", "optim.allreduce_dtype")


def _one_process(c: Config) -> str:
    # One tensor mesh may span several processes (--distributed): still no pipeline engine.
    engine = "one tensor mesh" if c.on_mesh else "the single-device engine"
    return (f"only the MPI pipeline engine reads them (parallel.pipeline > 1, or parallel.data > 1 as MPI ranks); "
            f"this run has no such ranks: it runs on {engine}")


def _no_replicas(c: Config) -> str:
    mesh = " on one tensor mesh, reduced by XLA's collectives" if c.on_mesh else ""
    return (f"they shape the all-reduce over data replicas that are MPI ranks, and this run has none "
            f"(parallel.data={c.parallel.data}{mesh})")


def _static_scale(c: Config) -> bool:
    from jaxhybrid.optim.loss_scale import from_config

    return not from_config(c.precision).dynamic


# (keys, whether this run leaves them unread, why): one note per row, naming those of its keys that the run
# sets to other than their defaults (a default cannot be told from a key left out).
RULES = (
    (PIPELINE_ENGINE_KEYS, lambda c: c.world_size == 1, _one_process),
    # 2BP's deferred weight passes are what it joins (a one-process run's note above names it).
    (("pipeline.weight_join",), lambda c: c.world_size > 1 and not c.pipeline.split_backward,
     lambda c: f"it joins the weight passes that 2BP defers, and pipeline.split_backward="
               f"{c.pipeline.split_backward} runs none; set pipeline.split_backward=true or leave weight_join out"),
    (REPLICA_KEYS, lambda c: not (c.world_size > 1 and c.parallel.data > 1), _no_replicas),
    (("precision.loss_scale_init", "precision.loss_scale_window"), _static_scale,
     lambda c: f"loss scaling is static here (precision.compute_dtype={c.precision.compute_dtype}, "
               f"dynamic_loss_scale={c.precision.dynamic_loss_scale}); set precision.dynamic_loss_scale=true to scale"),
    (("train.eval_batches",), lambda c: not c.train.eval_every, lambda c: "train.eval_every=0 runs no evaluation"),
    (("tensor.optimizations",), lambda c: c.tensor_size == 1,
     lambda c: "AxoNN's optimizations act on tensor axes, and parallel.tensor_col x tensor_row x tensor_depth = 1"),
    (("model.rope_theta",), lambda c: c.model.kind == "gpt2",
     lambda c: "model.kind=gpt2 has learned positions (RoPE is llama's)"),
)


def unread_settings_notes(cfg: Config) -> list[str]:
    """One line per row of :data:`RULES` whose keys this run sets but does not read."""
    default = Config()
    notes = []
    for keys, unread, why in RULES:
        changed = [f"{k}={lookup(cfg, k)}" for k in keys if lookup(cfg, k) != lookup(default, k)]
        if changed and unread(cfg):
            notes.append(f"{', '.join(changed)} not used: {why(cfg)}")
    return notes
