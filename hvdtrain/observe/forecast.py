"""How a job will scale over a link, from first principles: the forecast ``hvdtrain bench`` prints.

Inputs, all measured: ``step_seconds`` (T), one optimizer step on one node; ``grad_bytes`` (G),
the gradients one step allreduces (the trainable parameters' bytes); ``link_bytes_per_second``
(B), the allreduce bandwidth between hosts (``hvdtrain doctor``'s bus bandwidth, which is this B
by definition, or the link's measured rate).

A ring allreduce over N nodes sends and receives 2(N-1)/N x G bytes per node, so at best it takes
T_comm(N) = 2(N-1)/N x G / B. Fully overlapped with the backward pass, a step on N nodes then
takes max(T, T_comm(N)), and the scaling factor (N-node throughput over N x the 1-node one) is at
most T / max(T, T_comm(N)): 1.0 where compute is the bottleneck (T >= T_comm), below it where the
link is. fp16 compression halves G. This is an upper bound: latency, the part of the allreduce
that cannot overlap (the last layers' gradients) and a busy core only lower it.
"""

from __future__ import annotations

from dataclasses import dataclass

NODES = (2, 4, 8, 16, 32)
GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Point:
    nodes: int
    step_seconds: float  # T: one step on one node
    comm_seconds: float  # T_comm(N): the ideal ring allreduce of one step's gradients

    @property
    def factor(self) -> float:
        """The scaling limit: T / max(T, T_comm(N))."""
        return self.step_seconds / max(self.step_seconds, self.comm_seconds)

    @property
    def bottleneck(self) -> str:
        return "link" if self.comm_seconds > self.step_seconds else "compute"


def ring_allreduce_seconds(nodes: int, grad_bytes: float, link_bytes_per_second: float) -> float:
    """The ideal ring allreduce's time: 2(N-1)/N x G / B (0 on one node)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if link_bytes_per_second <= 0:
        raise ValueError(f"the link's bandwidth must be > 0 bytes/s, got {link_bytes_per_second}")
    return 2 * (nodes - 1) / nodes * grad_bytes / link_bytes_per_second


def point(step_seconds: float, grad_bytes: float, link_bytes_per_second: float, nodes: int) -> Point:
    if step_seconds <= 0:
        raise ValueError(f"the step time must be > 0 s, got {step_seconds}")
    return Point(nodes, step_seconds, ring_allreduce_seconds(nodes, grad_bytes, link_bytes_per_second))


def scaling_limit(step_seconds: float, grad_bytes: float, link_bytes_per_second: float, nodes: int = 2) -> float:
    """T / max(T, T_comm(N)): the best scaling factor N nodes can reach."""
    return point(step_seconds, grad_bytes, link_bytes_per_second, nodes).factor


def forecast(step_seconds: float, grad_bytes: float, link_bytes_per_second: float,
             nodes: tuple[int, ...] = NODES) -> dict[str, list[Point]]:
    """The limit at each node count, with fp32 gradients and with fp16 compression (G halved)."""
    return {"fp32": [point(step_seconds, grad_bytes, link_bytes_per_second, n) for n in nodes],
            "fp16": [point(step_seconds, grad_bytes / 2, link_bytes_per_second, n) for n in nodes]}


def link_for_compute_bound(step_seconds: float, grad_bytes: float) -> float:
    """Bytes/s at which no node count is link-bound: 2(N-1)/N x G / B <= T for every N, i.e. B >= 2G/T."""
    return 2 * grad_bytes / step_seconds


def bottleneck_words(points: list[Point]) -> str:
    link = [p.nodes for p in points if p.bottleneck == "link"]
    if not link:
        return f"compute at every node count up to {points[-1].nodes}"
    if len(link) == len(points):
        return f"the link from {points[0].nodes} nodes on"
    last = max(p.nodes for p in points if p.bottleneck == "compute")
    return f"compute up to {last} nodes, the link from {link[0]} on"


def format_forecast(step_seconds: float, grad_bytes: float, link_bytes_per_second: float,
                    nodes: tuple[int, ...] = NODES, prefix: str = "forecast: ") -> list[str]:
    """The forecast as lines: the inputs, a row per gradient format, the bottleneck, the link needed."""
    table = forecast(step_seconds, grad_bytes, link_bytes_per_second, nodes)
    gbit = link_bytes_per_second / GBIT
    lines = [f"{prefix}scaling limit over a {gbit:.3g} Gbit/s link: step {step_seconds:.3f} s on one node, "
             f"{grad_bytes / 1e6:.1f} MB of fp32 gradients, ring allreduce fully overlapped with backward "
             f"(an upper bound)",
             f"{prefix}{'nodes':<6}" + "".join(f"{n:>7}" for n in nodes)]
    for name, points in table.items():
        lines.append(f"{prefix}{name:<6}" + "".join(f"{p.factor:>7.2f}" for p in points))
    for name, points in table.items():
        lines.append(f"{prefix}bottleneck, {name}: {bottleneck_words(points)}")
    need = link_for_compute_bound(step_seconds, grad_bytes) / GBIT
    lines.append(f"{prefix}compute-bound at any node count from {need:.3g} Gbit/s (fp32) or {need / 2:.3g} "
                 f"Gbit/s (fp16) between hosts")
    return lines
