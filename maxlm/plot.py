"""Training curves of one or more runs: `python -m maxlm.plot DIR [DIR ...] [--out=PNG]`.

Without `--out` the PNG is `curves.png` in the first DIR, not the current directory: the plot
belongs to a run.

Reads each `DIR/metrics.jsonl` (local or `gs://`, through maxlm/runtime/paths.py) and draws a 2 x 3 grid:
train loss, eval loss, learning rate and tokens/s against the step, one line per run (the legend
is the run directory's name), and the last eval's loss by position in the document
(`eval/loss_by_position/START`: `eval.position_buckets`), which falls with the position while the
model uses its context. Each run also gets a panel of where its wall time went: `goodput` and the
`badput/<category>` shares stacked against the step (maxlm/observe/goodput.py); the first run's fills
the grid's last cell, the others' follow in rows of three. A resumed run repeats some steps in its
file; the last row written for a step is the one drawn, as for every reader of metrics.jsonl.
Rendering uses matplotlib's Agg backend, so no display is needed. A DIR without `metrics.jsonl`
ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import io
import math
import sys

from maxlm import cli
from maxlm.observe import goodput, metrics
from maxlm.runtime import paths
from maxlm.runtime.errors import UserError

DEFAULT_NAME = "curves.png"
# (panel title, metrics.jsonl key), row by row
PANELS = (("train loss", "loss"), ("eval loss", "eval_loss"),
          ("learning rate", "lr"), ("tokens/s", "tokens_per_sec"))


class PlotError(UserError):
    """A run directory that cannot be plotted (exit 2)."""


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, sorted by step, the last row of a repeated step winning;
    "nan"/"inf" strings (how metrics.jsonl writes non-finite floats) become floats."""
    by_step = {int(row["step"]): float(row[key]) for row in rows if key in row}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def loss_by_position(rows: list[dict]) -> tuple[int | None, list[int], list[float]]:
    """(step, buckets' first positions, their losses) of the last row with the loss by position
    (None, [], [] if none has it)."""
    prefix = metrics.LOSS_BY_POSITION + "/"
    for row in reversed(rows):
        buckets = sorted((int(k[len(prefix):]), float(v)) for k, v in row.items() if k.startswith(prefix))
        if buckets:
            return int(row["step"]), [b for b, _ in buckets], [v for _, v in buckets]
    return None, [], []


def _draw_loss_by_position(ax, runs) -> None:
    drawn = False
    for i, (label, rows) in enumerate(runs):
        step, starts, values = loss_by_position(rows)
        if starts:
            ax.plot(starts, values, label=f"{label} (step {step})", color=f"C{i}", marker="o", markersize=3)
            drawn = True
    _finish_panel(ax, "eval loss by position (last eval)", "position in the document (bucket start)", drawn,
                  metrics.LOSS_BY_POSITION)


def wall_time_shares(rows: list[dict]) -> tuple[list[int], dict[str, list[float]]]:
    """(steps, {category: its share of the wall time at each step}) of the rows with `goodput`
    (productive's share) and `badput/<category>`, the last row of a repeated step winning."""
    keys = {"productive": "goodput", **{c: f"badput/{c}" for c in goodput.BADPUT}}
    by_step = {int(row["step"]): row for row in rows if "goodput" in row}
    steps = sorted(by_step)
    return steps, {c: [float(by_step[s].get(key, 0.0)) for s in steps] for c, key in keys.items()}


def _draw_wall_time(ax, label: str, rows: list[dict]) -> None:
    steps, shares = wall_time_shares(rows)
    if steps:
        ax.stackplot(steps, *shares.values(), labels=list(shares), colors=[f"C{i}" for i in range(len(shares))],
                     alpha=0.85)
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of the wall time")
    _finish_panel(ax, f"wall time: {label}", "step", bool(steps), "goodput")


def _finish_panel(ax, title: str, xlabel: str, drawn: bool, key: str) -> None:
    """Title, axis label and grid; a legend, or a note that the runs hold no `key`."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, f"no {key} in metrics.jsonl", ha="center", va="center",
                transform=ax.transAxes, color="gray")


def run_labels(workdirs: list[str]) -> list[str]:
    """Each run's directory name, or the path as given where two names are the same."""
    names = [paths.workdir_path(d).name for d in workdirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, workdirs)]


def plot_runs(workdirs: list[str], out: str) -> None:
    """Draws the runs' curves into the PNG `out` (local or a URL)."""
    try:
        runs = [(label, metrics.read_metrics(d)) for label, d in zip(run_labels(workdirs), workdirs)]
    except FileNotFoundError as e:
        raise PlotError(f"{e} (is it a training run's workdir?)") from None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    extra_rows = (len(runs) + 1) // 3  # rows of three for the wall-time panels after the first run's
    fig, axes = plt.subplots(2 + extra_rows, 3, figsize=(16, 3.75 * (2 + extra_rows)), layout="constrained",
                             squeeze=False)
    _draw_loss_by_position(axes[0, 2], runs)
    wall_time_axes = [axes[1, 2], *axes[2:].flat]
    for ax, (label, rows) in zip(wall_time_axes, runs):
        _draw_wall_time(ax, label, rows)
    for ax in wall_time_axes[len(runs):]:
        ax.axis("off")
    for ax, (title, key) in zip(axes[:, :2].flat, PANELS):
        drawn = False
        for i, (label, rows) in enumerate(runs):
            steps, values = series(rows, key)
            if steps:
                ax.plot(steps, values, label=label, color=f"C{i}",
                        marker="o" if len(steps) < 30 else None, markersize=3)
                drawn = drawn or any(math.isfinite(v) for v in values)
        _finish_panel(ax, title, "step", drawn, key)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    target = paths.workdir_path(out)
    if not paths.is_remote(out):
        target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(buffer.getvalue())


# ----------------------------------------------------------------------------- command line


def main(argv) -> None:
    from absl import flags

    cli.setup_logging()  # quiets matplotlib's INFO lines through absl's handler
    workdirs = argv[1:]
    if not workdirs:
        _error("give one or more run directories: python -m maxlm.plot DIR [DIR ...] [--out=PNG]")
    out = flags.FLAGS.out or default_out(workdirs)
    try:
        plot_runs(workdirs, out)
    except PlotError as e:
        _error(str(e))
    print(f"wrote {paths.workdir_path(out)}")


def default_out(workdirs: list[str]) -> str:
    """Where the plot goes without `--out`: `curves.png` in the first run's directory (a URL's
    too)."""
    return f"{workdirs[0].rstrip('/')}/{DEFAULT_NAME}"


def _error(message: str) -> None:
    print(f"maxlm: plot: {message}", file=sys.stderr)
    sys.exit(2)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("out", "", f"The PNG to write (local path or gs:// URL); default: {DEFAULT_NAME} in the "
                        "first DIR.")


if __name__ == "__main__":
    cli.run(main, define_flags, config_file=False)
