"""Former home of the collective debug checks, kept for older imports.

It now lives in :mod:`lockstep.diagnose.collective_checks` (hang detection has one home:
:mod:`lockstep.diagnose`). lockstep itself imports the new home; patch names there, not here.
"""

from lockstep.diagnose.collective_checks import (
    DEBUG_ENV_VAR,
    CollectiveMismatchError,
    check_collective,
    debug_collectives_enabled,
    describe_mismatch,
    odd_ranks,
    signature,
)

__all__ = [
    "DEBUG_ENV_VAR",
    "CollectiveMismatchError",
    "check_collective",
    "debug_collectives_enabled",
    "describe_mismatch",
    "odd_ranks",
    "signature",
]
