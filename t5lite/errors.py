"""Errors in what the user gave t5lite: one line and exit status 2.

t5lite raises `UserError` on purpose where it checks the user's input: flags,
gin files and bindings, the run's settings against the model, the mesh and
the data, checkpoints, vocabularies and input files. The console scripts
print it as one line naming the problem and the fix, and exit with status 2.
Any other exception is a bug, in t5lite or in a library, and shows its
traceback (exit status 1): a shape error hours into training must never read
like a typo.

A `ValueError`, so that Python code calling t5lite and catching
`ValueError` for bad arguments keeps working.
"""


class UserError(ValueError):
  """Input the user got wrong; the message names the problem and the fix."""
