"""Former home of the rendezvous reports, kept so that older imports keep working.

What the rendezvous says while waiting, at its timeout and when machines join or leave now
lives in :mod:`lockstep.launcher.rendezvous_report`, named apart from the checkpoint's
agreement between ranks, :mod:`lockstep.checkpoint.meeting`.
"""

from __future__ import annotations

from lockstep.launcher.rendezvous_report import (
    REPORT_INTERVAL_ENV_VAR,
    Meeting,
    Member,
    RoundView,
    Visitor,
    describe_machine,
    rank_ranges,
    report_interval,
    say_on_stderr,
)

__all__ = [
    "REPORT_INTERVAL_ENV_VAR",
    "Meeting",
    "Member",
    "RoundView",
    "Visitor",
    "describe_machine",
    "rank_ranges",
    "report_interval",
    "say_on_stderr",
]
