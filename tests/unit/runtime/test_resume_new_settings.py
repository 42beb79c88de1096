"""A resume of a run whose config.yaml predates a setting names that setting: the earlier steps ran by the
old behaviour (before optim.weight_decay_mask every parameter decayed), and the loaded config fills in
today's default, so comparing loaded configs found no change and the resume switched silently."""
import dataclasses

from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.run_dir import write_run_config


def _resume(run, cfg, capsys):
    write_run_config(run, dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True)), 3)
    return capsys.readouterr().err


def test_a_setting_missing_from_the_earlier_config_is_named(tmp_path, capsys):
    cfg = load_config(None, [f"run.dir={tmp_path}", "model.name=gpt-tiny"])
    write_run_config(tmp_path, cfg, 0)
    assert _resume(tmp_path, cfg, capsys) == ""  # a config.yaml of this version: nothing to say
    saved = tmp_path / "config.yaml"
    saved.write_text("".join(l for l in saved.read_text().splitlines(keepends=True)
                             if "weight_decay_mask" not in l))  # as written before the setting existed
    err = _resume(tmp_path, cfg, capsys)
    assert "optim.weight_decay_mask: not in the earlier config.yaml" in err and "-> matrices" in err
    assert (tmp_path / "config.step3.yaml").is_file() and "weight_decay_mask" in saved.read_text()
