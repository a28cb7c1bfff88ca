"""The swap matrix: how a swapped run is compared with ours, and the program under both stacks.

The matrix itself (one run with every component ours, one per component with the real
library, one with all of them) runs once, in chapter 16, whose assertions are the promises
of `stacklib.capstone.swap.TOLERANCE`: bitwise where both libraries are deterministic
functions of the same inputs (data, checkpoint, the int8 weights), float32 rounding where
the computation differs (the flax twin's attention). Running it a second time here would
cost half a minute and check nothing more. These tests check that the comparison can fail:
a swapped run that differs by more than its promise, or whose int8 weights differ, is
reported as such.
"""

import numpy as np
import pytest

from stacklib.capstone import swap

# qwix 0.1.8 reads flax variables with the deprecated `.value`: its warnings are not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


OURS = swap.Stack()
INT8 = {"layers/0/mlp": (np.array([[1, -128]], np.int8), np.array([0.5], np.float32))}


def run(stack=OURS, losses=(3.0, 2.5, 2.0), int8=INT8, quantized_loss=2.1):
    """A made-up run: what `swap.run` returns, with the numbers chosen by the test."""
    return swap.SwapRun(stack, list(losses), [0.01, 0.02, 0.03], restored_at=1, params={},
                        quantized_loss=quantized_loss, float_loss=2.0, int8_weights=int8)


def test_a_bitwise_swap_agrees_only_when_every_loss_is_equal():
    ours = run()
    same = swap.compare("data", ours, run(swap.Stack(data="grain")))
    assert same.agrees and same.bitwise and same.int8_equal and same.max_loss_difference == 0.0
    off = swap.compare("data", ours, run(swap.Stack(data="grain"), losses=(3.0, 2.5, np.nextafter(2.0, 3.0))))
    assert not off.agrees and not off.bitwise and off.max_loss_difference > 0


def test_a_float32_swap_agrees_within_its_tolerance_and_not_beyond():
    ours = run()
    flax = swap.Stack(modules="flax")
    close = swap.compare("modules", ours, run(flax, losses=(3.0, 2.5 * (1 + 1e-6), 2.0)))  # within rtol 2e-5
    assert close.agrees and not close.bitwise
    far = swap.compare("modules", ours, run(flax, losses=(3.0, 2.5 * (1 + 1e-4), 2.0)))
    assert not far.agrees


def test_different_int8_weights_or_scales_are_reported():
    ours = run()
    values = {"layers/0/mlp": (np.array([[1, -127]], np.int8), np.array([0.5], np.float32))}
    scales = {"layers/0/mlp": (np.array([[1, -128]], np.int8), np.array([0.25], np.float32))}
    for weights in (values, scales, {}):
        row = swap.compare("quantization", ours, run(swap.Stack(quantization="qwix"), int8=weights))
        assert row.agrees and not row.int8_equal  # the losses agree; the weights do not
    row = swap.compare("quantization", ours, run(swap.Stack(quantization="qwix"), quantized_loss=2.2))
    assert row.quantized_loss_difference == pytest.approx(0.1)


def test_the_real_libraries_run_under_the_same_names():
    lib = swap.Stack.real().libraries()
    assert {m.__name__.split(".")[0] for m in (lib.grain, lib.optax, lib.ocp, lib.qwix)} == {
        "grain", "optax", "orbax", "qwix"}
    assert lib.nnx.__name__ == "flax.nnx"
    ours = swap.Stack().libraries()
    assert all(m.__name__.startswith("stacklib.") for m in vars(ours).values())
    with pytest.raises(ValueError, match=r"Stack\(optimizer='torch'\): choose 'ours' or 'optax'"):
        swap.Stack(optimizer="torch")


def test_the_table_has_one_line_per_row():
    ours = run()
    rows = [swap.compare("data", ours, run(swap.Stack(data="grain"))),
            swap.compare("modules", ours, run(swap.Stack(modules="flax"), losses=(3.0, 2.5, 2.0001)))]
    table = swap.format_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[2].startswith("| data | grain | 3 | 0.0e+00 | yes | bitwise |")
    assert table[3].startswith("| modules | flax | 3 | 1.0e-04 | no | rtol 2e-05 |")
