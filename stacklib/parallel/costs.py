"""How long collectives take on a ring of devices: the alpha-beta model, scaling-book style.

Mirrors no library: it is the back-of-the-envelope model of "How to Scale Your Model"
(the JAX scaling book, part "Sharded Matrices"), written as functions. N devices sit
on a ring; each hop between neighbours costs a latency `alpha` plus `bytes / W`,
where W is one link's bandwidth in one direction. Every algorithm below keeps all
links busy at once, so its time is (hops) x (alpha + bytes per hop / W):

    all-gather of V bytes (the gathered result)      (N - 1) hops of V / N
    reduce-scatter of V bytes (each device's input)  (N - 1) hops of V / N
    all-reduce = reduce-scatter + all-gather         2 (N - 1) hops of V / N
    ppermute of a block of B bytes                    1 hop of B
    all-to-all of V bytes (the whole array)           each link carries V (N - 1) / (2 N)

On a bidirectional ring (TPU ICI links send both ways at once) the data splits
over both directions: hops drop to ceil((N - 1) / 2) for the first three, and an
all-to-all's busiest link carries a quarter of what it does one way. With large
arrays the latency term vanishes and an all-gather costs about V / W whatever N is:
the scaling book's "the time does not depend on the number of devices".

`Collective`s read from compiled HLO (`stacklib.parallel.hlo`) plug straight into
`collective_time`.

Differences from real interconnects:
  * One ring, no contention, no overlap with compute, no per-message software
    overhead beyond `alpha`; a 2-D or 3-D torus runs one ring per axis.
  * Simulated CPU devices have no links at all: their collectives are memory copies
    inside one process, so `fit_link` on CPU measures memory traffic, not a network.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from stacklib.parallel.hlo import Collective


@dataclasses.dataclass(frozen=True)
class Link:
    """A link between neighbouring devices on a ring.

    Attributes:
      bandwidth: bytes per second in one direction (the scaling book's W_ici is the
        bidirectional figure, twice this).
      latency: seconds per hop (alpha), however small the message.
      bidirectional: both directions carry data at once.
    """

    bandwidth: float
    latency: float = 0.0
    bidirectional: bool = False

    def __post_init__(self):
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(
                f"Link needs bandwidth > 0 and latency >= 0 (bytes/s, s); got "
                f"bandwidth={self.bandwidth}, latency={self.latency}."
            )


def _check(num_bytes: float, num_devices: int) -> None:
    if num_devices < 1 or num_bytes < 0:
        raise ValueError(
            f"Need num_devices >= 1 and num_bytes >= 0; got num_devices={num_devices}, "
            f"num_bytes={num_bytes}."
        )


def _ring_hops(num_devices: int, link: Link) -> int:
    steps = num_devices - 1
    return math.ceil(steps / 2) if link.bidirectional else steps


def all_gather_time(num_bytes: float, num_devices: int, link: Link) -> float:
    """Seconds for a ring all-gather whose result is `num_bytes` on every device.

    Rule: hops x (alpha + V / (N W)), hops = N - 1 (one way) or ceil((N - 1) / 2).
    """
    _check(num_bytes, num_devices)
    return _ring_hops(num_devices, link) * (link.latency + num_bytes / num_devices / link.bandwidth)


def reduce_scatter_time(num_bytes: float, num_devices: int, link: Link) -> float:
    """Seconds for a ring reduce-scatter of an array of `num_bytes` on every device.

    The mirror image of an all-gather: the same hops carrying the same 1/N chunks.
    """
    return all_gather_time(num_bytes, num_devices, link)


def all_reduce_time(num_bytes: float, num_devices: int, link: Link) -> float:
    """Seconds for a ring all-reduce of `num_bytes`: a reduce-scatter, then an all-gather.

    Rule: 2 (N - 1) (alpha + V / (N W)) one way; ~2 V / W for large N and V.
    """
    return reduce_scatter_time(num_bytes, num_devices, link) + all_gather_time(num_bytes, num_devices, link)


def ppermute_time(num_bytes: float, link: Link) -> float:
    """Seconds for every device to send `num_bytes` to a neighbour at once: one hop."""
    _check(num_bytes, 1)
    return link.latency + num_bytes / link.bandwidth


def all_to_all_time(num_bytes: float, num_devices: int, link: Link) -> float:
    """Seconds for an all-to-all of an array of `num_bytes` in total (V / N per device).

    Every device sends V / N^2 to each other device along the shortest way round the
    ring. Adding up how far every message travels and sharing that over the links,
    each link carries V (N - 1) / (2 N) one way (~V / 2), or (V / N^2) sum_d min(d,
    N - d) / 2 per direction both ways (~V / 8: the scaling book's V / (4 W_ici)).
    Latency: the farthest message travels N - 1 hops, or N // 2 both ways.
    """
    _check(num_bytes, num_devices)
    n = num_devices
    if n == 1:
        return 0.0
    message = num_bytes / n**2
    if link.bidirectional:
        load = message * sum(min(d, n - d) for d in range(1, n)) / 2
        hops = n // 2
    else:
        load = message * n * (n - 1) / 2
        hops = n - 1
    return hops * link.latency + load / link.bandwidth


def collective_time(collective: Collective, link: Link) -> float:
    """Seconds for one `Collective` (as read from HLO) on a ring of its group size."""
    n = collective.group_size
    if collective.kind == "all-gather":
        return all_gather_time(collective.num_bytes, n, link)
    if collective.kind == "reduce-scatter":
        return reduce_scatter_time(collective.num_bytes, n, link)
    if collective.kind == "all-reduce":
        return all_reduce_time(collective.num_bytes, n, link)
    if collective.kind == "all-to-all":
        return all_to_all_time(collective.num_bytes, n, link)
    if collective.kind == "collective-permute":
        return ppermute_time(collective.num_bytes, link)
    raise ValueError(f"Unknown collective kind {collective.kind!r}.")


def fit_link(num_bytes, seconds) -> Link:
    """The one-way Link whose hop time best fits measured (bytes, seconds) of single hops.

    Least squares on t = alpha + bytes / W over the measurements (e.g. ppermutes of
    several sizes). A negative fitted alpha (noise) is clipped to 0.

    Raises:
      ValueError: fewer than two sizes, or times that do not grow with size.
    """
    x = np.asarray(num_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or len(np.unique(x)) < 2:
        raise ValueError("fit_link needs matching arrays with at least two different sizes.")
    slope, intercept = np.polyfit(x, t, 1)
    if slope <= 0:
        raise ValueError(
            f"The measured times do not grow with size (slope {slope:.3g} s/byte): measure "
            "larger messages, or repeat each measurement more times."
        )
    return Link(bandwidth=1.0 / slope, latency=max(float(intercept), 0.0))
