"""A plan run's ``config.yaml`` trains as it is written. It kept ``plan.file``, so ``--config
run/config.yaml`` applied the plan again over the file's own values: an edit of the file
(``pipeline.microbatches: 16`` -> 8) was undone without a word, and the file needed the plan, as it is now,
to train at all (a moved plan: "plan file not found"; a rewritten one: another layout)."""
import dataclasses
import json

from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.run_dir import write_run_config


def _plan(path, microbatches: int):
    path.write_text(json.dumps({"model": "gpt-tiny", "config": {
        "parallel": {"pipeline": 2, "data": 1, "partition": [1, 3]},
        "pipeline": {"schedule": "gpipe", "microbatches": microbatches, "split_backward": True},
        "optim": {"offload": False}, "train": {"global_batch": 16}}}))


def test_config_yaml_of_a_plan_run_trains_as_written(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    _plan(plan, 16)
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, [f"run.dir={run}", "model.name=gpt-tiny", f"plan.file={plan}"])
    write_run_config(run, cfg, 0)
    saved = run / "config.yaml"
    assert f"plan file {plan}" in saved.read_text()  # where the layout came from, as a comment
    again = load_config(saved)
    assert (again.parallel.partition, again.pipeline.schedule, again.pipeline.microbatches) == ((1, 3), "gpipe", 16)
    saved.write_text(saved.read_text().replace("microbatches: 16", "microbatches: 8"))
    assert load_config(saved).pipeline.microbatches == 8  # the edit holds
    plan.unlink()
    assert load_config(saved).parallel.pipeline == 2  # the plan is not needed any more

    # The command that started the run continues it: no plan.file "change" on resume.
    _plan(plan, 16)
    resumed = load_config(None, [f"run.dir={run}", "model.name=gpt-tiny", f"plan.file={plan}", "run.resume=true"])
    write_run_config(run, dataclasses.replace(resumed, run=dataclasses.replace(resumed.run, resume=True)), 3)
    err = capsys.readouterr().err
    assert "pipeline.microbatches: 8 -> 16" in err and "plan.file" not in err  # only the edit is named
