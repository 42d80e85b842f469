"""`t5lite-train --dry_run`: the console script's command on the tiny and the
headline config (in this process, and as a real process on 8 fake devices),
its schedule against the loop's rules, and its memory estimate."""

import dataclasses
import io
import math
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cli import BIN, SHALLOW, TINY, launch_cache, run_in_process, user_error_line

import gin
from t5lite import checkpoints as ckpt_lib
from t5lite import cli, dry_run, report, state_init, testing
from t5lite import metrics as metrics_lib
from t5lite import train as train_lib
from t5lite.data import datasets
from t5lite.periods import compute_periods
from t5lite.run_config import RunConfig


MOE = ["--gin_file=gin/pretrain_moe.gin"]


def run_cli(args, cwd, script="t5lite-train", env=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             **(env or {}))
  return subprocess.run([os.path.join(BIN, script), *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def train_arguments(args):
  """What gin hands train() for these command-line gin flags, parsed in-process."""
  files = [a.split("=", 1)[1] for a in args if a.startswith("--gin_file=")]
  bindings = [a[len("--gin."):].replace("=", " = ", 1) for a in args if a.startswith("--gin.")]
  cli.parse_gin(files, bindings, cli.gin_search_paths([]))
  return gin.get_bindings(train_lib.train)


def expected_counts(args):
  """Parameter counts from jax.eval_shape of the model's own initialisation."""
  kwargs = train_arguments(args)
  model, cfg = kwargs["model"], kwargs["train_dataset_cfg"]
  shapes, types = model.input_shapes_and_types(cfg.task_feature_lengths, cfg.pack)
  params = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.key(0), shapes, types))["params"]
  counts = {name: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(sub))
            for name, sub in params.items()}
  return sum(counts.values()), counts, len(jax.tree.leaves(params))


def printed_counts(stdout):
  total = int(re.search(r"^Parameters: ([\d,]+) total$", stdout, re.M).group(1).replace(",", ""))
  block = stdout.split("Parameters:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
  modules = dict(re.fullmatch(r"  (\S+)\s+([\d,]+)", line).groups() for line in block
                 if not line.strip().startswith("of which"))
  return total, {k: int(v.replace(",", "")) for k, v in modules.items()}


def section(stdout, title):
  return stdout.split(f"\n{title}:\n", 1)[1].split("\n\n", 1)[0]


def schedule_line(stdout, key):
  return re.search(rf"^  {key}\s+(.*)$", section(stdout, "Schedule"), re.M).group(1)


def table_rows(stdout):
  """(name, shape, mesh axes) of each row of the partitioning table."""
  lines = section(stdout, "Partitioning").splitlines()[1:]
  rows = []
  for line in lines:
    name, shape, _, mesh = re.fullmatch(r"  (\S+)\s+(\([\d, ]*\))\s+(\(.*?\))\s+(\(.*?\))",
                                        line).groups()
    rows.append((name, tuple(int(d) for d in re.findall(r"\d+", shape)),
                 [a.split("+") for a in mesh.strip("()").split(", ")]))
  return rows


# The dry runs of the tiny and the MoE headline run in this process (what
# they print is what is checked; a process would add ~5 CPU-s of imports);
# the one on 8 fake devices needs a process of its own.
def test_dry_run_tiny_writes_nothing_and_prints_the_run(tmp_path, clean_gin, monkeypatch):
  before = sorted(os.listdir(tmp_path))
  out = run_in_process([*TINY, "--dry_run", "--gin.MODEL_DIR='runs/new/tiny'"], str(tmp_path),
                       monkeypatch)
  assert sorted(os.listdir(tmp_path)) == before  # MODEL_DIR not even created
  total, modules = printed_counts(out)
  assert (total, modules, len(table_rows(out))) == expected_counts([*TINY, "--gin.MODEL_DIR='x'"])
  assert schedule_line(out, "steps").startswith("0 -> 4 (fresh start); 2 steps per epoch")
  assert schedule_line(out, "checkpoints") == "2, 4; kept at the end: 2, 4"  # keep 3
  assert schedule_line(out, "evaluation") == "2, 4 (train-eval)"
  assert "global 4 = 4 per host x 1 host(s); 4 per device" in out


def test_dry_run_pretrain_moe(tmp_path, clean_gin, monkeypatch):
  out = run_in_process([*MOE, "--dry_run", "--gin.MODEL_DIR='moe'"], str(tmp_path), monkeypatch)
  assert not os.path.exists(tmp_path / "moe")
  total, modules = printed_counts(out)
  rows = table_rows(out)
  assert (total, modules, len(rows)) == expected_counts([*MOE, "--gin.MODEL_DIR='x'"])
  assert sum(math.prod(shape) for _, shape, _ in rows) == total
  experts = [r for r in rows if r[0].endswith(("moe/wi_0", "moe/wi_1", "moe/wo"))]
  assert len(experts) == 12 and all(mesh[0] == ["expert"] for _, _, mesh in experts)
  expert_total = sum(math.prod(shape) for _, shape, _ in experts)
  # top-2 of 8 experts: a token passes through a quarter of the expert weights.
  assert f"of which experts {expert_total:,}; active per token " \
         f"{total - expert_total + expert_total // 4:,}" in out
  assert f"parameters    {dry_run.format_bytes(4 * total):>10}" in out  # float32, one device
  assert schedule_line(out, "checkpoints") == ("200, 400, 600, 800, 1000; "
                                               "kept at the end: 600, 800, 1000")
  assert schedule_line(out, "evaluation") == "200, 400, 600, 800, 1000 (train-eval)"
  assert schedule_line(out, "ends at") == "step 1000"
  assert "t5lite_span_corruption (train, packed, shuffled), lengths inputs 128, targets 32" in out


@pytest.mark.slow  # real processes
def test_dry_run_fsdp_over_8_devices_divides_the_parameters(tmp_path):
  args = [*TINY, "--gin_file=gin/partitioning/fsdp.gin", "--gin.BATCH_SIZE=16", "--dry_run",
          "--gin.MODEL_DIR='run'"]
  env = {"XLA_FLAGS": testing.fake_device_flags(8)}
  result = run_cli(args, cwd=str(tmp_path), env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "Mesh: data=1 fsdp=8 expert=1 seq=1 model=1 over 8 x cpu" in out
  assert "global 16 = 16 per host x 1 host(s); 2 per device x 8 data-parallel" in out
  sizes = {"data": 1, "fsdp": 8, "expert": 1, "seq": 1, "model": 1}
  per_device = 0
  for _, shape, mesh in table_rows(out):
    parts = [math.prod(sizes[a] for a in axes if a != "-") for axes in mesh]
    per_device += math.prod(d // p for d, p in zip(shape, parts))
  assert any(mesh[-1] == ["fsdp"] or mesh[0] == ["fsdp"] for _, _, mesh in table_rows(out))
  assert f"parameters    {dry_run.format_bytes(4 * per_device):>10}" in out


def test_dry_run_stops_on_what_training_stops_on(tmp_path, monkeypatch):
  bad = [*TINY, "--gin.EVAL_PERIOD=3", "--gin.MODEL_DIR='run'"]
  line = user_error_line([*bad, "--dry_run"], str(tmp_path), monkeypatch)
  assert line == user_error_line(bad, str(tmp_path), monkeypatch)
  assert "eval_period=3 is not a multiple of checkpoint_period=2" in line
  assert not os.path.exists(tmp_path / "run")
  refused = user_error_line([*TINY, "--dry_run"], str(tmp_path), monkeypatch,
                            script="t5lite-eval")
  assert "--dry_run is a t5lite-train flag" in refused


@pytest.mark.parametrize("binding, message", [
    ("peak_flops_per_device=0.0", "peak_flops_per_device must be a positive FLOP/s figure"),
    ("loss_spike_factor=0.5", "loss_spike_factor=0.5 must be a number above 1"),
])
def test_dry_run_shares_train_checks_in_process(tmp_path, clean_gin, binding, message):
  # train() and the dry run start from the same checked setup: a setting
  # train() refuses before any work, the dry run refuses with the same line.
  kwargs = train_arguments([*TINY, f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                            f"--gin.train_lib.train.{binding}"])
  with pytest.raises(ValueError, match=message):
    dry_run.run(out=io.StringIO(), **kwargs)
  with pytest.raises(ValueError, match=message):
    train_lib.train(**kwargs)
  assert not os.path.exists(tmp_path / "run")


# ---------------------------------------------------------------------------
# The schedule, in-process, against the loop's rules


def planned_schedule(model_dir, *, total, ckpt=2, eval_=2, keep=None, every=None, extra=(),
                     relative=None, at_start=False, restore=None, resume_step=None):
  """The dry run's schedule for these settings, in-process."""
  save = ckpt_lib.SaveCheckpointConfig(period=ckpt, keep=keep, keep_every_n_steps=every,
                                       checkpoint_steps=extra)
  periods = compute_periods(total_steps=total, eval_period=eval_,
                                      checkpoint_period=ckpt, gc_period=0, stats_period=None,
                                      checkpoint_steps=extra)
  settings = {f.name: None for f in dataclasses.fields(RunConfig)}
  settings.update(model_dir=str(model_dir), total_steps=total, relative_steps=relative,
                  checkpoint_cfg=ckpt_lib.CheckpointConfig(save=save, restore=restore),
                  train_eval_dataset_cfg="<train-eval data>", run_eval_before_training=at_start,
                  resume_step=resume_step)
  return dry_run.schedule(RunConfig(**settings), periods)


def test_dry_run_and_run_agree_on_end_step_devices_and_parameters(tmp_path, clean_gin,
                                                                  monkeypatch):
  # The dry run's schedule ends where train() ends, fresh, with relative_steps
  # and with resume_step; it prints the devices and the parameter count the
  # run's banner and model-info.txt print. The three runs compile through the
  # test's compilation cache, as launches would (the same programs, once);
  # none of it depends on depth.
  lines = []
  monkeypatch.setattr(metrics_lib, "log_line", lambda line, *a, **k: lines.append(line))
  base = [*TINY, f"--gin.MODEL_DIR='{tmp_path}'", "--gin.EVAL_PERIOD=0",
          *SHALLOW]
  for extra, want in ((["--gin.TRAIN_STEPS=2"], 2),
                      (["--gin.TRAIN_STEPS=2", "--gin.train_lib.train.relative_steps=1"], 3),
                      (["--gin.TRAIN_STEPS=4", "--gin.train_lib.train.resume_step=2"], 4)):
    gin.clear_config(clear_constants=True)
    kwargs = train_arguments(base + extra)
    out = io.StringIO()
    planned = dry_run.run(out=out, **kwargs)
    lines.clear()
    with launch_cache():
      end, _ = train_lib.train(**kwargs)
    assert planned.schedule.end == end == want, extra
    banner = next(line for line in lines if line.startswith("t5lite: training"))
    assert f"  devices: {report.devices()}; mesh:" in banner
    assert f" over {report.devices()}\n" in out.getvalue()
    assert f"({planned.param_count / 1e6:.2f}M parameters," in banner
  with open(tmp_path / "model-info.txt") as f:
    assert f"Total number of parameters: {planned.param_count}\n" in f.read()


def test_schedule_fresh_run_with_extra_steps_and_keep_rules(tmp_path):
  s = planned_schedule(tmp_path / "none", total=10, ckpt=4, eval_=4, keep=2, every=8, extra=(3,),
                at_start=True)
  assert (s.start, s.end, s.epoch) == (0, 10, 4)
  assert s.checkpoints == (3, 4, 8, 10)   # period, the extra step, the last step
  assert s.evaluations == (0, 4, 8, 10)   # before training, period, last step
  assert s.kept == (8, 10)                # newest 2; 8 is also a keep_every_n multiple
  assert not os.path.exists(tmp_path / "none")


def test_schedule_resumes_from_model_dir_then_restore_path(tmp_path):
  for step in (2, 4):
    os.makedirs(tmp_path / "run" / "checkpoints" / str(step))
  s = planned_schedule(tmp_path / "run", total=10, keep=3, relative=3)
  assert (s.start, s.end) == (4, 7) and "resumes from checkpoint 4" in s.start_from
  assert s.checkpoints == (6, 7) and s.kept == (4, 6, 7)
  params_only = ckpt_lib.RestoreCheckpointConfig(path=str(tmp_path / "run" / "checkpoints" / "4"),
                                                 mode="specific", params_only=True)
  s = planned_schedule(tmp_path / "fresh", total=4, restore=params_only)
  assert s.start == 0 and s.start_from.startswith("parameters from")
  full = ckpt_lib.RestoreCheckpointConfig(path=str(tmp_path / "run"), mode="latest")
  s = planned_schedule(tmp_path / "fresh", total=6, restore=full)
  assert (s.start, s.checkpoints) == (4, (6,))
  assert dry_run.format_steps(list(range(200, 100001, 200))) == (
      "200, 400, 600, ..., 99800, 100000 (500 steps)")


# ---------------------------------------------------------------------------
# The activation estimate


def _estimate(args, examples):
  kwargs = train_arguments(args)
  model, partitioner = kwargs["model"], kwargs["partitioner"]
  cfg = kwargs["train_dataset_cfg"]
  shapes, types = model.input_shapes_and_types(cfg.task_feature_lengths, cfg.pack)
  specs, _ = state_init.state_specs(model, partitioner, shapes, types)
  return dry_run.activation_bytes(model, shapes, types, specs.abstract.params, examples), (
      kwargs, shapes, types, specs)


def test_input_shapes_are_those_of_the_training_batches(clean_gin):
  # The model's answer, which training, the dry run and t5lite-eval all
  # initialise from, against what the pipeline really yields.
  kwargs = train_arguments([*TINY, "--gin.MODEL_DIR='x'"])
  model = kwargs["model"]
  for pack in (True, False):
    cfg = dataclasses.replace(kwargs["train_dataset_cfg"], pack=pack)
    spec = datasets.get_dataset(cfg, 0, 1, model.FEATURE_CONVERTER_CLS, num_epochs=1).element_spec
    assert model.input_shapes_and_types(cfg.task_feature_lengths, pack) == (
        {k: (1, *v.shape[1:]) for k, v in spec.items()},
        {k: v.dtype.as_numpy_dtype for k, v in spec.items()})


def test_activation_estimate_follows_remat_and_batch(clean_gin):
  base = [*TINY, "--gin.MODEL_DIR='x'"]
  by_batch = []
  for examples in (2, 4, 6):
    gin.config.clear_config(clear_constants=True)
    by_batch.append(_estimate(base, examples)[0])
  # Linear in the batch; the relative-position one-hots do not depend on it.
  assert by_batch[2] - by_batch[1] == by_batch[1] - by_batch[0] > 0
  remat = "--gin.transformer.TransformerConfig.remat_policy='full'"
  scan = "--gin.transformer.TransformerConfig.scan_layers=True"
  gin.config.clear_config(clear_constants=True)
  scanned, _ = _estimate([*base, scan], 4)
  gin.config.clear_config(clear_constants=True)
  scanned_full, _ = _estimate([*base, scan, remat], 4)
  assert scanned_full < scanned  # full remat keeps little more than the layers' inputs
  # Outside a scan, XLA on the CPU merges the recomputation back into the
  # forward pass: the estimate there is that of no remat; other backends
  # keep the policy.
  gin.config.clear_config(clear_constants=True)
  full, (kwargs, shapes, types, specs) = _estimate([*base, remat], 4)
  assert jax.default_backend() == "cpu" and full == by_batch[1]
  model = kwargs["model"]
  assert model.as_compiled_for("gpu") is model
  assert model.as_compiled_for("cpu").module.config.remat_policy == "none"
  assert model.module.config.remat_policy == "full"  # the model itself is unchanged


def test_scanned_remat_estimate_adds_the_largest_layer_being_recomputed(clean_gin, monkeypatch):
  """A scanned, rematerialised stack keeps its layers' inputs, and while a
  layer is recomputed for its gradient, everything that layer would keep
  without remat: the estimate adds the largest layer's residuals, which
  one more layer in a stack without remat adds too."""
  base = [*TINY, "--gin.MODEL_DIR='x'", "--gin.transformer.TransformerConfig.scan_layers=True"]
  remat = "--gin.transformer.TransformerConfig.remat_policy='full'"

  def estimate(*extra):
    gin.config.clear_config(clear_constants=True)
    return _estimate([*base, *extra], 4)[0]

  plain = estimate()
  per_layer = max(estimate(f"--gin.transformer.TransformerConfig.num_{stack}_layers=3") - plain
                  for stack in ("encoder", "decoder"))  # TINY has 2 of each
  with_recomputation = estimate(remat)
  monkeypatch.setattr(dry_run, "_scan_step_bytes", lambda jaxpr: [])
  kept = estimate(remat)
  assert per_layer > 0 and kept > 0
  assert with_recomputation == kept + per_layer


def test_activation_estimate_is_near_the_compiled_step(clean_gin):
  """Within a factor of 2 of the temporary memory XLA allocates for the step."""
  args = ["--gin_file=gin/pretrain_dense.gin", "--gin.MODEL_DIR='x'", "--gin.BATCH_SIZE=4",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}"]
  estimate, (kwargs, shapes, types, specs) = _estimate(args, 4)
  partitioner = kwargs["partitioner"]
  batch = {k: jax.ShapeDtypeStruct((4,) + s[1:], types[k]) for k, s in shapes.items()}
  trainer = kwargs["trainer_cls"](model=kwargs["model"], partitioner=partitioner)
  step = trainer.compile_train_step(specs.shardings,
                                    {k: partitioner.batch_sharding(2) for k in batch})
  temp = step.lower(specs.abstract, batch).compile().memory_analysis().temp_size_in_bytes
  assert 0.5 < estimate / temp < 2.0, (estimate, temp)


def test_xla_on_the_cpu_keeps_remat_only_inside_a_scan():
  """What `BaseModel.as_compiled_for` relies on: on the CPU a rematerialised
  layer outside a scan compiles to the memory of no remat, while a scanned
  one saves most of it. If XLA changes this, the estimate must follow."""
  def layer(x, w):
    h = jnp.tanh(x @ w)
    return jnp.sin(h @ w.T) + x, None

  def temp_bytes(remat, scan):
    body = jax.checkpoint(layer) if remat else layer

    def loss(ws, x):
      if scan:
        x, _ = jax.lax.scan(body, x, ws)
      else:
        for w in ws:
          x, _ = body(x, w)
      return jnp.sum(x ** 2)

    ws, x = jnp.ones((6, 64, 256)), jnp.ones((1024, 64))
    compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(remat=True, scan=False) > 0.9 * temp_bytes(remat=False, scan=False)
  assert temp_bytes(remat=True, scan=True) < 0.5 * temp_bytes(remat=False, scan=True)


def test_activation_estimate_counts_a_kept_reshape_once():
  """A reshape is a view of the same buffer: a kept reshape of a parameter
  or an input costs nothing, and a tensor kept both as it is and reshaped
  counts once."""
  class Model:
    module = None

    def as_compiled_for(self, backend):
      return self

    def without_remat(self):
      return self

    def loss_fn(self, params, batch, rng):
      x = batch["x"].reshape(-1, 4)                     # a view of the input
      y = jnp.sin(x @ params["w"].reshape(4, 8))        # a view of the parameter
      return jnp.sum(y * y.reshape(-1, 2, 4).reshape(-1, 8)), None

  params = {"w": jax.ShapeDtypeStruct((2, 16), jnp.float32)}
  got = dry_run.activation_bytes(Model(), {"x": (1, 6, 4)}, {"x": jnp.float32}, params, 3)
  # Kept: y (for y * y) and cos(x @ w) (for sin's gradient), [18, 8] float32 each.
  assert got == 2 * 18 * 8 * 4
