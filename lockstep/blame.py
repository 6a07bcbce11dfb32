"""Former home of the peer watch and the blame file, kept for older imports.

It now lives in :mod:`lockstep.diagnose.blame` (hang detection has one home:
:mod:`lockstep.diagnose`). lockstep itself imports the new home; patch names there, not here.
"""

from lockstep.diagnose.blame import BLAME_FILE, observe_peers, read_blame, write_blame

__all__ = ["BLAME_FILE", "observe_peers", "read_blame", "write_blame"]
