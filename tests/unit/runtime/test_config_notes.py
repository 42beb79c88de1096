"""A run names the settings it sets but does not read (jaxhybrid.runtime.config_notes): a one-process run, whose
single-device engine or tensor mesh has no schedule, 2BP split, dispatch, transport, watchdog or trace, the
pipeline engine's (metrics.trace=true wrote no trace, zb-h1 did not split, without a word);
pipeline.weight_join without pipeline.split_backward; the data all-reduce's settings without MPI replicas."""
import pytest

from jaxhybrid.cli.main import main
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.config_notes import unread_settings_notes

FAST = ["model.name=gpt-tiny", "model.n_layers=2", "data.seq_len=32", "train.global_batch=4", "train.steps=1",
        "metrics.progress=false", "metrics.tensorboard=false", "metrics.plot=false"]


@pytest.mark.slow
def test_train_notes_the_pipeline_settings_a_single_device_run_ignores(tmp_path, capsys):
    sets = FAST + [f"run.dir={tmp_path / 'run'}", "metrics.trace=true", "pipeline.schedule=zb-h1",
                   "pipeline.split_backward=true"]
    assert main(["train"] + [a for kv in sets for a in ("--set", kv)]) == 0
    err = capsys.readouterr().err
    assert ("jaxhybrid: note: pipeline.schedule=zb-h1, pipeline.split_backward=True, metrics.trace=True not used: "
            "only the MPI pipeline engine reads them (parallel.pipeline > 1, or parallel.data > 1 as MPI ranks); "
            "this run has no such ranks: it runs on the single-device engine") in err
    assert not (tmp_path / "run" / "trace.json").exists()  # what the note is for


HALF_OFFLOAD = ["optim.offload=true", "precision.compute_dtype=bfloat16", "optim.allreduce_dtype=compute",
                "optim.allreduce_coarsening=2"]


@pytest.mark.parametrize("sets,expected", [
    ([], None),  # defaults: nothing set
    (["pipeline.schedule=1f1b", "pipeline.dispatch=auto"], None),  # the defaults, written out
    (["pipeline.dispatch=sync", "pipeline.watchdog_s=60"], "pipeline.dispatch=sync, pipeline.watchdog_s=60.0 not used"),
    (["parallel.data=2", "parallel.mesh_data=true", "pipeline.weight_join=concat"], "on one tensor mesh"),
    (["parallel.tensor_col=2", "metrics.trace=true"], "metrics.trace=True not used"),
    # MPI ranks: the pipeline engine reads them, one stage of data replicas included.
    (["parallel.pipeline=2", "pipeline.microbatches=2", "metrics.trace=true", "pipeline.dispatch=sync"], None),
    (["parallel.data=2", "metrics.trace=true"], None),
    # weight_join joins 2BP's deferred weight passes: without the split there are none to join.
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.weight_join=concat"],
     "pipeline.weight_join=concat not used: it joins the weight passes that 2BP defers, and "
     "pipeline.split_backward=False runs none; set pipeline.split_backward=true or leave weight_join out"),
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.weight_join=sum", "pipeline.split_backward=true"],
     None),
    # The MPI data replicas' all-reduce settings, where there are none (Trainer.overlap_note says where
    # replicas do not stream).
    (HALF_OFFLOAD, "optim.allreduce_coarsening=2, optim.allreduce_dtype=compute not used: they shape the "
                   "all-reduce over data replicas that are MPI ranks, and this run has none (parallel.data=1)"),
    (HALF_OFFLOAD + ["parallel.pipeline=2", "pipeline.microbatches=2", "optim.stream_allreduce=false"],
     "optim.allreduce_coarsening=2, optim.stream_allreduce=False, optim.allreduce_dtype=compute not used"),
    (HALF_OFFLOAD + ["parallel.pipeline=2", "pipeline.microbatches=2", "parallel.data=2"], None),
    # Settings of a feature the run has off.
    (["precision.loss_scale_init=1024", "precision.loss_scale_window=50"],
     "precision.loss_scale_init=1024.0, precision.loss_scale_window=50 not used: loss scaling is static here "
     "(precision.compute_dtype=float32, dynamic_loss_scale=None); set precision.dynamic_loss_scale=true to scale"),
    (["precision.loss_scale_init=1024", "precision.compute_dtype=float16"], None),
    (["precision.loss_scale_init=1024", "precision.compute_dtype=bfloat16", "precision.dynamic_loss_scale=true"],
     None),
    (["train.eval_batches=8"], "train.eval_batches=8 not used: train.eval_every=0 runs no evaluation"),
    (["train.eval_batches=8", "train.eval_every=10"], None),
    (["tensor.optimizations=BCDE"], "tensor.optimizations=BCDE not used: AxoNN's optimizations act on tensor "
                                    "axes, and parallel.tensor_col x tensor_row x tensor_depth = 1"),
    (["tensor.optimizations=BCDE", "parallel.tensor_col=2"], None),
    (["model.rope_theta=500000"], "model.rope_theta=500000.0 not used: model.kind=gpt2 has learned positions"),
    (["model.name=llama-tiny", "model.rope_theta=500000"], None),
])
def test_note_names_only_settings_the_engine_does_not_read(sets, expected):
    notes = unread_settings_notes(load_config(None, sets))
    assert notes == [] if expected is None else any(expected in n for n in notes), notes
