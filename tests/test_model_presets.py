"""Presets of published models (gin/models/): each has its published parameter count.

PUBLISHED holds Hugging Face's `model.num_parameters()` for the published
checkpoints, not numbers t5lite computed. They were produced once with the
Hugging Face configs on the meta device (`with torch.device('meta'):
T5ForConditionalGeneration(config)` / `SwitchTransformersForConditionalGeneration`,
then `num_parameters()`); the T5.1.1, Flan-T5 and ByT5 checkpoints have an
untied `lm_head` (`tie_word_embeddings: false` in their config.json) that
transformers 5 no longer unties by itself, so it was untied by hand before
counting. Several of them also appear in public code next to a loaded
checkpoint (e.g. 76,961,152 for google/flan-t5-small, 299,637,760 for
google/byt5-small, 619,339,008 for google/switch-base-8).

The dry run of a preset is `t5lite-train --gin_file=gin/models/<preset>.gin
--gin_file=gin/runs/pretrain.gin` with the run's required macros and an
embedded task of the preset's vocabulary; the SentencePiece presets take
`SPIECE_MODEL=None`, t5lite's shipped stand-in, since the published
SentencePiece model is not shipped. The console script's command runs (in
this process: what it prints is what is checked) for one preset of each
family; every preset is counted in-process with the functions the dry run
counts with (`state_init.state_specs`, `state_init.param_rows`,
`dry_run.module_counts`), which keeps the module well under a minute of the
two test workers.
"""

import glob
import os

import pytest
from test_cli import run_in_process
from test_dry_run import printed_counts, train_arguments

import gin
from t5lite import cli, dry_run, state_init


PUBLISHED = {
    "t5_1_1_small": 76_961_152,        # google/t5-v1_1-small
    "t5_1_1_base": 247_577_856,        # google/t5-v1_1-base
    "t5_1_1_large": 783_150_080,       # google/t5-v1_1-large
    "t5_1_1_xl": 2_849_757_184,        # google/t5-v1_1-xl
    "t5_1_1_xxl": 11_135_332_352,      # google/t5-v1_1-xxl
    "flan_t5_small": 76_961_152,       # google/flan-t5-small
    "flan_t5_base": 247_577_856,       # google/flan-t5-base
    "flan_t5_large": 783_150_080,      # google/flan-t5-large
    "flan_t5_xl": 2_849_757_184,       # google/flan-t5-xl
    "flan_t5_xxl": 11_135_332_352,     # google/flan-t5-xxl
    "byt5_small": 299_637_760,         # google/byt5-small
    "byt5_base": 581_653_248,          # google/byt5-base
    "byt5_large": 1_228_183_552,       # google/byt5-large
    "byt5_xl": 3_737_801_728,          # google/byt5-xl
    "byt5_xxl": 12_906_899_328,        # google/byt5-xxl
    "switch_base_8": 619_339_008,      # google/switch-base-8
    "switch_base_16": 1_072_397_568,   # google/switch-base-16
    "switch_base_32": 1_978_514_688,   # google/switch-base-32
    "switch_base_64": 3_790_748_928,   # google/switch-base-64
    "switch_base_128": 7_415_217_408,  # google/switch-base-128
    "switch_base_256": 14_664_154_368,  # google/switch-base-256
}
FAMILIES = ("t5_1_1_", "flan_t5_", "byt5_", "switch_base_")
# One preset of each family through the real console script.
CLI_PRESETS = ("flan_t5_small", "byt5_small", "switch_base_8")

pytestmark = pytest.mark.usefixtures("clean_gin")


def dry_run_args(preset):
  """Command-line gin flags of a dry run of `preset` on an embedded task."""
  spm = not preset.startswith("byt5_")
  task = "t5lite_span_corruption_spm" if spm else "t5lite_span_corruption"
  return [f"--gin_file=gin/models/{preset}.gin", "--gin_file=gin/runs/pretrain.gin",
          f"--gin.MIXTURE_OR_TASK_NAME='{task}'",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.BATCH_SIZE=2",
          "--gin.TRAIN_STEPS=1", "--gin.MODEL_DIR='run'"] + (
              ["--gin.SPIECE_MODEL=None"] if spm else [])


def model_config(preset):
  return train_arguments(dry_run_args(preset))["model"].module.config


def test_every_published_preset_has_its_count():
  root = os.path.join(cli.package_gin_root(), "gin", "models")
  presets = {os.path.basename(p)[:-len(".gin")] for p in glob.glob(os.path.join(root, "*.gin"))
             if os.path.basename(p).startswith(FAMILIES)}
  assert presets == set(PUBLISHED)


@pytest.mark.slow  # real-size models, traced with jax.eval_shape
@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_has_the_published_parameter_count(preset):
  kwargs = train_arguments(dry_run_args(preset))
  model, partitioner = kwargs["model"], kwargs["partitioner"]
  cfg = kwargs["train_dataset_cfg"]
  shapes, types = model.input_shapes_and_types(cfg.task_feature_lengths, cfg.pack)
  # The parameters are a function of the model's class, its module (class and
  # config) and the input shapes: a preset equal to one counted already (each
  # Flan-T5 size is its T5.1.1 size, other weights) takes that count, not a
  # trace of its own.
  key = (type(model), type(model.module), model.module.config, repr((shapes, types)))
  counted = next((total for other, total in _COUNTED if other == key), None)
  if counted is None:
    specs, _ = state_init.state_specs(model, partitioner, shapes, types)
    modules = dry_run.module_counts(state_init.param_rows(specs, partitioner))
    counted = sum(modules.values())
    _COUNTED.append((key, counted))
  assert counted == PUBLISHED[preset]


_COUNTED = []  # (what the parameters depend on, their count) of the presets counted


@pytest.mark.slow  # real-size models, traced with jax.eval_shape
@pytest.mark.parametrize("preset", CLI_PRESETS)
def test_dry_run_prints_the_published_parameter_count(preset, tmp_path, monkeypatch):
  out = run_in_process([*dry_run_args(preset), "--dry_run"], str(tmp_path), monkeypatch)
  total, _ = printed_counts(out)
  assert total == PUBLISHED[preset]
  rows = 384 if preset.startswith("byt5_") else 32128
  assert f"ids in {rows} embedding rows" in out
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("size", ["small", "base", "large", "xl", "xxl"])
def test_flan_t5_is_t5_1_1_with_other_weights(size):
  flan = model_config(f"flan_t5_{size}")
  gin.config.clear_config(clear_constants=True)
  assert flan == model_config(f"t5_1_1_{size}")
  assert flan.mlp_activations == ("gelu", "linear") and not flan.logits_via_embedding


@pytest.mark.parametrize("experts", [8, 16, 32, 64, 128, 256])
def test_switch_presets_route_like_the_published_models(experts):
  # Routing changes no parameter count, so the counts cannot pin it.
  cfg = model_config(f"switch_base_{experts}")
  assert (cfg.num_experts, cfg.num_selected_experts, cfg.moe_layer_interval) == (experts, 1, 2)
  assert (cfg.expert_capacity, cfg.renormalize_router_weights, cfg.group_size) == (64, False, None)
  assert cfg.mlp_activations == ("relu",) and cfg.logits_via_embedding


def test_sentencepiece_presets_name_the_missing_model_file():
  args = [a for a in dry_run_args("t5_1_1_small") if a != "--gin.SPIECE_MODEL=None"]
  with pytest.raises(ValueError, match=r"SentencePiece model "
                                       r"'cc_all\.32000\.100extra/sentencepiece\.model' "
                                       r"does not exist"):
    train_arguments(args)
