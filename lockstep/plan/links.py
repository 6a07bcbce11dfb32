"""Links as data: latency (alpha) and bandwidth (beta) per level, with presets for common hardware.

A :class:`Link` is the alpha-beta model of one level of the network (Hockney, "The communication
challenge for MPP", Parallel Computing 1994): sending ``S`` bytes one hop costs
``alpha + S / beta``. A :class:`Topology` joins an inside-node link (``gpus_per_node`` GPUs) and
an across-nodes link (``nics_per_node`` ports per node).

Spec strings, as ``lockstep plan --link`` takes them::

    nvlink4:8,ib-ndr400        8 GPUs per node on NVLink 4, nodes on NDR InfiniBand, one NIC per GPU
    pcie4:4,roce25x1           4 GPUs per node on PCIe 4, one 25 Gb/s RoCE port per node
    roce100                    one GPU per node, nodes on 100 Gb/s RoCE
    5us@12.5GB/s:2,eth10       literal alpha@bandwidth instead of a preset name

Bandwidths are line rates per direction of one port or GPU, from the vendors' specifications (the
sources are listed in docs/plan.md); alphas are typical per-hop software+wire latencies, an
assumption that ``--measure-link`` or a literal ``ALPHA@BW`` replaces.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

__all__ = ["PRESETS", "Link", "Topology", "format_bytes_per_s", "parse_link", "parse_topology"]


@dataclass(frozen=True)
class Link:
    """One level of the network: ``alpha`` seconds per hop, ``beta`` bytes/s per direction.

    ``cpu_share``: for a CPU backend, the shares of a collective's latency and bandwidth terms
    that are work of the rank's own CPU (gloo's copies into and out of sockets and its sums),
    the rest being waits; measured by :func:`~lockstep.plan.measure.measure_link`. ``None``:
    unknown, counted as all CPU work. Only ``PlanOptions.cpu_cores`` uses it.
    """

    name: str
    alpha: float
    beta: float
    source: str = ""
    cpu_share: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not self.alpha >= 0:
            raise ValueError(f"link {self.name!r}: alpha must be >= 0 seconds, got {self.alpha}")
        if not self.beta > 0:
            raise ValueError(f"link {self.name!r}: beta must be > 0 bytes/s, got {self.beta}")
        if self.cpu_share is not None and (
                len(self.cpu_share) != 2 or not all(x >= 0 for x in self.cpu_share)):
            raise ValueError(f"link {self.name!r}: cpu_share must be two shares >= 0 (latency, "
                             f"bandwidth), got {self.cpu_share}")

    def scaled(self, efficiency: float) -> Link:
        """The same link delivering ``efficiency`` of its bandwidth (0 < efficiency <= 1)."""
        if not 0 < efficiency <= 1:
            raise ValueError(f"link efficiency must be in (0, 1], got {efficiency}")
        return replace(self, beta=self.beta * efficiency)


def _gbit(x: float) -> float:
    return x * 1e9 / 8


# name -> Link. Bandwidth: per direction, per GPU (NVLink, PCIe x16) or per port (NIC).
PRESETS: dict[str, Link] = {
    link.name: link
    for link in [
        # NVLink 2 (V100 SXM2): 150 GB/s each way per GPU (six 25 GB/s links; docs/plan.md).
        Link("nvlink2", 3e-6, 150e9, "V100-SXM2: NVLink 150 GB/s one way (Dell EMC DL guide)"),
        # NVLink 3 (A100): 600 GB/s total bidirectional per GPU -> 300 GB/s each way.
        Link("nvlink3", 3e-6, 300e9, "NVIDIA A100 datasheet: NVLink 600 GB/s"),
        # NVLink 4 (H100 SXM): 900 GB/s total bidirectional per GPU -> 450 GB/s each way.
        Link("nvlink4", 3e-6, 450e9, "NVIDIA H100 datasheet: NVLink 900 GB/s"),
        # PCIe x16: 16 GT/s (gen 4) and 32 GT/s (gen 5) per lane, 128b/130b encoding.
        Link("pcie3", 5e-6, 15.75e9, "PCI-SIG PCIe 3.0: 8 GT/s x16"),
        Link("pcie4", 5e-6, 31.5e9, "PCI-SIG PCIe 4.0: 16 GT/s x16"),
        Link("pcie5", 5e-6, 63e9, "PCI-SIG PCIe 5.0: 32 GT/s x16"),
        Link("ib-edr100", 5e-6, _gbit(100), "InfiniBand EDR: 4x 25 Gb/s lanes, 100 Gb/s"),
        Link("ib-hdr200", 5e-6, _gbit(200), "NVIDIA ConnectX-6: HDR 200 Gb/s"),
        Link("ib-ndr400", 5e-6, _gbit(400), "NVIDIA ConnectX-7: NDR 400 Gb/s"),
        Link("roce25", 8e-6, _gbit(25), "25 GbE RoCE (IEEE 802.3by)"),
        Link("roce100", 8e-6, _gbit(100), "100 GbE RoCE (IEEE 802.3)"),
        Link("roce200", 8e-6, _gbit(200), "200 GbE RoCE (IEEE 802.3bs)"),
        Link("roce400", 8e-6, _gbit(400), "400 GbE RoCE (IEEE 802.3bs)"),
        Link("eth10", 30e-6, _gbit(10), "10 GbE TCP (IEEE 802.3ae)"),
        Link("eth25", 30e-6, _gbit(25), "25 GbE TCP (IEEE 802.3by)"),
        Link("eth100", 30e-6, _gbit(100), "100 GbE TCP (IEEE 802.3)"),
    ]
}
_ALIASES = {"ib-hdr": "ib-hdr200", "ib-ndr": "ib-ndr400", "hdr": "ib-hdr200", "ndr": "ib-ndr400",
            "edr": "ib-edr100",
            "nvlink": "nvlink4"}

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_BW_UNITS = {"b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
             "gbit/s": 1e9 / 8, "gbps": 1e9 / 8, "mbit/s": 1e6 / 8}
_LITERAL = re.compile(r"^([0-9.eE+-]+)(s|ms|us|ns)@([0-9.eE+-]+)([a-zA-Z/]+)$")


def parse_link(text: str, extra: Mapping[str, Link] | None = None) -> Link:
    """A preset name (``ib-ndr400``), a name in ``extra`` (``measured``) or a literal
    ``ALPHA@BANDWIDTH`` (``5us@25GB/s``)."""
    key = text.strip().lower()
    key = _ALIASES.get(key, key)
    if extra and key in extra:
        return extra[key]
    if key == "measured":
        raise ValueError("link 'measured' names a measurement, and there is none: add "
                         "--measure-link, or use a profile that carries a 'link' field")
    if key in PRESETS:
        return PRESETS[key]
    match = _LITERAL.match(text.strip())
    if match:
        alpha = float(match.group(1)) * _UNITS[match.group(2)]
        unit = match.group(4).lower()
        if unit not in _BW_UNITS:
            raise ValueError(f"link {text!r}: unknown bandwidth unit {match.group(4)!r}; "
                             f"use one of {', '.join(_BW_UNITS)}")
        return Link(text.strip(), alpha, float(match.group(3)) * _BW_UNITS[unit], "given")
    raise ValueError(f"unknown link {text!r}: use a preset ({', '.join(sorted(PRESETS))}) "
                     f"or a literal like 5us@25GB/s")


@dataclass(frozen=True)
class Topology:
    """GPUs in nodes: ``intra`` joins the ``gpus_per_node`` GPUs of a node, ``inter`` the nodes.

    ``nics_per_node`` ports of ``inter`` leave each node (a DGX H100 has one per GPU); the
    across-nodes bandwidth one GPU can use is ``inter.beta * nics_per_node / gpus_per_node``.
    """

    intra: Link
    gpus_per_node: int = 1
    inter: Link | None = None
    nics_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus per node must be >= 1, got {self.gpus_per_node}")
        if self.nics_per_node is not None and self.nics_per_node < 1:
            raise ValueError(f"NICs per node must be >= 1, got {self.nics_per_node}")

    @property
    def nics(self) -> int:
        return self.nics_per_node if self.nics_per_node is not None else self.gpus_per_node

    def across(self) -> Link:
        """The link between nodes (the inside link when none was given: one big node)."""
        return self.inter if self.inter is not None else self.intra

    def node_bandwidth(self) -> float:
        """Bytes/s leaving one node for the others, over all its ports."""
        return self.across().beta * self.nics

    def scaled(self, efficiency: float) -> Topology:
        inter = self.inter.scaled(efficiency) if self.inter is not None else None
        return replace(self, intra=self.intra.scaled(efficiency), inter=inter)

    def describe(self) -> str:
        text = f"{self.gpus_per_node} GPU/node on {_describe(self.intra)}"
        if self.inter is not None:
            text += f"; nodes on {_describe(self.inter)} x{self.nics} per node"
        return text


def _describe(link: Link) -> str:
    return f"{link.name} (alpha {link.alpha * 1e6:g} us, beta {format_bytes_per_s(link.beta)})"


def format_bytes_per_s(value: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} B/s"


def parse_topology(spec: str, extra: Mapping[str, Link] | None = None) -> Topology:
    """``INTRA[:GPUS_PER_NODE][,INTER[xNICS]]``, e.g. ``nvlink4:8,ib-ndr400`` (see module doc).

    One link alone means one GPU per node (``roce100``) unless it carries ``:GPUS`` (one node of
    that many GPUs joined by it, and the same link between such nodes).
    """
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"--link {spec!r}: give INTRA[:GPUS_PER_NODE][,INTER[xNICS]], "
                         "e.g. nvlink4:8,ib-ndr400")
    first, _, gpus = parts[0].rpartition(":") if ":" in parts[0] else (parts[0], "", "")
    try:
        per_node = int(gpus) if gpus else 1
    except ValueError:
        raise ValueError(f"--link {spec!r}: GPUs per node must be an integer, got {gpus!r}") from None
    intra = parse_link(first, extra)
    if len(parts) == 1:
        return Topology(intra, per_node, None if per_node == 1 else intra, None)
    inter_text, nics = parts[1], None
    match = re.match(r"^(.*)x([0-9]+)$", inter_text)
    if match and match.group(1).lower().rstrip() not in ("",):
        try:
            parse_link(match.group(1), extra)
            inter_text, nics = match.group(1), int(match.group(2))
        except ValueError:
            pass
    return Topology(intra, per_node, parse_link(inter_text, extra), nics)
