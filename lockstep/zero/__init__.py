"""ZeRO: shard optimizer state (stage 1) and gradients (stage 2) across data-parallel ranks.

``partition`` decides which rank owns which parameter, ``broadcast`` shares the owners' updated
parameters, ``gradients`` reduces each gradient to its owner only, ``state`` converts optimizer
state dicts between a shard and the whole, ``agreement`` checks that every rank gave the
same settings, and ``optimizer`` ties them into
:class:`lockstep.ZeroRedundancyOptimizer`. Paper: Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models" (2020).
"""

from lockstep.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
