"""stacklib.profile against jax.profiler: the same files, the same events read two ways,
and op names that match the compiled program's kernels."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

from stacklib.compile import op_costs
from stacklib.profile import load_trace, load_xplane, op_table, trace


def _mlp(x, w1, w2):
    with jax.named_scope("hidden"):
        h = jax.nn.relu(x @ w1)
    with jax.named_scope("head"):
        return jnp.mean((h @ w2) ** 2)


ARGS = (jnp.ones((64, 128)), jnp.ones((128, 256)), jnp.ones((256, 16)))


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    step = jax.jit(jax.value_and_grad(_mlp, argnums=(1, 2)))
    jax.block_until_ready(step(*ARGS))
    log_dir = tmp_path_factory.mktemp("parity")
    with trace(log_dir) as files:
        for _ in range(2):
            jax.block_until_ready(step(*ARGS))
    return files, step


def test_ours_writes_what_jax_profiler_trace_writes(capture, tmp_path):
    files, step = capture
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        jax.block_until_ready(step(*ARGS))
    (theirs,) = (tmp_path / "plugins" / "profile").iterdir()

    def kinds(folder: pathlib.Path):
        return sorted(path.name.split(".", 1)[-1] if path.name != "perfetto_trace.json.gz" else path.name
                      for path in folder.iterdir())

    assert kinds(files.run_dir) == kinds(theirs) == ["perfetto_trace.json.gz", "trace.json.gz", "xplane.pb"]


@pytest.mark.parametrize("json_file", ["perfetto_json", "trace_json"])
def test_the_json_trace_and_profile_data_give_the_same_op_events(capture, json_file):
    files, _ = capture
    from_json = load_trace(getattr(files, json_file))
    from_xplane = load_xplane(files.xplane)  # jax.profiler.ProfileData reads the protobuf
    def identities(events):
        return [(e.name, e.module, e.run_id) for e in events]

    assert identities(from_json) == identities(from_xplane)
    for ours, theirs in zip(from_json, from_xplane, strict=True):
        # The JSON stores microseconds with 3 decimals (nanoseconds); the protobuf integers of ns.
        assert ours.duration_us == pytest.approx(theirs.duration_us, abs=1e-3)
        assert ours.start_us == pytest.approx(theirs.start_us, abs=1e-3)


def test_op_tables_from_both_readers_agree(capture):
    files, _ = capture
    ours = op_table(load_trace(files.perfetto_json))
    theirs = op_table(load_xplane(files.xplane))
    assert [(r.key, r.count) for r in ours] == [(r.key, r.count) for r in theirs]


def test_every_traced_op_is_a_kernel_of_the_compiled_program(capture):
    files, step = capture
    compiled = step.lower(*ARGS).compile()
    module = compiled.as_text().split()[1].rstrip(",")  # 'HloModule jit_name, ...'
    traced = {e.name for e in load_trace(files.perfetto_json) if e.module == module}
    kernels = set(op_costs(compiled))
    assert traced and traced <= kernels
