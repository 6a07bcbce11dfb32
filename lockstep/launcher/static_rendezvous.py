"""torch's static rendezvous, with the store's host leaving last.

``--rdzv-backend static`` meets machines the way torchrun does: machine 0 (``--node-rank 0``)
hosts a TCP store at ``--master-addr:--master-port`` and every machine knows its rank and the
machine count in advance. lockstep uses torch's handler for that unchanged, wrapped (not
subclassed) to add one thing torch leaves out: an orderly departure.

Without it, machine 0's launcher can pass torch's exit barrier and exit, taking the store
with it, while another machine's launcher is still in that barrier: the other one then prints
a C++ stack trace ("Error waiting on exit barrier") after a job that succeeded. Here every
launcher counts itself out in ``shutdown()``, which torch's ``launch_agent`` calls after the
agent's run, exit barrier included; the host waits, at most :data:`DEPARTURE_WAIT_S`, until
every machine has counted itself out. A machine that died never does, hence the bound.

Why a new backend name works unchanged from torch 2.4 to 2.13 (read in both versions' sources):
the agent takes the workers' ``MASTER_ADDR``/``MASTER_PORT`` from the handler's
``bootstrap_store_info`` whenever the backend is not named ``static`` (torch's launcher
pre-fills them only for that name), and decides whether workers use the launcher's store from
the handler's ``use_agent_store``; both are the inner handler's, so the workers meet at
``--master-addr:--master-port`` on machine 0's store, as under torchrun.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

__all__ = ["DEPARTED_KEY", "DEPARTURE_WAIT_S", "STATIC_BACKEND", "OrderlyStaticRendezvous",
           "create_static_handler"]

logger = logging.getLogger(__name__)

STATIC_BACKEND = "lockstep-static"
DEPARTED_KEY = "lockstep/static/departed"  # in the job's own (run id prefixed) store
DEPARTURE_WAIT_S = 10.0  # how long machine 0 waits for the others to leave
_POLL_S = 0.05


class OrderlyStaticRendezvous(RendezvousHandler):
    """torch's ``StaticTCPRendezvous`` (``inner``), whose machine 0 leaves after the others.

    Everything but :meth:`shutdown` and :meth:`get_backend` is the inner handler's: the same
    store, ranks and bootstrap address (``MASTER_ADDR``/``MASTER_PORT`` of the workers), the
    same agent store for the workers.
    """

    def __init__(self, inner: RendezvousHandler, rank: int, world_size: int,
                 wait_s: float = DEPARTURE_WAIT_S) -> None:
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0 seconds, got {wait_s}")
        self.inner = inner
        self.rank = rank
        self.world_size = world_size
        self.wait_s = wait_s
        self._store: Any = None  # the job's store, once the machines have met

    def get_backend(self) -> str:
        """The registry checks that a handler serves the backend it was asked for."""
        return STATIC_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        self._store = info.store
        return info

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        done = self.inner.shutdown()
        if self._store is not None:
            self.leave(self._store)
        return done

    def leave(self, store: Any) -> int:
        """Count this machine out of ``store``; machine 0 then waits for the rest.

        Returns how many machines had counted themselves out when it returned (machine 0:
        ``world_size`` unless the wait ran out). Never raises: a store that is already gone
        only means there is nobody left to wait for.
        """
        try:
            left = store.add(DEPARTED_KEY, 1)
            if self.rank != 0:
                return left
            deadline = time.monotonic() + self.wait_s
            while left < self.world_size and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                left = store.add(DEPARTED_KEY, 0)
            if left < self.world_size:
                logger.info("%d of %d machines left before the store closed",
                            left, self.world_size)
            return left
        except Exception:
            logger.debug("orderly departure failed", exc_info=True)
            return 0


def create_static_handler(params: RendezvousParameters) -> OrderlyStaticRendezvous:
    """The registry's creator: torch's static handler built from the same parameters."""
    inner = create_rdzv_handler(params)
    rank = int(params.config["rank"])  # create_rdzv_handler has checked it is there
    return OrderlyStaticRendezvous(inner, rank, params.max_nodes)
