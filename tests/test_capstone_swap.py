"""The swap matrix: the same program with ours and with each real library swapped in.

One run with every component ours, then one per component with the real library (grain,
flax.nnx, optax, orbax, qwix), and one with all of them at once. Each promise is in
`stacklib.capstone.swap.TOLERANCE` and its docstring: bitwise where both libraries are
deterministic functions of the same inputs (data, checkpoint, the int8 weights), float32
rounding where the computation differs (the flax twin's attention). Step time ratios are
printed, never asserted (timings depend on the machine's load).
"""

import numpy as np
import pytest

from stacklib.capstone import swap
from stacklib.llm.config import load_config

# qwix 0.1.8 reads flax variables with the deprecated `.value`: its warnings are not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIG = dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=32,
              seq_len=32, batch_size=8, steps=8, warmup_steps=2, max_corpus_bytes=200_000, eval_batches=2,
              progress=False)


@pytest.fixture(scope="module")
def matrix():
    return swap.swap_matrix(load_config(None, **CONFIG))


def test_every_swap_agrees_with_ours_as_promised(matrix):
    ours, rows = matrix
    print("\n" + swap.format_table(rows))
    assert [r.component for r in rows] == [*swap.COMPONENTS, "all"]
    assert ours.losses[-1] < ours.losses[0] - 0.5  # the program learns
    assert ours.restored_at == 4  # half way through, every run went through its checkpoint library
    for row in rows:
        assert row.agrees, row


@pytest.mark.parametrize("component", ["data", "checkpoint", "optimizer", "quantization"])
def test_deterministic_swaps_give_bitwise_equal_losses_and_int8_weights(matrix, component):
    _, rows = matrix
    row = next(r for r in rows if r.component == component)
    assert row.bitwise and row.max_loss_difference == 0.0
    assert row.int8_equal and row.quantized_loss_difference == 0.0


def test_flax_modules_agree_within_float32_and_still_quantize_alike(matrix):
    _, rows = matrix
    for row in (r for r in rows if r.component in ("modules", "all")):
        assert row.max_loss_difference < 1e-4
        assert row.quantized_loss_difference < 1e-3  # int8 rounding of slightly different weights


def test_the_real_libraries_run_under_the_same_names():
    lib = swap.Stack.real().libraries()
    assert {m.__name__.split(".")[0] for m in (lib.grain, lib.optax, lib.ocp, lib.qwix)} == {
        "grain", "optax", "orbax", "qwix"}
    assert lib.nnx.__name__ == "flax.nnx"
    ours = swap.Stack().libraries()
    assert all(m.__name__.startswith("stacklib.") for m in vars(ours).values())
    with pytest.raises(ValueError, match=r"Stack\(optimizer='torch'\): choose 'ours' or 'optax'"):
        swap.Stack(optimizer="torch")


def test_the_table_has_one_line_per_row(matrix):
    _, rows = matrix
    table = swap.format_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| data | grain | 8 |")
    assert np.isfinite([r.step_time_ratio for r in rows]).all()
