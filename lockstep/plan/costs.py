"""What one collective costs on a :class:`Topology`, in the alpha-beta model.

Formulas (S bytes per rank, n ranks, alpha seconds per hop, beta bytes/s; Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk
and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009):

* ring all-reduce: ``2(n-1) alpha + 2(n-1)/n * S/beta`` (a reduce-scatter then an all-gather);
* ring reduce-scatter or all-gather: ``(n-1) alpha + (n-1)/n * S/beta``;
* pipelined (double binary) tree all-reduce: ``2 ceil(log2 n) alpha + 2 S/beta`` -- fewer hops,
  the same bytes on the busiest link as the ring, up to the ``(n-1)/n`` factor;
* hierarchical (g GPUs per node, m nodes): reduce-scatter inside the node, all-reduce of the
  node's ``S/g`` shard across nodes on each GPU's share of the node's ports, all-gather inside;
* broadcast of ``S`` bytes from one rank: a binomial tree, ``ceil(log2 n) (alpha + S/beta)``
  (gloo's algorithm; MPICH's for short messages), or a pipelined chain, ``(n-1) alpha + S/beta``
  (NCCL's ring; MPICH's long-message scatter + all-gather has the same bandwidth term).

A flat ring across nodes crosses each node boundary once per ring; with one ring per port its
bandwidth term is limited by the node's total port bandwidth, like the hierarchical scheme, but it
pays ``2(N-1)`` latencies instead of ``2(g-1) + 2(m-1)``. Like NCCL's tuner, :func:`collective`
picks the cheapest algorithm for each message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lockstep.plan.links import Link, Topology

__all__ = [
    "Cost",
    "chain_broadcast",
    "collective",
    "point_to_point",
    "ring_allreduce",
    "ring_shard",
    "tree_allreduce",
    "tree_broadcast",
]

ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
BROADCAST = "broadcast"


@dataclass(frozen=True)
class Cost:
    """Seconds of one collective, split into latency and bandwidth terms, and where they go."""

    seconds: float
    latency_s: float
    bandwidth_s: float
    algorithm: str
    bound_by: str  # "intra" or "inter": the level whose bandwidth term is largest

    @staticmethod
    def zero() -> Cost:
        return Cost(0.0, 0.0, 0.0, "none", "intra")


def _cost(latency: float, bandwidth: float, algorithm: str, bound_by: str) -> Cost:
    return Cost(latency + bandwidth, latency, bandwidth, algorithm, bound_by)


def ring_allreduce(nbytes: float, n: int, link: Link) -> Cost:
    """``2(n-1) alpha + 2(n-1)/n * S/beta``."""
    if n <= 1:
        return Cost.zero()
    return _cost(2 * (n - 1) * link.alpha, 2 * (n - 1) / n * nbytes / link.beta, "ring", "intra")


def tree_allreduce(nbytes: float, n: int, link: Link) -> Cost:
    """``2 ceil(log2 n) alpha + 2 S/beta`` (pipelined tree: reduce up, broadcast down)."""
    if n <= 1:
        return Cost.zero()
    return _cost(2 * math.ceil(math.log2(n)) * link.alpha, 2 * nbytes / link.beta, "tree", "intra")


def ring_shard(nbytes: float, n: int, link: Link) -> Cost:
    """Reduce-scatter or all-gather of ``S`` bytes in total: ``(n-1) alpha + (n-1)/n S/beta``."""
    if n <= 1:
        return Cost.zero()
    return _cost((n - 1) * link.alpha, (n - 1) / n * nbytes / link.beta, "ring", "intra")


def tree_broadcast(nbytes: float, n: int, link: Link) -> Cost:
    """``ceil(log2 n) (alpha + S/beta)``: a binomial tree, every round sends the whole message."""
    if n <= 1:
        return Cost.zero()
    rounds = math.ceil(math.log2(n))
    return _cost(rounds * link.alpha, rounds * nbytes / link.beta, "tree", "intra")


def chain_broadcast(nbytes: float, n: int, link: Link) -> Cost:
    """``(n-1) alpha + S/beta``: a pipelined chain (ring), each link carries the message once."""
    if n <= 1:
        return Cost.zero()
    return _cost((n - 1) * link.alpha, nbytes / link.beta, "ring", "intra")


def point_to_point(nbytes: float, link: Link) -> Cost:
    """One message of ``S`` bytes over one hop."""
    return _cost(link.alpha, nbytes / link.beta, "p2p", "intra")


def _add(a: Cost, b: Cost, algorithm: str, bound_by: str) -> Cost:
    return _cost(a.latency_s + b.latency_s, a.bandwidth_s + b.bandwidth_s, algorithm, bound_by)


def _levels(world: int, topo: Topology) -> tuple[int, int]:
    per_node = min(topo.gpus_per_node, world)
    return per_node, math.ceil(world / per_node)


def _flat_link(world: int, topo: Topology) -> Link:
    """The slowest hop of a ring or tree over all ranks: one node's ports carry its traffic."""
    _per_node, nodes = _levels(world, topo)
    if nodes == 1:
        return topo.intra
    across = topo.across()
    beta = min(topo.intra.beta, topo.node_bandwidth())
    return Link(across.name, max(across.alpha, topo.intra.alpha), beta)


def collective(kind: str, nbytes: float, world: int, topo: Topology,
               hierarchical: bool = True) -> Cost:
    """The cheapest ring, tree or hierarchical schedule of ``kind`` over ``world`` ranks.

    Args:
        kind: ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"`` or ``"broadcast"``.
        nbytes: bytes per rank before the collective (for all-gather: the gathered total; for
            broadcast: the message).
        world: number of ranks, filling nodes of ``topo.gpus_per_node`` in order.
        hierarchical: also consider the hierarchical schedule. NCCL has no such algorithm (its
            tuner picks ring or tree; rings cross each node through its NICs, so their bus
            bandwidth is at most the node's port bandwidth): ``False`` prices what NCCL runs.
    """
    if world <= 1 or nbytes <= 0:
        return Cost.zero()
    per_node, nodes = _levels(world, topo)
    flat = _flat_link(world, topo)
    level = "inter" if nodes > 1 else "intra"
    candidates: list[Cost] = []
    if kind == ALL_REDUCE:
        for c in (ring_allreduce(nbytes, world, flat), tree_allreduce(nbytes, world, flat)):
            candidates.append(_cost(c.latency_s, c.bandwidth_s, c.algorithm, level))
    elif kind in (REDUCE_SCATTER, ALL_GATHER):
        c = ring_shard(nbytes, world, flat)
        candidates.append(_cost(c.latency_s, c.bandwidth_s, "ring", level))
    elif kind == BROADCAST:
        for c in (tree_broadcast(nbytes, world, flat), chain_broadcast(nbytes, world, flat)):
            candidates.append(_cost(c.latency_s, c.bandwidth_s, c.algorithm, level))
        return min(candidates, key=lambda c: c.seconds)  # flat only: no hierarchical variant
    else:
        raise ValueError(f"unknown collective {kind!r}: use all_reduce, reduce_scatter, "
                         "all_gather or broadcast")
    if hierarchical and nodes > 1 and per_node > 1:
        candidates.append(_hierarchical(kind, nbytes, per_node, nodes, topo))
    return min(candidates, key=lambda c: c.seconds)


def _hierarchical(kind: str, nbytes: float, per_node: int, nodes: int, topo: Topology) -> Cost:
    across = topo.across()
    # Each GPU drives its shard across nodes on its share of the node's ports.
    per_gpu = Link(across.name, across.alpha, topo.node_bandwidth() / per_node)
    shard = nbytes / per_node
    inside = ring_shard(nbytes, per_node, topo.intra)
    if kind == ALL_REDUCE:
        between = min(ring_allreduce(shard, nodes, per_gpu), tree_allreduce(shard, nodes, per_gpu),
                      key=lambda c: c.seconds)
        inside = _add(inside, inside, "ring", "intra")  # reduce-scatter + all-gather
    else:
        between = ring_shard(shard, nodes, per_gpu)
    bound = "inter" if between.bandwidth_s >= inside.bandwidth_s else "intra"
    return _add(inside, between, "hierarchical", bound)
