"""An unknown gin name fails in one line that names the closest valid name."""

import os
import subprocess

import pytest
from test_cli import BIN, TINY, run_cli

from t5lite import cli


HEADER = ("from __gin__ import dynamic_registration\n"
          "from t5lite import checkpoints\n"
          "from t5lite.models import transformer\n")


def _parse_bindings(*bindings):
  cli.parse_gin([], list(bindings), cli.gin_search_paths([]))


def _parse_file(tmp_path, body):
  path = tmp_path / "typo.gin"
  path.write_text(HEADER + body)
  cli.parse_gin([str(path)], [], [str(tmp_path)])


def test_unknown_parameter_in_binding(clean_gin):
  with pytest.raises(ValueError, match=r"Unknown parameter 'perod' of "
                     r"checkpoints\.SaveCheckpointConfig; did you mean 'period'\? "
                     r"Valid: period, checkpoint_steps, keep, "):
    _parse_bindings("checkpoints.SaveCheckpointConfig.perod = 5")


def test_unknown_configurable_in_binding(clean_gin):
  with pytest.raises(ValueError, match=r"^Unknown configurable 'transformer\.TransformerConfg'; "
                     r"did you mean 'transformer\.TransformerConfig'\?$"):
    _parse_bindings("transformer.TransformerConfg.emb_dim = 4")


def test_unknown_configurable_in_reference(clean_gin):
  with pytest.raises(ValueError, match=r"did you mean 'checkpoints\.RestoreCheckpointConfig'\?"):
    _parse_bindings(
        "checkpoints.CheckpointConfig.restore = @checkpoints.RestoreCheckpointConfg()")


def test_unknown_parameter_in_file_names_the_line(tmp_path, clean_gin):
  with pytest.raises(ValueError, match=r"Unknown parameter 'emb_dimm' of "
                     r"transformer\.TransformerConfig; did you mean 'emb_dim'\?.* "
                     r"\(line 5 of .*typo\.gin\)$"):
    _parse_file(tmp_path, "\ntransformer.TransformerConfig.emb_dimm = 4\n")


def test_unknown_configurable_in_file(tmp_path, clean_gin):
  with pytest.raises(ValueError, match=r"Unknown configurable 'checkpoints\.SaveCheckpointConfg'; "
                     r"did you mean 'checkpoints\.SaveCheckpointConfig'\? \(line 4 of "):
    _parse_file(tmp_path, "checkpoints.SaveCheckpointConfg.period = 5\n")


def test_unknown_module_alias_in_binding(clean_gin):
  with pytest.raises(ValueError, match=r"Unknown module 'checkpoint' in a binding; "
                     r"did you mean 'checkpoints'\? Bindings may use: "):
    _parse_bindings("checkpoint.SaveCheckpointConfig.period = 5")


def test_no_close_name_still_lists_the_valid_ones(clean_gin):
  with pytest.raises(ValueError, match=r"Unknown parameter 'zzz' of "
                     r"checkpoints\.SaveCheckpointConfig\. Valid: period, "):
    _parse_bindings("checkpoints.SaveCheckpointConfig.zzz = 5")


def test_hint_falls_back_to_gin_message_when_it_cannot_resolve():
  # An alias the shipped files do not use cannot be resolved: keep gin's text.
  assert cli._gin_name_hint(  # noqa: SLF001
      "Configurable 'ckpt.SaveCheckpointConfig' doesn't have a parameter named 'perod'.") is None
  assert cli._gin_name_hint("something else entirely") is None  # noqa: SLF001


def test_cli_typo_exits_2_with_suggestion_and_writes_nothing(tmp_path):
  model_dir = tmp_path / "run"
  out = run_cli([*TINY, f"--gin.MODEL_DIR='{model_dir}'",
                 "--gin.checkpoints.SaveCheckpointConfig.perod=5"], cwd=str(tmp_path))
  assert out.returncode == 2, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("t5lite: ValueError: Unknown parameter 'perod'"), last
  assert "did you mean 'period'?" in last
  assert "Traceback" not in out.stderr
  assert not model_dir.exists()


# ---------------------------------------------------------------------------
# Syntax errors, unset macros and the JAX platform: one line naming the source


def test_syntax_error_in_file_names_the_file_and_line(tmp_path, clean_gin):
  with pytest.raises(ValueError, match=r"^Gin syntax error at line 5 of .*typo\.gin: "
                     r"Expected ',' or '\)'\.$"):
    _parse_file(tmp_path, "checkpoints.SaveCheckpointConfig.period = (5\nMODEL_DIR = 3\n")


def test_unclosed_bracket_in_file_names_the_file(tmp_path, clean_gin):
  with pytest.raises(ValueError, match=r"^Gin syntax error at line \d+ of .*typo\.gin: "
                     r"EOF in multi-line statement \(unclosed bracket\?\)\.$"):
    _parse_file(tmp_path, "checkpoints.SaveCheckpointConfig.period = [5,\n")


def test_syntax_error_in_shorthand_binding_names_it_as_written(clean_gin, monkeypatch):
  # Gin would put this at "line 13", a line of the generated import header.
  monkeypatch.setattr("sys.argv", ["t5lite-train", "--gin.TRAIN_STEPS=(5"])
  with pytest.raises(ValueError, match=r"^--gin\.TRAIN_STEPS=\(5 is not valid gin: "
                     r"EOF in multi-line statement \(unclosed bracket\?\)\.$"):
    _parse_bindings("TRAIN_STEPS = (5")


def test_syntax_error_in_gin_bindings_flag(clean_gin):
  with pytest.raises(ValueError, match=r"^--gin_bindings='checkpoints\.SaveCheckpointConfig\."
                     r"period = 5 6' is not valid gin: Expected newline\.$"):
    _parse_bindings("checkpoints.SaveCheckpointConfig.period = 5 6")


def test_unquoted_string_says_to_quote_it(clean_gin):
  with pytest.raises(ValueError, match=r"MODEL_DIR = runs/x' is not valid gin: Unable to parse "
                     r"value\. Values are Python literals: quote strings"):
    _parse_bindings("MODEL_DIR = runs/x")


def test_unset_required_macro_names_the_flag(clean_gin):
  with pytest.raises(ValueError, match=r"^Macro MODEL_DIR is required \(%gin\.REQUIRED\) but not "
                     r"set; pass --gin\.MODEL_DIR=\.\.\. or set it in a gin file"):
    cli.parse_gin(["gin/pretrain_dense.gin"], [], cli.gin_search_paths([]))


@pytest.mark.parametrize("value", ["cpux", "gpu,tpux", "CPU"])
def test_unknown_jax_platform_is_named(value):
  with pytest.raises(ValueError, match=rf"^JAX_PLATFORMS='{value}' names unknown platform\(s\) "
                     r"\w+; use a comma-separated list of cpu, cuda, gpu, "):
    cli.check_jax_platforms(value)


@pytest.mark.parametrize("value", [None, "", "cpu", "cuda,cpu", "tpu"])
def test_known_jax_platforms_pass(value):
  cli.check_jax_platforms(value)


@pytest.mark.slow
@pytest.mark.parametrize("args, env, message", [
    (["--gin.TRAIN_STEPS=(5"], {}, "t5lite: ValueError: --gin.TRAIN_STEPS=(5 is not valid gin"),
    (["--gin.TRAIN_STEPS='abc'"], {}, "t5lite: ValueError: total_steps (TRAIN_STEPS) must be a "
     "whole number of steps, got 'abc' (str)"),
    ([], {"JAX_PLATFORMS": "cpux"}, "t5lite: ValueError: JAX_PLATFORMS='cpux' names unknown"),
])
def test_cli_input_errors_exit_2_in_one_line_and_write_nothing(tmp_path, args, env, message):
  model_dir = tmp_path / "run"
  out = subprocess.run(
      [os.path.join(BIN, "t5lite-train"), *TINY, f"--gin.MODEL_DIR='{model_dir}'", *args],
      cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3") | env)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1].startswith(message), out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert not model_dir.exists()


def test_mesh_selector_flag_picks_the_partitioners_mesh_rule(tmp_path, clean_gin):
  import gin
  from t5lite import partitioning
  path = tmp_path / "rules.gin"
  path.write_text("from __gin__ import dynamic_registration\n"
                  "from t5lite import partitioning\n"
                  "partitioning.Partitioner.mesh_rules = "
                  "[('H100', {'model': 4}), ('.*', {'fsdp': -1})]\n"
                  "partitioning.Partitioner.mesh_selector = 'from the file'\n")
  cli.parse_gin([str(path)], [], [str(tmp_path)])
  cli.select_mesh("NVIDIA H100 80GB HBM3")  # the flag wins over the file
  p = gin.get_configurable(partitioning.Partitioner)()
  with pytest.raises(ValueError, match=r"'model': 4\} has 4 devices, but there are 1;"):
    p.validate()



def test_flag_errors_are_one_line_with_the_closest_known_flag():
  from absl import flags

  from t5lite import console
  known = ["gin_file", "gin_bindings", "gin_search_paths", "helpshort"]
  line = console.flag_error_line(flags.UnrecognizedFlagError("gin_bindigs", "--gin_bindigs=x"),
                                 known)
  assert line == "Unknown flag --gin_bindigs; did you mean --gin_bindings? --helpshort lists " \
                 "the flags."
  assert console.flag_error_line(flags.UnrecognizedFlagError("zzz"), known) == \
      "Unknown flag --zzz. --helpshort lists the flags."
  bad_value = flags.IllegalFlagValueError("flag --process_count=abc: invalid literal\n  more")
  assert console.flag_error_line(bad_value, known) == \
      "flag --process_count=abc: invalid literal more. --helpshort lists the flags."
