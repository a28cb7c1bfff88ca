"""stacklib.parallel's ring all-reduce (2 (N - 1) ppermutes) against XLA's own psum, on 8 CPU devices.

Run alone (`make bench ONLY=parallel`): the 8 simulated devices must be configured before
JAX starts, so if another benchmark started JAX first in the same process, this one uses
the CPU devices it finds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.timing import median_seconds, print_ratio
from stacklib import hw, parallel


def main(scale: float = 1.0) -> None:
    devices = hw.simulate_cpu_devices(8)  # each benchmark runs in a fresh process
    mesh = parallel.make_mesh((len(devices),), ("i",), (AxisType.Auto,), devices=devices)

    def compiled(reduce):
        return jax.jit(jax.shard_map(lambda block: reduce(block, "i"), mesh=mesh, in_specs=P("i"),
                                     out_specs=P("i"), check_vma=False))

    ours, theirs = compiled(parallel.ring_psum), compiled(jax.lax.psum)
    for per_device_bytes in (2**14, 2**18, 2**22):
        elements = max(len(devices), int(per_device_bytes * scale) // 4)
        x = jax.device_put(jnp.ones((len(devices), elements)), NamedSharding(mesh, P("i")))
        ours_s = median_seconds(lambda x=x: ours(x).block_until_ready())
        theirs_s = median_seconds(lambda x=x: theirs(x).block_until_ready())
        print_ratio(f"all-reduce of {elements * 4:,} bytes per device on {len(devices)} devices",
                    ours_s, theirs_s, "jax.lax.psum")


if __name__ == "__main__":
    main()
