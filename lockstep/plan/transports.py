"""Achievable bandwidth per transport: what NCCL really gets out of a link, not its line rate.

A :class:`Transport` is a range of *achievable efficiency* (the large-message bus bandwidth of an
all-reduce divided by the line rate) and a range of *per-message cost* (the intercept of an
all-reduce's time against its size: kernel launch, protocol handshakes, proxy thread). Together
they give an efficiency curve over message size::

    efficiency(S) = e_max * S / (S + per_message * e_max * beta)

which is the alpha-beta model's curve with the measured intercept. Every number below is read
from a public nccl-tests result; docs/plan.md quotes the sentence each comes from. A preset link
names its transport (``eth25`` is TCP sockets, ``roce25`` RDMA over the same port), a literal or
measured link none (it is already what was achieved).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from lockstep.plan.links import Link, Topology

__all__ = ["BOUNDS", "TRANSPORTS", "Transport", "achievable", "efficiency_at", "transport_of"]

# "optimistic" takes each input at the end that makes the step shortest, "pessimistic" the other.
BOUNDS = ("optimistic", "expected", "pessimistic")


@dataclass(frozen=True)
class Transport:
    """Efficiency (low, expected, high) of the line rate and per-message cost (low, expected,
    high) in seconds, with where they come from."""

    name: str
    efficiency: tuple[float, float, float]
    per_message: tuple[float, float, float]
    source: str

    def __post_init__(self) -> None:
        lo, mid, hi = self.efficiency
        if not 0 < lo <= mid <= hi <= 1:
            raise ValueError(f"transport {self.name!r}: efficiency must be 0 < low <= expected "
                             f"<= high <= 1, got {self.efficiency}")
        a, b, c = self.per_message
        if not 0 <= a <= b <= c:
            raise ValueError(f"transport {self.name!r}: per-message cost must be 0 <= low <= "
                             f"expected <= high seconds, got {self.per_message}")

    def at(self, bound: str) -> tuple[float, float]:
        """(efficiency, per-message seconds) at ``bound`` (one of :data:`BOUNDS`)."""
        i = _index(bound)
        return self.efficiency[2 - i], self.per_message[i]


def _index(bound: str) -> int:
    if bound not in BOUNDS:
        raise ValueError(f"unknown bound {bound!r}: use one of {', '.join(BOUNDS)}")
    return BOUNDS.index(bound)


TRANSPORTS: dict[str, Transport] = {t.name: t for t in [
    # Kernel TCP sockets: copies through host memory and the socket stack on the CPU.
    # NVIDIA/nccl#450: 100 Gb/s TCP, "the best performance (bus-bw) is between 4~6GB/s" (0.32-0.48);
    # NVIDIA/nccl#209: on 100 Gb/s "iperf3: 92 Gbps", NCCL 41 Gbps (0.41; iperf's 0.92 the ceiling).
    # Expected: the median of 0.32, 0.48, 0.41 and 0.92 is 0.445, rounded to 0.45.
    # Per message: NVIDIA/nccl-tests#82, TCP sockets, 8-byte broadcast 38.17-45.82 us.
    Transport("tcp", (0.32, 0.45, 0.92), (38e-6, 46e-6, 67e-6),
              "NVIDIA/nccl#450, NVIDIA/nccl#209, NVIDIA/nccl-tests#82"),
    # RDMA (InfiniBand or RoCE) with GPUDirect: NVIDIA/nccl-tests#29 "12.2 GB/s (for a 100Gbps
    # card) is as good as you can get" (0.976); NVIDIA/nccl#412 "24GB/s inter-node" on 200G HDR
    # (0.96) and "If the NIC is attached to the CPU getting 16 GB/s is normal" (0.64).
    # Per message: nccl-tests#182/nccl#1244 small-message floor ~46-47 us; nccl-tests#232's
    # 2-32 MB rows give an intercept of about 67 us (113.2 us at 2 MB, 812.3 us at 32 MB).
    Transport("rdma", (0.64, 0.96, 0.976), (46e-6, 47e-6, 67e-6),
              "NVIDIA/nccl-tests#29, NVIDIA/nccl#412, NVIDIA/nccl#1244, NVIDIA/nccl-tests#232"),
    # NVLink: NVIDIA/nccl#412 "~160GB/s intra-node" on A800 (NVLink 400 GB/s both ways: 0.8);
    # NVIDIA/nccl-tests#212, the maintainer on H100: "450GB/s is the line rate. With the protocol
    # overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" (0.82) and, with
    # NVLink SHARP, "On 8 GPUs, you should reach a peak busBw of ~480GB/s" (above the line: the
    # high end, capped at 1.0). The per-message cost is the RDMA floor's low end (assumed).
    Transport("nvlink", (0.8, 0.8, 1.0), (10e-6, 20e-6, 46e-6),
              "NVIDIA/nccl#412, NVIDIA/nccl-tests#212; per-message cost assumed"),
    # PCIe. NCCL's own topology model prices a x16 link at 3/4 of its line rate (src/graph/topo.h:
    # "#define PCI_BW 12.0 // PCI Gen3 x16", 12 of 15.75 GB/s: 0.76; src/graph/topo.cc gives a
    # link width * kvDictPciGen / 80, "8 GT/s" 60, "16 GT/s" 120, "32 GT/s" 240: 12 / 24 / 48
    # GB/s for x16 Gen3 / 4 / 5, the same 0.76 of 15.75 / 31.5 / 63) and GPU-to-GPU traffic through an Intel host bridge at a fifth more bytes
    # ("INTEL_P2P_OVERHEAD(bw) (bw*6/5)": 0.635). NVIDIA/nccl#1639, 8 RTX 5090 on PCIe 5
    # (63 GB/s): "8 GPU max performance : bwbus 28GB/s" (0.44), "4GPU max performance : bwbus
    # 35GB/s" (0.56); the maintainer: "On PCI systems, the performance you get is usually
    # determined by the bandwidth your CPU and memory can deliver". NVIDIA/nccl-tests#232, one
    # GPU's PCIe 5 link binding a 2-node all-reduce: 0.67 of it at 32 MB (a lower bound on the
    # large-message figure). Range: min / median / max of the five. The per-message cost is
    # NVLink's (no PCIe figure).
    Transport("pcie", (0.44, 0.635, 0.76), (10e-6, 20e-6, 46e-6),
              "NCCL src/graph/topo.h (PCI_BW, INTEL_P2P_OVERHEAD), NVIDIA/nccl#1639, "
              "NVIDIA/nccl-tests#232"),
]}

_BY_PREFIX = (("eth", "tcp"), ("roce", "rdma"), ("ib-", "rdma"), ("nvlink", "nvlink"),
              ("pcie", "pcie"))


def transport_of(link: Link, table: Mapping[str, Transport] | None = None) -> Transport | None:
    """The transport a preset link runs on (``None`` for a literal or measured link), looked up
    in ``table`` (default :data:`TRANSPORTS`)."""
    for prefix, name in _BY_PREFIX:
        if link.name.startswith(prefix) and link.source != "given" and not link.name.startswith(
                "measured"):
            return (table or TRANSPORTS)[name]
    return None


def efficiency_at(link: Link, nbytes: float, bound: str = "expected") -> float:
    """Achieved bus bandwidth / line rate for one message of ``nbytes`` on ``link``."""
    t = transport_of(link)
    if t is None or nbytes <= 0:
        return 1.0 if t is None else 0.0
    e_max, per_message = t.at(bound)
    return e_max * nbytes / (nbytes + per_message * e_max * link.beta)


def _derate(link: Link, bound: str, table: Mapping[str, Transport] | None) -> tuple[Link, float]:
    t = transport_of(link, table)
    if t is None:
        return link, 0.0
    e_max, per_message = t.at(bound)
    return replace(link, beta=link.beta * e_max), per_message


def achievable(topo: Topology, bound: str = "expected",
               table: Mapping[str, Transport] | None = None) -> tuple[Topology, float]:
    """``topo`` with every preset link at its transport's achievable bandwidth, and the
    per-message cost to add to each collective (the larger of the two levels')."""
    intra, a = _derate(topo.intra, bound, table)
    inter, b = _derate(topo.inter, bound, table) if topo.inter is not None else (None, 0.0)
    return replace(topo, intra=intra, inter=inter), max(a, b)
