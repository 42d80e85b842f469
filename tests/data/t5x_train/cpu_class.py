"""The CPU a program runs on, as the replays of `t5x_chaos_more.py` record it.

XLA's CPU kernels follow the instruction set and the thread count, so T5X's
bfloat16 run repeats bit for bit on one class of CPU and not on another;
`tests/test_t5x_training.py` compares t5lite with T5X's replay on a CPU
described as the one it runs on, when there is one. No imports beyond the
standard library, so the test reads it without T5X.
"""

import os
import platform


def cpu_description():
  """'<model name>; avx512f=..; avx512_bf16=..; amx_bf16=..; cores=N'."""
  model, flags = platform.processor() or "unknown", set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
        if model != "unknown" and flags:
          break
  except OSError:
    pass
  has = lambda flag: "yes" if flag in flags else "no"  # noqa: E731
  return (
    f"{model}; avx512f={has('avx512f')}; avx512_bf16={has('avx512_bf16')}; "
    f"amx_bf16={has('amx_bf16')}; cores={os.cpu_count()}"
  )
