"""Checkpoints that lose nothing: atomic, checksummed, safe to load, resumable at any world size.

``manager`` is the public API (:class:`Checkpointer`); ``meeting`` is where ranks meet and what
they must agree on; ``directory`` names, lists and prunes checkpoints; ``writing`` writes one
(staging, checksummed files, publish); ``snapshot`` copies the state into reused host buffers
and ``background`` writes that copy in a thread (asynchronous saves); ``budget`` paces them to
a share of the loop's time (``max_overhead``); ``loading`` verifies one
and loads it into objects; ``state`` knows what each object holds; ``io`` knows how bytes reach
the disk and come back.
"""

from lockstep.checkpoint.io import CheckpointError, load_file
from lockstep.checkpoint.manager import Checkpointer, Restored
from lockstep.checkpoint.state import load_model_state, load_weights, unwrap_model

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Restored",
    "load_file",
    "load_model_state",
    "load_weights",
    "unwrap_model",
]
