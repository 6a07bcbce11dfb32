"""Pipeline (model) parallelism: split a model into stages and pipeline its micro-batches.

``schedule`` holds GPipe and 1F1B as plain data; ``partition`` cuts a model into stages;
``stage`` runs one stage's forwards and backwards; ``local`` plays a schedule with every stage
in this process; ``comms`` and ``ranks`` play it with one stage per rank; ``pipe`` is the
public :class:`Pipeline`.
"""

from lockstep.pipeline.pipe import Pipeline
from lockstep.pipeline.schedule import (
    format_schedule,
    format_timeline,
    gpipe,
    one_f_one_b,
)

__all__ = ["Pipeline", "format_schedule", "format_timeline", "gpipe", "one_f_one_b"]
