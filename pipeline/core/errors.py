"""The one base class for errors a user can act on.

A :class:`PipelineError`'s message names the thing that is wrong and the fix; the command line
prints it without a traceback and exits with status 2. Completed work is never deleted on one.
"""


class PipelineError(Exception):
    """An error whose message names the problem and the fix."""
