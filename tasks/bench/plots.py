"""PNG plots of a benchmark run: speed-up per shape, and the trend over history.

Plots are a side report: any failure here is logged as a warning and the
run goes on (a missing font must not fail a nightly).
"""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.fsutil import atomic_write_bytes
from kiln.tasks.bench.results import BenchResults, CaseResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_log = logging.getLogger(__name__)

EMBED_LIMIT = 400_000  # bytes; larger PNGs are linked rather than inlined into a markdown artifact


def _figure(width: float, height: float) -> Figure:
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless: workers have no display
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def _save(fig: Figure, path: Path) -> Path:
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _decision_cases(results: BenchResults) -> list[CaseResult]:
    return [c for c in results.cases if c.metric == results.decision_metric and c.speedup is not None]


def _speedup(case: CaseResult) -> float:
    """The case's speed-up; NaN (a gap in the plot) where it has none."""
    return math.nan if case.speedup is None else case.speedup


def plot_speedups(results: BenchResults, path: Path) -> Path:
    """Bars of reference time / kernel time per case, grouped by kernel."""
    cases = _decision_cases(results)
    if not cases:
        raise ValueError("no cases with a reference to plot")
    fig = _figure(max(6.0, 0.6 * len(cases) + 2), 4.5)
    ax = fig.add_subplot()
    labels = [f"{c.kernel}\n{c.name}" for c in cases]
    kernels = sorted({c.kernel for c in cases})
    colours = {k: f"C{i % 10}" for i, k in enumerate(kernels)}
    ax.bar(range(len(cases)), [_speedup(c) for c in cases], color=[colours[c.kernel] for c in cases])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cases)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speed-up vs reference (×)")
    ax.set_title(f"{results.variant} · {results.decision_metric} · {results.hardware.device} · {results.commit[:10]}")
    return _save(fig, path)


def plot_trend(history: Sequence[BenchResults], path: Path) -> Path:
    """Kernel median time (top) and speed-up (bottom) per case across stored runs, oldest left."""
    if len(history) < 2:
        raise ValueError(f"a trend needs at least two runs, got {len(history)}")
    fig = _figure(8.0, 6.5)
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2, sharex=None)
    keys = sorted({c.key for r in history for c in _decision_cases(r)})
    for key in keys:
        points = [(i, case) for i, r in enumerate(history) if (case := r.case(key)) is not None]
        xs = [i for i, _ in points]
        top.plot(xs, [c.stats.median * 1e6 for _, c in points], marker="o", label=f"{key[0]}/{key[1]}")
        bottom.plot(xs, [_speedup(c) for _, c in points], marker="o")
    ticks = [f"{r.created[:10]}\n{r.commit[:7]}" for r in history]
    for ax in (top, bottom):
        ax.set_xticks(range(len(history)), ticks, fontsize=6, rotation=45, ha="right")
    top.set_ylabel("kernel time (µs, median)")
    top.set_yscale("log")
    from matplotlib.ticker import FuncFormatter  # matplotlib is imported lazily (see _figure)

    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 1.5, not 1.5 × 10⁰: a narrow range gets minor ticks only
    top.yaxis.set_major_formatter(plain)
    top.yaxis.set_minor_formatter(plain)
    bottom.set_ylabel("speed-up vs reference (×)")
    top.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    top.set_title(f"history: {len(history)} runs · {history[-1].variant} · {history[-1].decision_metric}")
    return _save(fig, path)


# Any: the plot function's own arguments, passed on
def try_plot(kind: str, plot: Callable[..., Path], *args: Any) -> Path | None:
    """Run a plot function; a failure is a logged warning, never a failed run."""
    try:
        return plot(*args)
    except Exception as exc:  # side report only (see module docstring)
        _log.warning("could not draw the %s plot: %s: %s", kind, type(exc).__name__, exc)
        return None


def png_markdown(path: Path, title: str) -> str:
    """Markdown showing the PNG: inlined as a data: URI (the UI cannot read the worker's disk), else linked."""
    data = path.read_bytes()
    if len(data) <= EMBED_LIMIT:
        encoded = base64.b64encode(data).decode("ascii")
        return f"### {title}\n\n![{title}](data:image/png;base64,{encoded})\n\n`{path}`\n"
    return f"### {title}\n\n[{path.name}]({path.resolve().as_uri()}) ({len(data) // 1024} KiB)\n"
