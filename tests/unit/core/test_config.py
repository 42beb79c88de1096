"""Config loading, overrides and validation: impossible settings raise ValueError naming the values."""
import dataclasses

import pytest

from jaxhybrid.core.config.parse import parse_overrides
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.model.remat import optimal_checkpoint_interval
from jaxhybrid.runtime.config_checks import validate
from jaxhybrid.runtime.config_load import load_config


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {name: llama-tiny}\ntrain: {steps: 7}\n")
    cfg = load_config(f, ["train.global_batch=32", "parallel.partition=[1,3]", "parallel.pipeline=2",
                          "pipeline.microbatches=2", "optim.offload=true",
                          "optim.bucket_size=1000"])
    assert cfg.model.kind == "llama" and cfg.train.steps == 7 and cfg.train.global_batch == 32
    assert cfg.parallel.partition == (1, 3) and cfg.optim.offload is True
    assert cfg.microbatch_size == 16


def test_parse_overrides_nested():
    assert parse_overrides(["a.b=1", "a.c=x", "d=true"]) == {"a": {"b": 1, "c": "x"}, "d": True}


BAD = [
    (["train.global_batch=10", "parallel.data=3"], ["global_batch=10", "parallel.data(3)"]),
    (["train.global_batch=8", "pipeline.microbatches=3"], ["global_batch=8", "microbatches(3)"]),
    (["parallel.pipeline=9"], ["parallel.pipeline=9", "n_layers=4"]),
    (["parallel.pipeline=2", "pipeline.microbatches=1", "pipeline.schedule=zb-h1"],
     ["pipeline.microbatches=1", "parallel.pipeline=2", "zb-h1"]),
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.schedule=1f1b-2"], ["2 x stages = 4"]),
    (["pipeline.schedule=zigzag"], ["zigzag", "gpipe"]),
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.schedule=zb-h1"],
     ["'zb-h1' always splits", "pipeline.split_backward=true"]),
    # make_schedule reads any case, but the rules (zb-h1's split, myelin's limit) and the planner compared the
    # name as written: ZB-H1 without the split passed, unsplit in the planner's model.
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.schedule=ZB-H1"],
     ["pipeline.schedule='ZB-H1': schedule names are lower case", "use pipeline.schedule=zb-h1"]),
    (["pipeline.weight_join=stack"], ["pipeline.weight_join='stack'", "auto, sum or concat"]),
    (["precision.compute_dtype=int8"], ["int8", "bfloat16"]),
    (["optim.bucket_size=0"], ["bucket_size=0"]),
    (["train.steps=0"], ["train.steps=0"]),
    (["model.n_heads=3"], ["d_model=64", "n_heads=3"]),
    # The tensor engines' own layout rules, on the mesh the config builds, before anything is built.
    (["parallel.tensor_col=3"], ["layer mlp.up: output features n=256 not divisible by col(3)",
                                 "Fits with one axis changed: parallel.tensor_col=2."]),
    (["parallel.tensor_col=2", "model.vocab_size=255"], ["model.vocab_size=255 not divisible by col(2)"]),
    (["parallel.tensor_depth=3"], ["batch of 16 sequences per microbatch is not divisible by data(1) x depth(3)",
                                   "parallel.tensor_depth=2"]),
    (["parallel.pipeline=2", "pipeline.microbatches=8", "parallel.tensor_depth=4"],  # each rank's mesh
     ["batch of 2 sequences per microbatch is not divisible by data(1) x depth(4) = 4", "parallel.tensor_depth=2"]),
    (["train.checkpoint_interval=2"], ["train.checkpoint_interval=2 needs train.remat=full", "'none'"]),
    # Myelin V-A: an explicit ac divides every stage's blocks (N / G_inter), else the stage clamps or ends short.
    (["train.remat=full", "train.checkpoint_interval=3", "parallel.pipeline=2", "pipeline.microbatches=2"],
     ["train.checkpoint_interval=3 does not divide the model.n_layers=4 / parallel.pipeline=2 = 2 blocks per stage",
      "use one of 1, 2, or 0 for Myelin's optimal interval"]),
    (["train.remat=full", "train.checkpoint_interval=3"],
     ["train.checkpoint_interval=3 does not divide the model.n_layers=4 blocks of the one stage", "1, 2, 4"]),
    (["train.remat=full", "train.checkpoint_interval=2", "parallel.pipeline=2", "pipeline.microbatches=2",
      "parallel.partition=[1,3]"], ["stages of [1, 3] blocks (parallel.partition=[1, 3])", "use 1, or 0"]),
    (["train.remat=full", "train.checkpoint_interval=2", "parallel.pipeline=3", "pipeline.microbatches=3",
      "model.n_layers=5", "train.global_batch=18"],
     ["stages of [2, 2, 1] blocks (model.n_layers=5 split over parallel.pipeline=3)"]),
    # Only Myelin's message-driven schedule reads pipeline_limit; the static ones would ignore it.
    (["pipeline.pipeline_limit=2"], ["pipeline.pipeline_limit=2 is read only by pipeline.schedule='myelin'",
                                     "pipeline.schedule='1f1b' runs a fixed order",
                                     "set pipeline.pipeline_limit=0 or pipeline.schedule=myelin"]),
    (["pipeline.pipeline_limit=3", "parallel.pipeline=2", "pipeline.microbatches=4", "pipeline.schedule=gpipe"],
     ["pipeline.pipeline_limit=3 is read only", "pipeline.schedule='gpipe'"]),
    # k sizes the chunks of the all-reduce streamed into the offloaded optimizer (Myelin V-C), nothing else.
    (["optim.allreduce_coarsening=2"], ["optim.allreduce_coarsening=2 sizes the all-reduce chunks",
                                        "without optim.offload=true", "or optim.allreduce_coarsening=1"]),
    # Half-precision all-reduce (Myelin IV-B): only half gradients of the offloaded optimizer, over MPI ranks.
    (["optim.allreduce_dtype=half"], ["optim.allreduce_dtype='half'; choose float32 or compute"]),
    (["optim.allreduce_dtype=compute", "optim.offload=true"],
     ["optim.allreduce_dtype=compute", "optim.offload=True and precision.compute_dtype=float32", "are float32"]),
    (["optim.allreduce_dtype=compute", "precision.compute_dtype=bfloat16"], ["optim.offload=False"]),
    (["optim.allreduce_dtype=compute", "optim.offload=true", "precision.compute_dtype=bfloat16",
      "parallel.tensor_col=2"], ["applies to data replicas that are MPI ranks", "XLA collectives"]),
    # The data column's sum as an XLA collective: over data replicas that are MPI ranks.
    (["optim.allreduce_backend=nccl"], ["optim.allreduce_backend='nccl'; choose mpi (mpi4jax), xla", "or auto"]),
    (["optim.allreduce_backend=xla"], ["with parallel.data=1 there is nothing to reduce"]),
    (["optim.allreduce_backend=xla", "parallel.data=2", "parallel.mesh_data=true"],
     ["tensor mode already reduces over its mesh's data axis", "set optim.allreduce_backend=mpi"]),
    # ZeRO-1: data replicas that are MPI ranks of one device each.
    (["optim.shard_optimizer=true"], ["with parallel.data=1 there is one replica", "parallel.data >= 2"]),
    (["optim.shard_optimizer=true", "parallel.data=2", "parallel.mesh_data=true"],
     ["tensor mode keeps its data axis on one mesh", "set optim.shard_optimizer=false"]),
    (["optim.shard_optimizer=true", "parallel.pipeline=2", "parallel.data=2", "parallel.tensor_row=2",
      "pipeline.microbatches=2"], ["optim.shard_optimizer=true shards one device's flat parameters per rank",
                                   "1 x 2 x 1) is not supported"]),
    (["pipeline.dispatch=eager"], ["pipeline.dispatch='eager'; choose auto, async or sync"]),
    (["pipeline.transport=nccl"], ["pipeline.transport='nccl'; choose mpi4jax, mpi4py or transfer"]),
    (["model.n_kv_heads=-2"], ["model.n_kv_heads=-2 must be >= 0"]),
    # Found when the first attention was traced: in every MPI rank after mpiexec started, aborting the job.
    (["model.attention=cudnn"], ["model.attention=cudnn needs bfloat16/float16 compute and head_dim a multiple "
                                 "of 8 <= 128", "got dtype float32: set precision.compute_dtype=bfloat16, or "
                                 "model.attention=auto"]),
    (["model.attention=cudnn", "precision.compute_dtype=bfloat16", "model.d_model=72", "model.n_heads=6"],
     ["got head_dim 12: set model.attention=auto"]),
    # Both unmet: a 16-bit dtype alone would not do, so it is not offered.
    (["model.attention=cudnn", "model.d_model=72", "model.n_heads=6"],
     ["got dtype float32, head_dim 12: set model.attention=auto"]),
    (["checkpoint.keep=1", "parallel.pipeline=2", "pipeline.microbatches=2"],
     ["checkpoint.keep=1 with 2 ranks", "use keep >= 2"]),
    (["parallel.partition=[1,1]", "parallel.pipeline=2", "pipeline.microbatches=2"], ["partition=[1, 1]"]),
    (["data.seq_len=4096"], ["seq_len=4096", "max_seq_len=128"]),
    (["model.name=gpt-huge"], ["gpt-huge", "gpt2-small"]),
    (["train.nope=1"], ["train.nope"]),
    (["train.steps=abc"], ["train.steps", "abc"]),
    # Read as int(float("1e400")): an OverflowError traceback, not a ConfigError.
    (["train.steps=1e400"], ["train.steps: cannot read '1e400' as int"]),
    # YAML reads 2.5e0 (no exponent sign) as a string, which int(float(...)) truncated to 2 steps.
    (["train.steps=2.5e0"], ["train.steps: cannot read '2.5e0' as int"]),
    (["optim.lr=-1"], ["optim.lr=-1.0 must be in (0, 1)"]),
    (["optim.grad_clip=-2"], ["optim.grad_clip=-2.0 must be >= 0"]),
    # Single-field ranges (jaxhybrid.core.config.ranges.RANGES): key, value and the allowed range.
    (["run.dir="], ["run.dir='' must not be empty"]),
    (["run.dir=' '"], ["run.dir=' ' must not be empty"]),
    (["optim.beta1=1"], ["optim.beta1=1.0 must be in [0, 1)"]),
    (["optim.beta2=-0.1"], ["optim.beta2=-0.1 must be in [0, 1)"]),
    (["optim.eps=0"], ["optim.eps=0.0 must be > 0"]),
    (["optim.eps=nan"], ["optim.eps=nan must be > 0"]),
    (["optim.weight_decay=-0.01"], ["optim.weight_decay=-0.01 must be >= 0"]),
    (["optim.min_lr_ratio=1.5"], ["optim.min_lr_ratio=1.5 must be in [0, 1]"]),
    (["optim.warmup_steps=-1"], ["optim.warmup_steps=-1 must be >= 0"]),
    (["optim.allreduce_coarsening=0"], ["optim.allreduce_coarsening=0 must be >= 1"]),
    (["checkpoint.keep=0"], ["checkpoint.keep=0 must be >= 1"]),
    (["checkpoint.every=-1"], ["checkpoint.every=-1 must be >= 0"]),
    (["train.log_every=0"], ["train.log_every=0 must be >= 1"]),
    (["train.log_every=-1"], ["train.log_every=-1 must be >= 1"]),
    (["train.checkpoint_interval=-2"], ["train.checkpoint_interval=-2 must be >= 0"]),
    (["precision.loss_scale_window=0"], ["precision.loss_scale_window=0 must be >= 1"]),
    (["precision.loss_scale_init=0"], ["precision.loss_scale_init=0.0 must be > 0"]),
    # An infinite scale overflows every step and halving keeps it infinite: the run would skip every update.
    (["precision.loss_scale_init=inf", "precision.compute_dtype=float16"],
     ["precision.loss_scale_init=inf must be > 0 and finite"]),
    (["pipeline.watchdog_s=0"], ["pipeline.watchdog_s=0.0 must be > 0"]),
    (["pipeline.watchdog_s=-5"], ["pipeline.watchdog_s=-5.0 must be > 0"]),
    (["pipeline.pipeline_limit=-3"], ["pipeline.pipeline_limit=-3 must be >= 0"]),
    (["model.norm_eps=0"], ["model.norm_eps=0.0 must be > 0"]),
    # Infinities passed "> 0": weight_decay or init_std inf skipped every step as an overflow, eps inf made every
    # Adam update 0, norm_eps inf zeroed every normalised activation; each trained on without an error.
    (["optim.weight_decay=inf"], ["optim.weight_decay=inf must be >= 0 and finite"]),
    (["optim.eps=inf"], ["optim.eps=inf must be > 0 and finite"]),
    (["model.init_std=inf"], ["model.init_std=inf must be > 0 and finite"]),
    (["model.norm_eps=inf"], ["model.norm_eps=inf must be > 0 and finite"]),
    (["model.rope_theta=inf", "model.name=llama-tiny"], ["model.rope_theta=inf must be > 0 and finite"]),
    # Without a tensor grid too (the tensor engine's own check only runs when it is built).
    (["tensor.optimizations=XYZ"], ["tensor.optimizations='XYZ' has unknown letters ['X', 'Y', 'Z']", "ABCDE"]),
    (["data.val_fraction=1.5"], ["data.val_fraction=1.5 must be in [0, 1)"]),
    # Found by the ranks' data preparation, after mpiexec had started every rank.
    # Virtual stages: the schedule module's rules, and a block for every one of the pipeline x v stages.
    (["pipeline.virtual_stages=0"], ["pipeline.virtual_stages=0 must be >= 1"]),
    (["pipeline.placement=zigzag"], ["pipeline.placement='zigzag'", "choose one of loop, v"]),
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.schedule=zb-v", "pipeline.split_backward=true"],
     ["'zb-v' is the V shape: it needs virtual_stages=2 and placement='v'"]),
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.schedule=zb-v", "pipeline.virtual_stages=2",
      "pipeline.placement=v"], ["pipeline.schedule='zb-v' always splits", "pipeline.split_backward=true"]),
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.virtual_stages=2"],
     ["schedule '1f1b' runs one stage per rank", "use 'interleaved-1f1b'"]),
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.schedule=gpipe", "pipeline.virtual_stages=3"],
     ["parallel.pipeline=2 x pipeline.virtual_stages=3 = 6 stages exceed model.n_layers=4 blocks",
      "use at most 2 virtual stages"]),
    (["parallel.pipeline=2", "pipeline.microbatches=2", "pipeline.schedule=gpipe", "pipeline.virtual_stages=2",
      "parallel.partition=[1,3]"],
     ["parallel.partition=[1, 3] must have parallel.pipeline=2 x pipeline.virtual_stages=2 = 4 (one per stage)"]),
    (["train.remat=full", "train.checkpoint_interval=4", "parallel.pipeline=2", "pipeline.microbatches=2",
      "pipeline.schedule=gpipe", "pipeline.virtual_stages=2", "model.n_layers=8"],
     ["does not divide the model.n_layers=8 / parallel.pipeline=2 x pipeline.virtual_stages=2 = 2 blocks per stage"]),
    (["data.tokenizer=wordpiece"], ["data.tokenizer='wordpiece'; choose byte or bpe"]),
    (["train.seed=-1"], ["train.seed=-1 must be >= 0"]),
    # Steps are logged from 1: 0 (a 0-based guess) or -5 injected nothing, without a word.
    (["train.inject_overflow_step=0"], ["train.inject_overflow_step=0 must be -1 (off) or a step >= 1"]),
    (["train.inject_overflow_step=-5"], ["train.inject_overflow_step=-5 must be -1 (off) or a step >= 1"]),
]


@pytest.mark.parametrize("overrides,needles", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_impossible_settings_name_values(overrides, needles):
    with pytest.raises(ValueError) as e:
        load_config(None, overrides)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_world_size_mismatch():
    from jaxhybrid.runtime.config_checks import validate

    cfg = load_config(None, ["parallel.pipeline=2", "parallel.data=2", "pipeline.microbatches=2"])
    with pytest.raises(ConfigError, match=r"parallel.pipeline\(2\) x parallel.data\(2\) = 4 != world size 8; "
                       r"start 4 ranks \(jaxhybrid launch -n 4\)"):
        validate(cfg, world_size=8)
    with pytest.raises(ConfigError, match=r"= 8 != world size 1; start 8 ranks .*; or parallel.mesh_data=true for "
                                          r"data replicas on this process's devices"):
        validate(load_config(None, ["parallel.data=8"]), world_size=1)
    with pytest.raises(ConfigError, match=r"= 1 != world size 2; run it as one process \(jaxhybrid train, or "
                                          r"jaxhybrid launch -n 1\) or change the grid"):  # not "start 1 ranks"
        validate(load_config(None, []), world_size=2)


def test_malformed_yaml_and_missing_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train: {steps: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed YAML.*line"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_a_range_error_comes_before_the_rules_it_would_break():
    """val_fraction=-0.1 with evaluation on is out of its range, not "a split that holds none"."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.val_fraction=-0.1", "train.eval_every=5"])
    assert str(e.value) == "data.val_fraction=-0.1 must be in [0, 1)"


def test_zero_keeps_its_documented_meanings():
    cfg = load_config(None, ["train.checkpoint_interval=0", "pipeline.pipeline_limit=0", "checkpoint.every=0",
                             "optim.grad_clip=0", "optim.beta1=0", "optim.min_lr_ratio=1", "train.eval_every=0",
                             "data.val_fraction=0", "tensor.optimizations=", "checkpoint.keep=1"])
    assert (cfg.pipeline.pipeline_limit, cfg.tensor.optimizations, cfg.checkpoint.keep) == (0, "", 1)


def test_a_checkpoint_interval_that_divides_every_stage_is_accepted():
    """Any factor of every stage's blocks is a valid ac, the stage's whole count included."""
    for ac, sets in ((2, ["parallel.pipeline=2", "model.n_layers=8"]), (4, ["parallel.pipeline=2", "model.n_layers=8"]),
                     (1, ["parallel.pipeline=3", "model.n_layers=5", "train.global_batch=18"]),
                     (2, ["parallel.pipeline=2", "parallel.partition=[2,4]", "model.n_layers=6"])):
        cfg = load_config(None, ["train.remat=full", f"train.checkpoint_interval={ac}",
                                 f"pipeline.microbatches={sets[0][-1]}", *sets])
        assert cfg.train.checkpoint_interval == ac


def test_half_precision_allreduce_is_accepted_for_an_offloaded_half_pipeline():
    sets = ["optim.allreduce_dtype=compute", "optim.offload=true", "precision.compute_dtype=float16",
            "parallel.pipeline=2", "parallel.data=2", "pipeline.microbatches=2"]
    assert load_config(None, sets).optim.allreduce_dtype == "compute"


def test_xla_allreduce_is_accepted_over_mpi_replicas():
    sets = ["optim.allreduce_backend=xla", "parallel.pipeline=2", "parallel.data=2", "pipeline.microbatches=2",
            "optim.offload=true", "optim.allreduce_dtype=compute", "precision.compute_dtype=bfloat16"]
    assert load_config(None, sets).optim.allreduce_backend == "xla"
    # A hybrid rank's local tensor mesh: its column is one mesh of the replicas' local meshes.
    hybrid = load_config(None, sets[:4] + ["parallel.tensor_col=2"])
    assert (hybrid.optim.allreduce_backend, hybrid.parallel.tensor_col) == ("xla", 2)


@pytest.mark.parametrize("sets, accelerator, backend", [
    (["parallel.pipeline=2", "parallel.data=2"], True, "xla"),  # GPUs: NCCL sums device buffers in place
    (["parallel.pipeline=2", "parallel.data=2"], False, "mpi"),  # CPU: mpich's sum is the faster one
    # A hybrid rank's column of local meshes.
    (["parallel.pipeline=2", "parallel.data=2", "parallel.tensor_col=2"], True, "xla"),
    (["parallel.pipeline=2"], True, "mpi"),  # one replica: nothing to reduce
    (["parallel.data=2", "parallel.mesh_data=true"], True, "mpi"),  # tensor mode reduces on its own mesh
    (["parallel.pipeline=2", "parallel.data=2", "optim.allreduce_backend=mpi"], True, "mpi"),  # as set
    (["parallel.pipeline=2", "parallel.data=2", "optim.allreduce_backend=xla"], False, "xla"),
])
def test_the_allreduce_backend_follows_the_platform_unless_set(sets, accelerator, backend):
    cfg = load_config(None, sets)
    resolved = cfg.on_platform(accelerator)
    assert resolved.optim.allreduce_backend == backend
    validate(resolved)  # what auto chooses is always a valid layout
    assert dataclasses.replace(resolved, optim=cfg.optim) == cfg  # nothing else moved


def test_xla_allreduce_checkpoints_and_resumes():
    """Each rank writes its own checkpoint from its own JAX process (checkpoint.store), so nothing refuses them."""
    sets = ["optim.allreduce_backend=xla", "parallel.data=2", "checkpoint.every=3", "run.resume=true"]
    cfg = load_config(None, sets)
    assert (cfg.optim.allreduce_backend, cfg.checkpoint.every, cfg.run.resume) == ("xla", 3, True)


def test_allreduce_coarsening_is_accepted_with_offload():
    assert load_config(None, ["optim.allreduce_coarsening=2", "optim.offload=true"]).optim.allreduce_coarsening == 2


def test_pipeline_limit_is_accepted_with_the_myelin_schedule():
    cfg = load_config(None, ["pipeline.schedule=myelin", "pipeline.pipeline_limit=3", "parallel.pipeline=2",
                             "pipeline.microbatches=4"])
    assert cfg.pipeline.pipeline_limit == 3


def test_virtual_stages_are_accepted_with_their_schedules():
    cfg = load_config(None, ["pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2", "parallel.pipeline=2",
                             "pipeline.microbatches=2"])
    assert (cfg.pipeline.virtual_stages, cfg.pipeline.placement) == (2, "loop")
    cfg = load_config(None, ["pipeline.schedule=zb-v", "pipeline.virtual_stages=2", "pipeline.placement=v",
                             "pipeline.split_backward=true", "parallel.pipeline=2", "pipeline.microbatches=2",
                             "parallel.partition=[1,1,1,1]"])
    assert cfg.pipeline.placement == "v"


def test_loading_a_config_runs_every_check():
    from jaxhybrid.runtime import config_checks, config_load

    assert config_load.validate is config_checks.validate


def test_wrong_type_section_is_an_error_with_overrides_too(tmp_path):
    """A YAML section that is not a mapping errs alone; a --set into it must not replace it silently."""
    f = tmp_path / "c.yaml"
    f.write_text("train: [1, 2]\n")
    for sets in ([], ["train.steps=3"]):
        with pytest.raises(ConfigError, match=r"train: expected a mapping of keys, got \[1, 2\]"):
            load_config(f, sets)
    # A model preset by name is a section: --set model.x keeps the preset.
    f.write_text("model: llama-tiny\n")
    cfg = load_config(f, ["model.n_layers=2"])
    assert (cfg.model.name, cfg.model.kind, cfg.model.n_layers) == ("llama-tiny", "llama", 2)
    # An include's wrong-type section is not replaced by the including file's mapping either.
    (tmp_path / "base.yaml").write_text("optim: 3\n")
    f.write_text("include: base.yaml\noptim: {lr: 0.01}\n")
    with pytest.raises(ConfigError, match="optim: expected a mapping of keys, got 3"):
        load_config(f)


def test_one_broken_rule_one_message():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.lr=-1"])
    assert str(e.value) == "optim.lr=-1.0 must be in (0, 1)"  # not the other optimizer rules it meets


def test_include_is_read_relative_to_the_including_file(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "common.yaml").write_text("train: {steps: 7}\n")
    job = tmp_path / "job.yaml"
    job.write_text("include: base/common.yaml\ntrain: {global_batch: 32}\n")
    cfg = load_config(job)
    assert (cfg.train.steps, cfg.train.global_batch) == (7, 32)
    job.write_text("include: common.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(job)
    assert str(job) in str(e.value) and "include: common.yaml not found" in str(e.value)
    assert str(tmp_path / "common.yaml") in str(e.value)


def test_a_key_twice_in_one_yaml_mapping_is_a_config_error(tmp_path):
    """PyYAML keeps the last of a repeated key: a second `train:` section dropped the first's keys (steps 3
    became the default 200) without a word."""
    f = tmp_path / "c.yaml"
    f.write_text("train: {steps: 3}\noptim: {lr: 0.01}\ntrain: {global_batch: 8}\n")
    with pytest.raises(ConfigError, match=rf"malformed YAML in {f} \(line 3, column 1\): key 'train' appears twice "
                                          r"in one mapping \(first on line 1\)"):
        load_config(f)
    f.write_text("train: {steps: 3, global_batch: 8, steps: 4}\n")
    with pytest.raises(ConfigError, match=r"key 'steps' appears twice"):
        load_config(f)
    # A merge key's entries may be overridden: that is what it is for.
    f.write_text("train: {<<: {steps: 3, global_batch: 8}, steps: 4}\n")
    assert (load_config(f).train.steps, load_config(f).train.global_batch) == (4, 8)


def test_include_cycle_and_a_non_file_include_are_config_errors(tmp_path):
    """A file that includes itself, directly or through another, recursed until a RecursionError; an include
    that is not one file name (a list, a number) failed in Path / value with a TypeError."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match=rf"{a}: include: a.yaml includes {a} again \({a} -> {a}\)"):
        load_config(a)
    a.write_text("include: b.yaml\n")
    b.write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match=rf"include: a.yaml includes {a} again \({a} -> {b} -> {a}\)"):
        load_config(a)
    for value in ("[b.yaml]", "5"):
        a.write_text(f"include: {value}\n")
        with pytest.raises(ConfigError, match=rf"{a}: include: .* must be one file name"):
            load_config(a)


def test_optimal_checkpoint_interval():
    # Myelin V-A: the factor of N / G_inter closest to sqrt(N). N=48, G=4: factors of 12, sqrt(48)=6.93 -> 6.
    assert optimal_checkpoint_interval(48, 4) == 6
    assert optimal_checkpoint_interval(16, 1) == 4
    assert optimal_checkpoint_interval(96, 24) == 4


def test_tensor_mode_data_axis_is_a_mesh_axis():
    from jaxhybrid.runtime.config_checks import validate

    cfg = load_config(None, ["parallel.data=2", "parallel.tensor_col=2", "parallel.tensor_row=2"])
    assert cfg.world_size == 1
    validate(cfg, world_size=1)
    # Hybrid: pipeline stages and data replicas are MPI ranks, each with a local tensor mesh.
    hybrid = load_config(None, ["parallel.pipeline=2", "parallel.data=2", "pipeline.microbatches=2",
                                "parallel.tensor_col=2"])
    assert (hybrid.world_size, hybrid.num_devices) == (4, 8)
    # Data parallelism alone: MPI ranks by default (Myelin), one process's mesh with parallel.mesh_data.
    assert load_config(None, ["parallel.data=8"]).world_size == 8
    mesh = load_config(None, ["parallel.data=8", "parallel.mesh_data=true"])
    assert (mesh.on_mesh, mesh.world_size, mesh.num_devices) == (True, 1, 8)
    with pytest.raises(ConfigError, match=r"parallel.mesh_data=true with parallel.pipeline=2: a pipeline's data "
                                          r"replicas are MPI ranks"):
        load_config(None, ["parallel.data=2", "parallel.pipeline=2", "pipeline.microbatches=2",
                           "parallel.mesh_data=true"])


def test_plan_file_sits_between_yaml_and_command_line(tmp_path):
    import json

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"config": {"parallel": {"pipeline": 2, "data": 1, "partition": [1, 3]},
                                           "pipeline": {"schedule": "gpipe", "microbatches": 4,
                                                        "split_backward": True},
                                           "optim": {"offload": False}, "train": {"global_batch": 8}}}))
    f = tmp_path / "c.yaml"
    f.write_text("train: {steps: 3, global_batch: 64}\npipeline: {schedule: 1f1b}\n")
    cfg = load_config(f, [f"plan.file={plan}", "pipeline.microbatches=8"])
    assert (cfg.parallel.pipeline, cfg.parallel.partition, cfg.pipeline.schedule) == (2, (1, 3), "gpipe")
    assert cfg.train.global_batch == 8 and cfg.train.steps == 3 and cfg.pipeline.microbatches == 8


def test_plan_for_another_model_is_refused(tmp_path):
    import json

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "gpt-tiny", "config": {
        "parallel": {"pipeline": 1, "data": 1}, "pipeline": {"microbatches": 1}, "optim": {"offload": False}}}))
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name=llama-tiny", f"plan.file={plan}"])
    assert f"plan.file={plan} was made for model 'gpt-tiny'" in str(e.value)
    assert "model.name='llama-tiny'" in str(e.value)
    assert load_config(None, ["model.name=gpt-tiny", f"plan.file={plan}"]).model.name == "gpt-tiny"


def test_plan_for_other_sizes_of_the_same_preset_is_refused(tmp_path):
    """A plan carries its model's sizes: `jaxhybrid plan --model wide.yaml` (gpt-tiny at d_model 128, 8 blocks)
    was taken by a stock gpt-tiny run, which failed on the plan's partition without naming the plan, and a
    stock plan by a gpt-tiny run at d_model 32 was applied without a word (its memory and partition were
    modelled for the other widths)."""
    import json

    from jaxhybrid.cli.main import main

    wide = tmp_path / "wide.yaml"
    wide.write_text("model: {name: gpt-tiny, d_model: 128, n_layers: 8, d_ff: 512}\ndata: {seq_len: 64}\n")
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", str(wide), "--gpus", "2", "--gpus-per-node", "2", "--hardware", "h100-node",
                 "--top", "1", "--out", str(plan)]) == 0
    assert json.loads(plan.read_text())["model_config"]["d_model"] == 128
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"plan.file={plan}"])
    assert str(e.value).startswith(f"plan.file={plan} was made for another size of model 'gpt-tiny': model.d_model "
                                   f"128 there, 64 here; model.n_layers 8 there, 4 here; model.d_ff 512 there, 256 here")
    cfg = load_config(wide, [f"plan.file={plan}", "model.rope_theta=500000"])  # sizes alike: taken
    assert cfg.model.d_model == 128 and cfg.parallel.pipeline == json.loads(plan.read_text())["plan"]["pipeline"]


def test_an_error_on_a_value_the_plan_set_names_the_plan(tmp_path):
    """A plan sets remat, dtype, batch and layout over the YAML file: a rule broken by a plan's value named
    only the value (``got train.remat='none'`` for a config that says ``remat: full``), not where it came
    from; ``train`` prints the plan's settings only once the config has passed."""
    import json

    from jaxhybrid.runtime.config_checks import validate

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"config": {"parallel": {"pipeline": 2, "data": 1}, "pipeline": {"microbatches": 2},
                                           "optim": {"offload": False}, "train": {"remat": "none"}}}))
    f = tmp_path / "c.yaml"
    f.write_text("train: {remat: full, checkpoint_interval: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, [f"plan.file={plan}"])
    assert str(e.value) == (f"train.checkpoint_interval=2 needs train.remat=full (Myelin's ac: blocks per "
                            f"recomputed segment); got train.remat='none' (plan.file={plan} set train.remat=none)")
    cfg = load_config(None, [f"plan.file={plan}"])
    with pytest.raises(ConfigError, match=r"!= world size 4; .* \(plan.file=.* set parallel.pipeline=2, "
                                          r"parallel.data=1\)$"):
        validate(cfg, world_size=4)
    with pytest.raises(ConfigError) as e:  # a value the command line set over the plan's is not the plan's
        load_config(f, [f"plan.file={plan}", "train.remat=dots"])
    assert "plan.file" not in str(e.value)
