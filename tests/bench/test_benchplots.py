"""PNG plots: drawn from results and history; a failure is a warning, never an error."""

from __future__ import annotations

import base64
import logging
from pathlib import Path

from kiln.tasks.bench.plots import plot_speedups, plot_trend, png_markdown, try_plot
from tests.helpers.benchfakes import FakeTimer, fake_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_speedup_plot_is_a_png(tmp_path: Path):
    path = plot_speedups(fake_run(FakeTimer(seed=1)), tmp_path / "speedup.png")
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 1000


def test_trend_plot_draws_the_history(tmp_path: Path):
    history = [fake_run(FakeTimer(kernel=1e-3 * (1 + i / 10), seed=i), run_id=f"r{i}",
                        created=f"2026-11-2{i}T03:00:00Z") for i in range(4)]
    path = plot_trend(history, tmp_path / "trend.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_a_failed_plot_is_a_logged_warning_and_no_file(tmp_path: Path, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln.tasks.bench.plots"):
        result = try_plot("trend", plot_trend, [fake_run(FakeTimer(seed=1))], tmp_path / "trend.png")
    assert result is None and not (tmp_path / "trend.png").exists()
    assert "could not draw the trend plot" in caplog.text and "at least two runs" in caplog.text


def test_png_markdown_inlines_the_image_so_the_ui_can_show_it(tmp_path: Path):
    path = plot_speedups(fake_run(FakeTimer(seed=1)), tmp_path / "speedup.png")
    markdown = png_markdown(path, "Speed-up")
    encoded = markdown.split("data:image/png;base64,", 1)[1].split(")", 1)[0]
    assert base64.b64decode(encoded) == path.read_bytes()
