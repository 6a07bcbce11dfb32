"""Gradient arrivals at a world of one: now :mod:`lockstep.ddp.arrivals` (DDP's side of the profile).

Re-exported here for existing imports (users' and tests').
"""

from __future__ import annotations

from lockstep.ddp.arrivals import GradientArrivals

__all__ = ["GradientArrivals"]
