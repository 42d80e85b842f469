"""The persistent compilation cache t5lite's commands turn on by default."""

import os
import re

import jax
import pytest

from t5lite import compilation_cache
from test_cli import TINY, run_cli

_SETTINGS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
             "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def jax_cache_settings(monkeypatch):
  """JAX's cache settings as they were, after the test; no cache variables
  from the test environment."""
  saved = {name: getattr(jax.config, name) for name in _SETTINGS}
  for name in (compilation_cache.ENV_DIRECTORY, compilation_cache.ENV_MIN_COMPILE_TIME):
    monkeypatch.delenv(name, raising=False)
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


def test_default_directory_is_under_the_users_cache(tmp_path, monkeypatch, jax_cache_settings):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  directory = compilation_cache.configure(None)
  assert directory == str(tmp_path / "xdg" / "t5lite" / "jax-compilation")
  assert os.path.isdir(directory)
  assert jax.config.jax_compilation_cache_dir == directory
  assert jax.config.jax_enable_compilation_cache
  # Every program is cached, however short its compile.
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
  assert compilation_cache.use().directory == directory
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compilation_cache.default_directory() == str(
      tmp_path / "home" / ".cache" / "t5lite" / "jax-compilation")


def test_flag_beats_environment_beats_default(tmp_path, monkeypatch, jax_cache_settings):
  monkeypatch.setenv(compilation_cache.ENV_DIRECTORY, str(tmp_path / "from_env"))
  monkeypatch.setenv(compilation_cache.ENV_MIN_COMPILE_TIME, "2.5")
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
  assert compilation_cache.configure(None) == str(tmp_path / "from_env")
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5  # the user's, kept
  assert compilation_cache.configure(str(tmp_path / "flag")) == str(tmp_path / "flag")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "flag")


def test_off_when_asked_or_when_the_directory_cannot_be_made(tmp_path, capsys,
                                                            jax_cache_settings):
  assert compilation_cache.configure(str(tmp_path / "unused"), enabled=False) is None
  assert not jax.config.jax_enable_compilation_cache
  assert compilation_cache.use().describe() == "compilation cache off"
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert compilation_cache.configure(str(blocker / "cache")) is None
  assert not jax.config.jax_enable_compilation_cache
  warning = capsys.readouterr().out
  assert "compilation cache off" in warning and str(blocker / "cache") in warning


_USE = re.compile(r"compilation cache (\S+): (\d+) program\(s\) loaded, (\d+) compiled")


@pytest.mark.slow
def test_a_second_launch_loads_every_program_and_the_flag_turns_it_off(tmp_path):
  cache = tmp_path / "cache"
  uses = []
  for run in ("first", "second"):
    done = run_cli([*TINY, f"--gin.MODEL_DIR='{tmp_path / run}'",
                    f"--compilation_cache_dir={cache}"], cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    match = _USE.search(done.stdout)
    assert match, done.stdout[-2000:]
    uses.append((match.group(1), int(match.group(2)), int(match.group(3))))
  (first_dir, first_loaded, first_compiled), (second_dir, second_loaded, second_compiled) = uses
  assert first_dir == second_dir == str(cache)
  assert first_compiled > 0
  assert second_loaded == first_loaded + first_compiled and second_compiled == 0
  done = run_cli([*TINY, f"--gin.MODEL_DIR='{tmp_path / 'off'}'", "--nocompilation_cache"],
                 cwd=str(tmp_path))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "compilation cache off" in done.stdout
