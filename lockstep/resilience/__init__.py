"""Keep training through failures: survivors go on in a smaller world, replacements join.

See :class:`~lockstep.resilience.survivors.Survivors` and docs/checkpoints-and-recovery.md.
"""

from lockstep.resilience.survivors import Survivors

__all__ = ["Survivors"]
