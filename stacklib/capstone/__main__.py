"""`python -m stacklib.capstone [--workdir DIR] [--figure dashboard.png]`: stages 1-6, checked.

Prints one JSON summary and writes the dashboard figure. Exits non-zero if any claim
fails (`CapstoneReport.check`).
"""

from __future__ import annotations

import argparse
import json
import math


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where checkpoints, traces and the artifact go")
    parser.add_argument("--figure", default="capstone_dashboard.png", help="where the dashboard is saved")
    args = parser.parse_args(argv)

    from stacklib import hw

    hw.simulate_cpu_devices(8)  # before JAX starts: stages 1-3 run on a 2 x 2 x 2 mesh

    import matplotlib

    matplotlib.use("Agg")
    from stacklib.capstone import dashboard, run

    report = run.run_all(args.workdir)
    report.check()
    dashboard.plot(report).savefig(args.figure, dpi=120)
    bits = 1 / math.log(2)
    summary = {
        "1_training": {"steps": report.training.config.steps, "first_loss": report.training.losses[0],
                       "final_loss": report.training.losses[-1],
                       "heldout_bits_per_byte": report.training.eval_loss * bits,
                       "goodput": report.training.goodput["step"] / report.training.goodput["wall"]},
        "2_kill_resume": {"killed_after": report.killed.killed_at, "resumed_from": report.resumed.start_step,
                          "bitwise_equal": report.resumed_bitwise},
        "3_profile": {"mfu": report.profile.mfu, "step_seconds": report.profile.step_seconds,
                      "time_shares": report.profile.groups,
                      "top_ops": [(r.key, round(r.fraction, 4)) for r in report.profile.table[:5]]},
        "4_grpo": None if report.post_training is None else report.post_training.summary(),
        "5_int8": {"model": report.served_model, "float_bits_per_byte": report.quant.float_loss * bits,
                   "int8_bits_per_byte": report.quant.int8_loss * bits,
                   "float_accuracy": report.quant.float_accuracy, "int8_accuracy": report.quant.int8_accuracy,
                   "weight_bytes": [report.quant.float_bytes, report.quant.int8_bytes]},
        "6_serving": {"url": report.serving.url, "completions": report.serving.completions,
                      "served_tokens_per_s": report.serving.tokens_per_second,
                      "artifact_bitwise_in_fresh_process": report.export.bitwise,
                      "artifact_generation_equal": report.export.generated_equal},
        "figure": args.figure,
    }
    print(json.dumps(summary, indent=1, default=float), flush=True)


if __name__ == "__main__":
    main()
