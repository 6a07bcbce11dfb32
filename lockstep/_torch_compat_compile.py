"""The seam to torch.compile's private internals (see :mod:`lockstep._torch_compat`).

Kept apart from :mod:`lockstep._torch_compat` because ``torch.compiler.disable`` at import
imports Dynamo; only DDP's compile support (``lockstep.ddp.compiled``) imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from lockstep._torch_compat import _missing

__all__ = ["compile_backend_in_effect", "compiled_module_backend"]


# ---- torch.compile ------------------------------------------------------------------------
@torch.compiler.disable(recursive=False)
def compiled_module_backend(module: nn.Module) -> tuple[Any, nn.Module] | None:
    """For a ``torch.compile``-d module: its innermost backend and the original module."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule, innermost_backend
    except ImportError as err:
        raise _missing("torch._dynamo.eval_frame.OptimizedModule/innermost_backend",
                       "find the backend of a compiled module", err) from err
    if not isinstance(module, OptimizedModule):
        return None
    return innermost_backend(cast(Callable[..., Any], module.dynamo_ctx.callback)), module._orig_mod


# Called while Dynamo may be tracing the caller: this frame is skipped (reading the
# frame-evaluation callback is what tracing would break on).
@torch.compiler.disable(recursive=False)
def compile_backend_in_effect() -> Any | None:
    """The backend of the ``torch.compile`` context this call runs in; None when eager."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.eval_frame import innermost_backend
    except ImportError as err:
        raise _missing("torch._C._dynamo.eval_frame.get_eval_frame_callback",
                       "find the torch.compile backend in effect", err) from err
    callback = get_eval_frame_callback()
    if callback is None or isinstance(callback, bool):  # not compiling / compiled code only
        return None
    return innermost_backend(cast(Callable[..., Any], callback))
