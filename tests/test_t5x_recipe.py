"""A T5X run's training recipe, read from its config.gin, as the gin file
`t5lite-import` writes.

The configs under tests/data/ were written by T5X itself; the learning rates
compared against are T5X's own (tests/data/t5x_train/schedules.npz).
"""

import inspect
import json
import os

import interop_helpers as h
import jax
import numpy as np
import pytest
from test_cli import run_cli

import gin
from t5lite import cli, interop, optimizers
from t5lite.interop import gin_file, t5x_recipe


ENCDEC_A = os.path.join(h.DATA, "t5x_train", "encdec_a")
CHECKPOINT = os.path.join(ENCDEC_A, "checkpoint_0")
SCHEDULES = os.path.join(h.DATA, "t5x_train", "schedules.npz")

# A T5X-style operative config exercising every syntax the parser reads.
SYNTAX = """\
from __gin__ import dynamic_registration
import __main__ as train_script
from t5x import utils

# Macros:
# ==============================================================================
BATCH = 8
LENGTHS = {'inputs': 64,  # a comment inside a value
           'targets': 32}
NAME = 'a # not a comment'
OUTER = %BATCH

# Parameters for train/utils.DatasetConfig:
# ==============================================================================
train/utils.DatasetConfig.batch_size = %OUTER
train/utils.DatasetConfig.task_feature_lengths = %LENGTHS
train/utils.DatasetConfig.mixture_or_task_name = %NAME
utils.SaveCheckpointConfig.dtype = \\
    'float32'
models.EncoderDecoderModel.loss_normalizing_factor = \\
    %losses.SpecialLossNormalizingFactor.NUM_REAL_TARGET_TOKENS
train_script.train.train_dataset_cfg = @train/utils.DatasetConfig()
train_script.train.trainer_cls = @trainer.Trainer
"""


def test_parser_reads_macros_continuations_scopes_and_references():
  config = t5x_recipe.parse(SYNTAX, "config.gin")
  assert config.macros == {"BATCH": 8, "LENGTHS": {"inputs": 64, "targets": 32},
                           "NAME": "a # not a comment", "OUTER": 8}
  by_key = {b.key: b.value for b in config.bindings}
  assert by_key == {
      "train/utils.DatasetConfig.batch_size": 8,
      "train/utils.DatasetConfig.task_feature_lengths": {"inputs": 64, "targets": 32},
      "train/utils.DatasetConfig.mixture_or_task_name": "a # not a comment",
      "utils.SaveCheckpointConfig.dtype": "float32",
      "models.EncoderDecoderModel.loss_normalizing_factor": t5x_recipe.Constant(
          "losses.SpecialLossNormalizingFactor.NUM_REAL_TARGET_TOKENS"),
      "train_script.train.train_dataset_cfg": t5x_recipe.Reference(
          "train/utils.DatasetConfig", True),
      "train_script.train.trainer_cls": t5x_recipe.Reference("trainer.Trainer", False)}
  assert [b.kind for b in config.bindings][:2] == ["DatasetConfig", "DatasetConfig"]


@pytest.mark.parametrize("text,pattern", [
    ("x.Y.z = (1, 2", r"config.gin line 1: the value never ends"),
    ("x.Y.z = foo", r"config.gin line 1: 'foo' is not a gin value"),
    ("models.X:\n  z = 1", r"config.gin line 1: 'models.X:' is not a binding"),
    ("A = %B\nB = %A", r"Macro A refers to itself"),
])
def test_parser_names_the_line_it_cannot_read(text, pattern):
  with pytest.raises(ValueError, match=pattern):
    t5x_recipe.parse(text, "config.gin")


def _settings(recipe):
  return {s.name: s.value for _, settings in recipe.sections for s in settings}


def _recipe(text, network=gin_file.ENCODER_DECODER):
  return t5x_recipe.recipe(t5x_recipe.parse(text, "config.gin"), network, "/ckpt/checkpoint_5")


@pytest.mark.parametrize("written,expected", [
    ("None", None),
    ("%losses.SpecialLossNormalizingFactor.NUM_REAL_TARGET_TOKENS", "NUM_REAL_TARGET_TOKENS"),
    ("@losses.SpecialLossNormalizingFactor.AVERAGE_PER_SEQUENCE", "AVERAGE_PER_SEQUENCE"),
    ("'num_total_target_tokens'", "NUM_TOTAL_TARGET_TOKENS"),
    ("2048.0", 2048.0),
])
def test_every_spelling_of_t5x_loss_normalizing_factor(written, expected):
  recipe = _recipe(f"models.EncoderDecoderModel.loss_normalizing_factor = {written}")
  assert _settings(recipe)["models.EncoderDecoderModel.loss_normalizing_factor"] == expected
  assert not recipe.omitted


def test_unbound_settings_get_t5x_defaults_not_t5lite_ones():
  settings = _settings(_recipe("", gin_file.DECODER_ONLY))
  # T5X's Python defaults (t5x/examples/*/network.py, models.py, adafactor.py,
  # utils.DatasetConfig), where t5lite's differ.
  assert settings["optimizers.adafactor.logical_factor_rules"] is None
  assert settings["models.DecoderOnlyModel.z_loss"] == 0.0
  assert settings["models.DecoderOnlyModel.loss_normalizing_factor"] is None
  assert settings["DROPOUT_RATE"] == 0.1
  assert settings["transformer.TransformerConfig.dtype"] == "float32"
  assert settings["transformer.TransformerConfig.float32_attention_logits"] is False
  assert settings["INFER_EVAL_DATASET_CFG"] is None
  assert settings["INITIAL_CHECKPOINT_PATH"] == "/ckpt/checkpoint_5"


def test_moe_factor_rules_and_a_bfloat16_network_are_carried():
  recipe = _recipe("""
OPTIMIZER = @adafactor.Adafactor()
models.EncoderDecoderModel.optimizer_def = %OPTIMIZER
adafactor.Adafactor.logical_factor_rules = @adafactor_utils.logical_factor_rules()
adafactor.Adafactor.dtype_momentum = %jnp.bfloat16
adafactor.Adafactor.beta1 = 0.9
network.T5Config.dtype = 'bfloat16'
""")
  settings = _settings(recipe)
  assert settings["optimizers.adafactor.logical_factor_rules"] == gin_file.Ref(
      "@optimizers.standard_logical_factor_rules()")
  assert settings["optimizers.adafactor.dtype_momentum"] == "bfloat16"
  assert settings["optimizers.adafactor.beta1"] == 0.9
  assert settings["transformer.TransformerConfig.dtype"] == "bfloat16"
  assert not recipe.omitted


def test_another_optimizer_or_schedule_is_listed_and_replaced_by_defaults():
  recipe = _recipe("""
models.EncoderDecoderModel.optimizer_def = @optim.AdamW()
optim.AdamW.b1 = 0.9
trainer.Trainer.learning_rate_fn = @schedules.cosine()
""")
  settings = _settings(recipe)
  assert settings["OPTIMIZER"] == gin_file.Ref("@optimizers.adafactor()")
  assert settings["LEARNING_RATE"] == 0.001
  omitted = {o.binding: o for o in recipe.omitted}
  assert set(omitted) == {"models.EncoderDecoderModel.optimizer_def", "optim.AdamW.b1",
                          "trainer.Trainer.learning_rate_fn"}
  assert "only adafactor.Adafactor is carried" in omitted[
      "models.EncoderDecoderModel.optimizer_def"].reason
  assert omitted["trainer.Trainer.learning_rate_fn"].value == "@schedules.cosine()"


def _parse_written(path, *bindings):
  """The file as t5lite-train reads it, with the user's MODEL_DIR and TRAIN_STEPS."""
  cli.parse_gin([path], ["MODEL_DIR = '/tmp/x'", "TRAIN_STEPS = 2", *bindings],
                cli.gin_search_paths([]))


def _written(tmp_path, source):
  imported = interop.model_gin(source)
  path = tmp_path / "t5x.gin"
  path.write_text(imported.text)
  return str(path), imported.recipe


def _call(reference):
  return gin.query_parameter(reference).scoped_configurable_fn()


@pytest.mark.usefixtures("clean_gin")
def test_recipe_of_encdec_a_is_the_t5x_runs(tmp_path):
  path, recipe = _written(tmp_path, CHECKPOINT)
  assert recipe.omitted == ()  # every binding of that config has its place
  _parse_written(path)

  model = _call("%MODEL")
  config = model.module.config
  assert (config.dropout_rate, config.dtype, config.float32_attention_logits) == (
      0.0, "float32", True)
  assert model.z_loss == 1e-4 and model.label_smoothing == 0.0
  assert model.loss_normalizing_factor is None  # T5X sums the loss
  assert isinstance(model.optimizer, optimizers.ByLogicalAxes)
  adafactor = dict(gin.get_bindings("t5lite.optimizers.adafactor"))
  assert adafactor.pop("logical_factor_rules") == optimizers.standard_logical_factor_rules()
  adafactor.pop("learning_rate")
  assert adafactor == {"decay_rate": 0.8, "step_offset": 0}  # the rest: T5X's defaults

  # The schedule gives T5X's own learning rates (its config is the first one
  # make_schedules.py evaluated).
  t5x = np.load(SCHEDULES)
  assert json.loads(str(t5x["configs"][0])) == {
      **{name: parameter.default for name, parameter in
         inspect.signature(optimizers.create_learning_rate_scheduler).parameters.items()},
      **dict(gin.get_bindings("t5lite.optimizers.create_learning_rate_scheduler"))}
  schedule = _call("%LEARNING_RATE")
  rates = np.array([jax.jit(schedule)(np.int32(step)) for step in t5x["steps"]])
  np.testing.assert_allclose(rates, t5x["values"][0], rtol=1e-6)

  train = _call("train_lib.train.train_dataset_cfg")
  assert (train.mixture_or_task_name, train.batch_size, train.task_feature_lengths) == (
      "t5lite_span_corruption", 8, {"inputs": 64, "targets": 32})
  assert (train.shuffle, train.seed, train.pack, train.split) == (False, 0, True, "train")
  assert train.module == "t5lite.data.tasks"
  assert [gin.query_parameter(f"%{m}") for m in (
      "EVAL_PERIOD", "EVAL_STEPS", "STATS_PERIOD", "CHECKPOINT_PERIOD", "RANDOM_SEED",
      "INFER_EVAL_DATASET_CFG")] == [30, 2, 1, 10, 0, None]
  assert gin.query_parameter("%INITIAL_CHECKPOINT_PATH") == CHECKPOINT
  assert gin.query_parameter("checkpoints.RestoreCheckpointConfig.params_only") is True


def _model_dir_with(tmp_path, edit):
  """A T5X model_dir of encdec_a's checkpoint_0 whose config.gin `edit` changed."""
  model_dir = tmp_path / "t5x_run"
  model_dir.mkdir()
  os.symlink(CHECKPOINT, model_dir / "checkpoint_0")
  text = open(os.path.join(ENCDEC_A, "config.gin")).read()
  (model_dir / "config.gin").write_text(edit(text))
  return str(model_dir / "checkpoint_0")


def test_settings_not_carried_are_listed_in_the_file_and_named_once(tmp_path):
  def edit(text):
    assert "USE_HARDWARE_RNG = False" in text
    return (text.replace("USE_HARDWARE_RNG = False", "USE_HARDWARE_RNG = True")
            + "adafactor.Adafactor.factor_map = @adafactor.HParamMap()\n"
            + "partitioning.PjitPartitioner.model_parallel_submesh = (2, 1, 1, 1)\n")
  source = _model_dir_with(tmp_path, edit)
  result = run_cli([f"--source={source}", "--output=x.gin"], str(tmp_path),
                   script="t5lite-import")
  assert result.returncode == 0, result.stderr[-3000:]
  names = ("adafactor.Adafactor.factor_map, partitioning.PjitPartitioner.model_parallel_submesh, "
           "train_script.train.use_hardware_rng")
  line = f"] 3 T5X setting(s) not carried over (listed in x.gin): {names}"
  assert (result.stdout + result.stderr).count("not carried over") == 1
  assert any(said.endswith(line) for said in result.stderr.splitlines()), result.stderr
  text = (tmp_path / "x.gin").read_text()
  for listed in ("adafactor.Adafactor.factor_map = @adafactor.HParamMap()",
                 "train_script.train.use_hardware_rng = True",
                 "partitioning.PjitPartitioner.model_parallel_submesh = (2, 1, 1, 1)"):
    assert f"\n# Not carried over: {listed} (" in text
  bound = [line for line in text.splitlines() if not line.startswith("#")]
  assert not [line for line in bound if "factor_map" in line or "submesh" in line
              or "hardware" in line]


def test_a_t5x_checkpoint_without_config_gin_or_a_folder_gets_a_model_file(tmp_path):
  lone = tmp_path / "lone"
  lone.mkdir()
  os.symlink(CHECKPOINT, lone / "checkpoint_0")
  assert t5x_recipe.for_checkpoint(str(lone / "checkpoint_0"), gin_file.ENCODER_DECODER) is None
  for source, output in ((str(lone / "checkpoint_0"), "lone.gin"),
                         (os.path.join(h.HF, "byt5"), "byt5.gin")):
    result = run_cli([f"--source={source}", f"--output={output}"], str(tmp_path),
                     script="t5lite-import")
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / output).read_text()
    assert "\ninclude " not in text and "INITIAL_CHECKPOINT_PATH =" not in text
    assert "Use it like a file of gin/models/" in text and "\nLEARNING_RATE = 0.001" in text
