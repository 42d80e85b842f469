"""Every gin file shipped parses, and the run files declare their macros first."""

import glob
import os

import pytest

import gin
from t5lite import cli


ROOT = cli.package_gin_root()
FILES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "gin", "**", "*.gin"),
                                                           recursive=True))
# Overlays and run files only make sense on top of a model/headline file.
BASE_FOR = {"gin/testing/local_tiny.gin": ["gin/pretrain_dense.gin"],
            "gin/runs/pretrain.gin": ["gin/models/t5_tiny.gin"],
            "gin/runs/finetune.gin": ["gin/models/t5_tiny.gin"],
            "gin/runs/eval.gin": ["gin/models/t5_tiny.gin"],
            "gin/runs/infer.gin": ["gin/models/t5_tiny.gin"],
            "gin/runs/export.gin": ["gin/models/t5_tiny.gin"],
            **{f"gin/partitioning/{n}.gin": ["gin/pretrain_dense.gin"]
               for n in ("data_parallel", "fsdp", "tensor_parallel", "fsdp_tp")},
            "gin/partitioning/expert_parallel.gin": ["gin/pretrain_moe.gin"],
            # Learner recipes, mixtures and tasks replace a headline's optimizer or task.
            **{f: ["gin/pretrain_dense.gin"] for f in FILES
               if f.startswith(("gin/learners/", "gin/mixtures/", "gin/tasks/"))}}


# Every test here parses gin files: each starts and ends with a clean config.
pytestmark = pytest.mark.usefixtures("clean_gin")


def test_found_the_shipped_files():
  assert "gin/pretrain_dense.gin" in FILES and len(FILES) >= 9


# Values a user gives on the command line for the run files' required macros.
USER_MACROS = ["MODEL_DIR = '/tmp/x'", "CHECKPOINT_PATH = '/tmp/x'", "EVAL_OUTPUT_DIR = '/tmp/x'",
               "INFER_OUTPUT_DIR = '/tmp/x'", "EXPORT_DIR = '/tmp/x'",
               "MIXTURE_OR_TASK_NAME = 't5lite_span_corruption'", "BATCH_SIZE = 2",
               "TASK_FEATURE_LENGTHS = {'inputs': 8, 'targets': 8}", "TRAIN_STEPS = 1",
               "INITIAL_CHECKPOINT_PATH = None"]


@pytest.mark.parametrize("name", FILES)
def test_gin_file_parses(name):
  cli.parse_gin(BASE_FOR.get(name, []) + [name], USER_MACROS, cli.gin_search_paths([]))
  assert gin.config_str()  # something was bound


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("gin/runs/")])
def test_run_files_start_with_required_macros(name):
  text = open(os.path.join(ROOT, name)).read()
  body = [line for line in text.splitlines()
          if line and not line.startswith(("#", "from ", "import "))]
  assert body and body[0].endswith("%gin.REQUIRED"), body[:3]
  required = [line for line in body if line.endswith("%gin.REQUIRED")]
  assert body[:len(required)] == required  # all of them before anything else


def test_headline_builds_its_objects():
  cli.parse_gin(["gin/pretrain_dense.gin", "gin/testing/local_tiny.gin"],
                ["MODEL_DIR = '/nonexistent'"], cli.gin_search_paths([]))
  # A run file's required macro left unset fails at parse time, naming it.
  gin.config.clear_config(clear_constants=True)
  with pytest.raises(ValueError, match="MODEL_DIR.*gin.REQUIRED"):
    cli.parse_gin(["gin/pretrain_dense.gin"], [], cli.gin_search_paths([]))
  gin.config.clear_config(clear_constants=True)
  cli.parse_gin(["gin/pretrain_dense.gin", "gin/testing/local_tiny.gin"],
                ["MODEL_DIR = '/nonexistent'"], cli.gin_search_paths([]))
  from t5lite.models import models
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  assert isinstance(model, models.EncoderDecoderModel)
  assert model.module.config.emb_dim == 8 and model.module.config.vocab_size == 384


def test_command_line_binding_can_reference_functions_no_file_used():
  cli.parse_gin(["gin/pretrain_dense.gin"],
                ["MODEL_DIR = '/tmp/x'", "VOCABULARY = @vocabularies.sentencepiece_vocabulary()",
                 "MIXTURE_OR_TASK_NAME = 't5lite_span_corruption_spm'"], cli.gin_search_paths([]))
  vocab = gin.query_parameter("%VOCABULARY").scoped_configurable_fn()
  assert type(vocab).__name__ == "SentencePieceVocabulary" and vocab.vocab_size == 2100


def test_eval_and_infer_run_files_keep_the_training_headlines_task():
  """`<headline> + gin/runs/eval.gin` (as the docs run it) evaluates the headline's task."""
  for run_file, output in (("gin/runs/eval.gin", "EVAL_OUTPUT_DIR"),
                           ("gin/runs/infer.gin", "INFER_OUTPUT_DIR")):
    gin.config.clear_config(clear_constants=True)
    cli.parse_gin(["gin/finetune_dense.gin", run_file],
                  ["CHECKPOINT_PATH = '/tmp/x'", f"{output} = '/tmp/x'"],
                  cli.gin_search_paths([]))
    assert gin.query_parameter("%TASK_FEATURE_LENGTHS") == {"inputs": 32, "targets": 24}
    assert gin.query_parameter("%BATCH_SIZE") == 64
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") is None  # infer: INPUT_FILE by default
  gin.config.clear_config(clear_constants=True)
  cli.parse_gin(["gin/finetune_dense.gin", "gin/runs/eval.gin"],
                ["CHECKPOINT_PATH = '/tmp/x'", "EVAL_OUTPUT_DIR = '/tmp/x'"],
                cli.gin_search_paths([]))
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "t5lite_sort"
  # With a model file alone the task must be given, and the error says how.
  gin.config.clear_config(clear_constants=True)
  with pytest.raises(ValueError, match=r"^Macro MIXTURE_OR_TASK_NAME is used but never set; "
                                       r"pass --gin\.MIXTURE_OR_TASK_NAME="):
    cli.parse_gin(["gin/models/t5_tiny.gin", "gin/runs/eval.gin"],
                  ["CHECKPOINT_PATH = '/tmp/x'", "EVAL_OUTPUT_DIR = '/tmp/x'",
                   "TASK_FEATURE_LENGTHS = {'inputs': 8, 'targets': 8}", "BATCH_SIZE = 2"],
                  cli.gin_search_paths([]))
