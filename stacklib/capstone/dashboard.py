"""The capstone's one figure: loss, goodput, quality per stage, and throughput.

Six panels, each read from a `CapstoneReport` (run.py) and nothing else:

* loss: the uninterrupted run's training loss per step; the killed run's steps, and
  the resumed run's, drawn over it (they coincide: the resume is bitwise); one line at the
  local checkpoint the run resumed from, one at the persistent tier's last before the kill;
* goodput: where each run's wall time went (Goodput's categories, chapter 12);
* where a step's time goes: the profiled step's op time by group (stage 3);
* held-out loss per stage: bits per byte after each stage that changes weights;
* accuracy per stage: the arithmetic task before and after GRPO and after int8 (stage 4,
  where `stacklib.align` is installed);
* throughput: tokens per second of training and of the served engine.
"""

from __future__ import annotations

from typing import Any

GOODPUT_COLORS = {"step": "tab:green", "compile": "tab:orange", "checkpoint": "tab:blue",
                  "input": "tab:purple", "eval": "tab:cyan", "init": "tab:gray", "other": "tab:brown"}


def plot(report: Any):
    """The dashboard of `report` (a `run.CapstoneReport`); returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    _loss(axes[0, 0], report)
    _goodput(axes[0, 1], report)
    _time_shares(axes[0, 2], report)
    _quality(axes[1, 0], report)
    _accuracy(axes[1, 1], report)
    _throughput(axes[1, 2], report)
    fig.suptitle("The whole stack, end to end")
    fig.tight_layout()
    return fig


def _loss(ax, report) -> None:
    whole = report.training.history
    ax.plot([r["step"] for r in whole], [r["loss"] for r in whole], color="black", lw=3, alpha=0.3,
            label="uninterrupted")
    killed = report.killed.records
    ax.plot([r["step"] for r in killed], [r["loss"] for r in killed], "x", color="tab:red",
            label=f"killed after step {report.killed.killed_at} (SIGKILL)")
    resumed = report.resumed.history
    ax.plot([r["step"] for r in resumed], [r["loss"] for r in resumed], ".", color="tab:green",
            label=f"resumed from local checkpoint {report.resumed.start_step} "
                  f"({report.steps_lost_with_local_tier} steps redone)")
    ax.axvline(report.resumed.start_step, color="tab:blue", ls=":", lw=1)
    ax.axvline(report.killed.last_persistent_step, color="tab:gray", ls="--", lw=1,
               label=f"last persistent checkpoint {report.killed.last_persistent_step} "
                     f"({report.steps_lost_without_local_tier} steps without the local tier)")
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title="1-2. Loss: killed and resumed, bitwise")
    ax.legend(fontsize=8)


def _goodput(ax, report) -> None:
    runs = {"uninterrupted": report.training.goodput, "resumed": report.resumed.goodput}
    for row, seconds in enumerate(runs.values()):
        left = 0.0
        for category, color in GOODPUT_COLORS.items():
            ax.barh(row, seconds[category], left=left, color=color, label=category if row == 0 else None)
            left += seconds[category]
        ax.text(left, row, f"  goodput {seconds['step'] / seconds['wall']:.0%}", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), list(runs))
    ax.set(xlabel="wall time (s)", title="1-2. Goodput: where the wall time went")
    ax.set_ylim(-0.6, len(runs) + 0.4)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=4, loc="upper center")


def _time_shares(ax, report) -> None:
    groups = report.profile.groups
    ax.bar([name.replace(" ", "\n") for name in groups], [100 * share for share in groups.values()],
           color="tab:purple")
    for i, share in enumerate(groups.values()):
        ax.text(i, 100 * share, f"{share:.1%}", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="% of op time", title=f"3. Where a step's time goes (MFU {report.profile.mfu:.1%})")


def _accuracy(ax, report) -> None:
    rows = report.accuracy_rows()
    if not rows:
        ax.text(0.5, 0.5, "stage 4 did not run:\nstacklib.align is not installed", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        ax.bar(range(len(rows)), [value for _, value in rows],
               color=["tab:orange" if "int8" in label else "tab:red" for label, _ in rows])
        for i, (_, value) in enumerate(rows):
            ax.text(i, value, f"{value:.1f}%", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
        ax.set_ylim(0, 105)
    ax.set(ylabel="held-out accuracy (%)", title="4-5. Arithmetic task accuracy")


def _quality(ax, report) -> None:
    rows = report.quality_rows()
    labels = [label for label, _, _ in rows]
    values = [value for _, value, _ in rows]
    colors = ["tab:orange" if "int8" in label else "tab:blue" for label in labels]
    bars = ax.bar(range(len(rows)), values, color=colors)
    for bar, (_, value, unit) in zip(bars, rows, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{value:.3g} {unit}", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="bits per byte (lower is better)", title="1-5. Held-out loss per stage")


def _null_formatter():
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _throughput(ax, report) -> None:
    rows = report.throughput_rows()
    ax.barh(range(len(rows)), [value for _, value in rows], color="tab:green")
    for i, (_, value) in enumerate(rows):
        ax.text(value, i, f" {value:,.0f}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_xscale("log")
    values = [value for _, value in rows]
    ax.set_xlim(min(values) / 3, max(values) * 5)  # whole decades, room for the labels
    ax.xaxis.set_minor_formatter(_null_formatter())
    ax.set(xlabel="tokens per second (log scale)", title="1, 3, 6. Throughput")
