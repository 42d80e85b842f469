"""Which Python code tf.data's AutoGraph rewrites while it traces a pipeline.

tf.data passes every map function through AutoGraph, which reads, rewrites and
recompiles its source, and that of every function it calls, so that Python
control flow over tensors becomes graph control flow. The preprocessors of
t5lite and the SeqIO modules named below use TF ops for all such control
flow, so the rewrite changes no op of the traced graph and only costs time:
about 2 s of every command that builds a pipeline (the first span-corruption
pipeline of a process builds in 2.2 s instead of 4.1 s; docs/performance.md).
`skip_known_code` tells AutoGraph to call them as written.

Users' own preprocessors are still rewritten, and so is `seqio.utils`, whose
packing loops over tensors in Python.
"""

from __future__ import annotations


# Modules whose map functions need no AutoGraph rewrite. A module listed here
# by mistake fails loudly while the pipeline is traced (OperatorNotAllowedInGraphError),
# never silently; tests/test_autograph.py checks that every embedded task
# gives the same batches either way.
PLAIN_MODULES = (
    "t5lite",
    "seqio.dataset_providers",
    "seqio.feature_converters",
    "seqio.preprocessors",
    "seqio.vocabularies",
)


def skip_known_code() -> bool:
  """Tells AutoGraph not to rewrite `PLAIN_MODULES`; idempotent.

  TensorFlow has no public API for its conversion rules; this is the one
  place that reaches them. If a TensorFlow release moves them, pipelines are
  built as before, only slower, and tests/test_autograph.py fails.

  Returns:
    True if the rules are in place.
  """
  try:
    from tensorflow.python.autograph.core import config, config_lib
    rules = tuple(config.CONVERSION_RULES)
    present = {getattr(rule, "_prefix", None) for rule in rules
               if isinstance(rule, config_lib.DoNotConvert)}
    config.CONVERSION_RULES = tuple(config_lib.DoNotConvert(module) for module in PLAIN_MODULES
                                    if module not in present) + rules
  except (ImportError, AttributeError, TypeError):
    return False
  return True
