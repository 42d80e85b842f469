"""Writes tests/data/hf/roundtrip/: t5lite's exports that transformers then loads.

Run with t5lite's own environment, then record what transformers computes
from each export with make_reference.py's round-trip mode:

  .venv/bin/python tests/data/hf/export_roundtrip.py
  /work/hfvenv/bin/python tests/data/hf/make_reference.py --roundtrip \\
      tests/data/hf/roundtrip/t5_v1_0 tests/data/hf/roundtrip/t5_v1_1 \\
      tests/data/hf/roundtrip/switch tests/data/hf/roundtrip/t5x_a=tests/data/hf/byt5

Exports: three Hugging Face folders imported into t5lite and exported again
(ReLU with tied logits and a SentencePiece vocabulary; gated GELU, untied;
Switch), and the T5X encoder-decoder of tests/data/t5x/ (a model that never
was a Hugging Face one), run on the byt5 reference batch (byte ids).
tests/test_interop_hf.py checks that the exporter still writes exactly
these arrays and that transformers' logits equal t5lite's.
"""

import os
import shutil
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/

import interop_helpers as h  # noqa: E402
import test_interop_hf as hf_tests  # noqa: E402

from t5lite import interop  # noqa: E402


OUT = os.path.join(HERE, "roundtrip")


def _export(name, model, params, source):
  target = os.path.join(OUT, name)
  shutil.rmtree(target, ignore_errors=True)
  interop.export_huggingface(params, interop.export_fields(model), target,
                             model.input_vocabulary, source=source)
  print("wrote", target)


def main():
  for family in ("t5_v1_0", "t5_v1_1", "switch"):
    model, _, _, params = hf_tests._import(family)
    _export(family, model, params, os.path.join(h.HF, family))
  model = h.t5x_model("a")
  params = interop.load_params(h.T5X_CHECKPOINTS["a", "orbax"],
                               h.abstract_params(model, h.t5x_batch("a")))
  _export("t5x_a", model, params, h.T5X_CHECKPOINTS["a", "orbax"])


if __name__ == "__main__":
  main()
