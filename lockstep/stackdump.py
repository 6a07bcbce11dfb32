"""Former home of a stuck rank's Python stack on request, kept for older imports.

It now lives in :mod:`lockstep.diagnose.stackdump` (hang detection has one home:
:mod:`lockstep.diagnose`). lockstep itself imports the new home; patch names there, not here.
"""

from lockstep.diagnose.stackdump import STACK_SIGNAL, StackDump, request_stack, stack_file

__all__ = ["STACK_SIGNAL", "StackDump", "request_stack", "stack_file"]
