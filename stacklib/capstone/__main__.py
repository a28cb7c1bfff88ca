"""`python -m stacklib.capstone [--workdir DIR] [--figure dashboard.png]`: stages 1-6, checked.

Prints one JSON summary and writes the dashboard figure. Exits with status 1 if a claim
fails (`CapstoneReport.check`), 2 on a usage mistake (checked before the run starts).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

FIGURE_FORMATS = (".png", ".pdf", ".svg", ".jpg")


def main(argv: list[str] | None = None) -> int:
    """Run the capstone; exit 0 when every claim holds, 1 when one fails, 2 on a usage mistake."""
    parser = argparse.ArgumentParser(prog="python -m stacklib.capstone", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, type=pathlib.Path,
                        help="a new or empty folder for checkpoints, traces and the artifact (default: a "
                             "temporary folder)")
    parser.add_argument("--figure", default="capstone_dashboard.png", type=pathlib.Path,
                        help=f"where the dashboard is saved, as {'/'.join(FIGURE_FORMATS)} "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    # Checked before the two-minute run, not after it.
    if args.figure.suffix.lower() not in FIGURE_FORMATS:
        parser.error(f"--figure {str(args.figure)!r}: give a file name ending in one of "
                     f"{', '.join(FIGURE_FORMATS)}.")
    if not args.figure.parent.resolve().is_dir():
        parser.error(f"--figure {str(args.figure)!r}: the folder {str(args.figure.parent)!r} does not exist.")
    if args.workdir is not None and args.workdir.exists() and (
            not args.workdir.is_dir() or any(args.workdir.iterdir())):
        parser.error(f"--workdir {str(args.workdir)!r} is not an empty folder: a previous run's checkpoints "
                     "would be resumed instead of trained. Give a new or empty folder.")

    from stacklib import hw

    hw.simulate_cpu_devices(8)  # before JAX starts: stages 1-3 run on a 2 x 2 x 2 mesh

    import matplotlib

    matplotlib.use("Agg")
    from stacklib.capstone import dashboard, run
    from stacklib.capstone.claims import ClaimFailed

    report = run.run_all(args.workdir)
    try:
        report.check()
    except ClaimFailed as failed:
        print(f"python -m stacklib.capstone: a claim failed: {failed}", file=sys.stderr)
        return 1
    dashboard.plot(report).savefig(args.figure, dpi=120)
    bits = 1 / math.log(2)
    summary = {
        "1_training": {"steps": report.training.config.steps, "first_loss": report.training.losses[0],
                       "final_loss": report.training.losses[-1],
                       "heldout_bits_per_byte": report.training.eval_loss * bits,
                       "goodput": report.training.goodput["step"] / report.training.goodput["wall"]},
        "2_kill_resume": {"killed_after": report.killed.killed_at, "resumed_from": report.resumed.start_step,
                          "last_persistent_checkpoint": report.killed.last_persistent_step,
                          "steps_lost_with_local_tier": report.steps_lost_with_local_tier,
                          "steps_lost_without_local_tier": report.steps_lost_without_local_tier,
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
        "figure": str(args.figure),
    }
    print(json.dumps(summary, indent=1, default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
