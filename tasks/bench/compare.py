"""Compare a benchmark run against a baseline, case by case; decide each kernel's unit.

Statistics are re-derived from the stored samples (the bootstrap is seeded),
so a verdict never depends on summary numbers someone could edit by hand.
Only cases measured with the run's decision metric can be flagged; eager
numbers beside graph replay are shown, never decided on.

The decision is on the kernel's time relative to its torch reference,
paired per interleaved block of the same run: a busier or slower machine
slows both alike and cancels out, so only the kernel losing ground counts.
When the reference itself changed between the runs (another torch, CUDA or
HIP version) the ratio would credit or blame the kernel for torch's change,
so the decision falls back to the kernel's own time, and says so. Either way
a change must exceed the threshold and the measured noise (:func:`judge`).

Where the run's history holds enough comparable runs, the regression policy over that window
decides a case instead (:mod:`kiln.tasks.bench.window`): ``regressed`` is a regression, ``suspicious``
and ``insufficient data`` are reported and never block; the single baseline decides only the cases
whose window is too short.

Whether a regression fails its kernel's unit is the caller's choice
(``fail_on_regression``) narrowed by the metrics that may block
(``blocking``, ``[bench] blocking_metrics`` for a release): CPU timings on a
shared machine are advisory unless kiln.toml says otherwise.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from kiln.core.manifest import Unit, UnitState
from kiln.tasks.bench.results import BenchResults, CaseResult, Stats
from kiln.tasks.bench.stats import Summary, Verdict, judge, paired_ratios, summarize
from kiln.tasks.bench.window import WindowCase

Basis = Literal["kernel/reference", "kernel time"]
REFERENCE_VERSIONS = ("torch", "cuda", "hip")  # what the torch reference's speed depends on


@dataclass(frozen=True)
class CaseComparison:
    key: tuple[str, str, str]  # kernel, case name, metric
    baseline: float  # median seconds per call
    current: float
    absolute: Verdict  # of the kernel's own time
    relative: Verdict | None  # of kernel/reference, when both runs measured the same reference
    reference_change: float | None  # how much the reference moved: machine drift, or a new torch
    decides: bool  # measured with the decision metric

    @property
    def basis(self) -> Basis:
        return "kernel/reference" if self.relative is not None else "kernel time"

    @property
    def verdict(self) -> Verdict:
        """The verdict that decides: relative to the reference when comparable, else absolute."""
        return self.relative if self.relative is not None else self.absolute

    @property
    def regression(self) -> bool:
        return self.decides and self.verdict.regression

    def describe(self) -> str:
        kernel, name, metric = self.key
        context = f"kernel time {self.absolute.change:+.1%}" if self.relative is not None else ""
        if self.reference_change is not None:
            context += f"{'; ' if context else ''}reference {self.reference_change:+.1%}"
        return f"{kernel}/{name} [{metric}] {self.basis}: {self.verdict.reason}" + (f" ({context})" if context else "")

    def gate_line(self, threshold: float) -> str:
        """The case, the two medians it compared, the change and the noise: one line of the release gate."""
        kernel, name, metric = self.key
        verdict = self.verdict
        if self.relative is not None:
            values = f"{verdict.baseline:.3f} → {verdict.current:.3f}"
        else:
            values = f"{verdict.baseline * 1e6:.2f} µs → {verdict.current * 1e6:.2f} µs"
        return (f"{kernel}/{name} [{metric}] {self.basis} {values} ({verdict.change:+.1%}; "
                f"noise ±{verdict.noise:.1%}, threshold {threshold:.0%})")


@dataclass(frozen=True)
class Comparison:
    baseline_run: str  # run id of the baseline, or "" when there was none
    threshold: float
    cases: tuple[CaseComparison, ...]
    unmatched: tuple[tuple[str, str, str], ...]  # current cases the baseline lacks
    notes: tuple[str, ...] = ()
    windows: tuple[WindowCase, ...] = ()  # every case under the regression policy over its window

    def judged(self, kernel: str | None = None) -> list[WindowCase]:
        """Cases the window decides (enough comparable runs), of ``kernel`` (None: all)."""
        return [w for w in self.windows if w.judged and w.decides and kernel in (None, w.key[0])]

    def regressions(self, kernel: str | None = None) -> list[CaseComparison | WindowCase]:
        """Window regressions, then single-baseline regressions of the cases the window could not decide."""
        decided = {w.key for w in self.judged()}
        single = [c for c in self.cases if c.regression and c.key not in decided]
        return [w for w in self.judged(kernel) if w.regression] + [
            c for c in single if kernel is None or c.key[0] == kernel]

    def suspicious(self, kernel: str | None = None) -> list[WindowCase]:
        return [w for w in self.judged(kernel) if w.suspicious]

    def insufficient(self) -> list[WindowCase]:
        return [w for w in self.windows if w.decides and not w.judged]

    def for_case(self, key: tuple[str, str, str]) -> CaseComparison | None:
        return next((c for c in self.cases if c.key == key), None)


NO_BASELINE = Comparison(baseline_run="", threshold=0.0, cases=(), unmatched=(), notes=("no baseline",))


def no_baseline(reason: str, threshold: float) -> Comparison:
    """Nothing to compare against, and why (the first nightly, the first release of a channel)."""
    return Comparison(baseline_run="", threshold=threshold, cases=(), unmatched=(), notes=(reason,))


def _summary(stats: Stats, what: str) -> Summary:
    return summarize(stats.samples, what=what)


def compare_case(base: CaseResult, cur: CaseResult, threshold: float, decision: str,
                  same_reference: bool) -> CaseComparison:
    where = "/".join(cur.key)
    absolute = judge(_summary(base.stats, f"baseline {where}"), _summary(cur.stats, f"current {where}"), threshold)
    ref_change, relative = None, None
    if base.reference is not None and cur.reference is not None:
        ref_change = cur.reference.median / base.reference.median - 1
        if same_reference:
            relative = judge(_ratios(base, f"baseline {where}"), _ratios(cur, f"current {where}"), threshold)
    return CaseComparison(key=cur.key, baseline=base.stats.median, current=cur.stats.median, absolute=absolute,
                          relative=relative, reference_change=ref_change, decides=cur.metric == decision)


def same_reference(baseline: BenchResults, current: BenchResults) -> bool:
    """The torch reference is the same code in both runs, so kernel/reference ratios compare."""
    return all(baseline.versions.get(k) == current.versions.get(k) for k in REFERENCE_VERSIONS)


def _ratios(case: CaseResult, what: str) -> Summary:
    assert case.reference is not None
    return summarize(paired_ratios(case.stats.samples, case.reference.samples), what=f"{what} kernel/reference")


def _notes(baseline: BenchResults, current: BenchResults) -> tuple[str, ...]:
    notes = []
    if baseline.hardware.device != current.hardware.device or baseline.hardware.cpu != current.hardware.cpu:
        notes.append(f"baseline ran on {baseline.hardware.device} / {baseline.hardware.cpu}; this run on "
                     f"{current.hardware.device} / {current.hardware.cpu}: absolute times may not be comparable")
    if baseline.decision_metric != current.decision_metric:
        notes.append(f"baseline decided on {baseline.decision_metric}, this run on {current.decision_metric}")
    if not same_reference(baseline, current):
        changed = {k: (baseline.versions.get(k), current.versions.get(k)) for k in REFERENCE_VERSIONS}
        notes.append(f"the reference changed ({changed}): deciding on kernel time, not kernel/reference")
    return tuple(notes)


def compare_results(baseline: BenchResults | None, current: BenchResults, threshold: float,
                    missing: str = "", windows: Sequence[WindowCase] = ()) -> Comparison:
    """Judge every case of ``current`` that ``baseline`` also measured (same kernel, name, metric);
    ``windows``: the regression policy's judgements (:func:`kiln.tasks.bench.window.window_cases`).

    Without a baseline the single comparison is empty; ``missing`` says why (see :func:`no_baseline`).
    """
    return replace(_compare_single(baseline, current, threshold, missing), windows=tuple(windows))


def _compare_single(baseline: BenchResults | None, current: BenchResults, threshold: float,
                    missing: str) -> Comparison:
    if baseline is None:
        return no_baseline(missing, threshold) if missing else NO_BASELINE
    compared, unmatched = [], []
    comparable = same_reference(baseline, current)
    for case in current.cases:
        base = baseline.case(case.key)
        if base is None:
            unmatched.append(case.key)
            continue
        compared.append(compare_case(base, case, threshold, current.decision_metric, comparable))
    return Comparison(baseline_run=baseline.run_id, threshold=threshold, cases=tuple(compared),
                      unmatched=tuple(unmatched), notes=_notes(baseline, current))


@dataclass(frozen=True)
class KernelOutcome:
    """What one kernel's benchmark task produced: its cases, or the error that stopped it."""

    kernel: str
    cases: tuple[CaseResult, ...] = ()
    error: str = ""
    duration_s: float = 0.0


def blocks(case: CaseComparison | WindowCase, fail_on_regression: bool, blocking: Collection[str] | None) -> bool:
    """A regression of ``case`` fails its unit: regressions fail, and its metric may block (None: every metric)."""
    return case.regression and fail_on_regression and (blocking is None or case.key[2] in blocking)


def _regression_label(regressions: Sequence[CaseComparison | WindowCase], fail_on_regression: bool,
                      blocking: Collection[str] | None) -> tuple[UnitState, str]:
    if any(blocks(r, fail_on_regression, blocking) for r in regressions):
        return "failed", "regression"
    if not fail_on_regression:
        return "completed", "regression (warning only)"
    metrics = sorted({r.key[2] for r in regressions})
    return "completed", (f"regression (advisory: {', '.join(metrics)} timings do not block; "
                         f"kiln.toml [bench] blocking_metrics = {sorted(blocking or ())})")


def kernel_unit(outcome: KernelOutcome, comparison: Comparison, fail_on_regression: bool,
                blocking: Collection[str] | None = None) -> Unit:
    """The manifest unit of one kernel: failed when it crashed, or regressed on a metric that blocks."""
    unit_id = f"bench/{outcome.kernel}"
    if outcome.error:
        return Unit(id=unit_id, stage="bench", state="failed", kernel=outcome.kernel,
                    message=outcome.error, duration_s=outcome.duration_s)
    regressions = comparison.regressions(outcome.kernel)
    state: UnitState
    if regressions:
        lines = "; ".join(r.describe() for r in regressions)
        state, label = _regression_label(regressions, fail_on_regression, blocking)
        message = f"{label}: {lines}"
    else:
        state = "completed"
        message = _quiet_message(outcome, comparison)
    suspicious = comparison.suspicious(outcome.kernel)
    if suspicious:
        message += "; suspicious (not blocking): " + "; ".join(w.describe() for w in suspicious)
    return Unit(id=unit_id, stage="bench", state=state, kernel=outcome.kernel, message=message,
                duration_s=outcome.duration_s)


def _quiet_message(outcome: KernelOutcome, comparison: Comparison) -> str:
    if not outcome.cases:
        return "no benchmark cases declared"
    count = len({c.name for c in outcome.cases})
    judged = comparison.judged(outcome.kernel)
    if judged:
        runs = max(w.judgement.runs for w in judged)
        decisions = sorted({w.judgement.decision for w in judged})
        return f"{count} cases measured; judged over the last {runs} runs on this hardware: {', '.join(decisions)}"
    if comparison.baseline_run:
        against = f"no regression vs run {comparison.baseline_run}"
    else:
        against = comparison.notes[0] if comparison.notes else "no baseline"
    return f"{count} cases measured; {against}"


def kernel_units(outcomes: Sequence[KernelOutcome], comparison: Comparison, fail_on_regression: bool,
                 blocking: Collection[str] | None = None) -> list[Unit]:
    return [kernel_unit(o, comparison, fail_on_regression, blocking) for o in outcomes]


def comparison_record(comparison: Comparison, fail_on_regression: bool,
                      blocking: Collection[str] | None) -> dict[str, Any]:
    """What the run records about its comparison, for the release gate (plain JSON)."""
    regressions = comparison.regressions()
    judged = comparison.judged()
    return {
        "window": {"judged": len(judged), "runs": max((w.judgement.runs for w in judged), default=0),
                   "suspicious": [w.gate_line(comparison.threshold) for w in comparison.suspicious()],
                   "insufficient": len(comparison.insufficient())},
        "baseline_run": comparison.baseline_run,
        "notes": list(comparison.notes),
        "threshold": comparison.threshold,
        "compared": len(comparison.cases),
        "blocking_metrics": None if blocking is None else sorted(blocking),
        "blocking": [r.gate_line(comparison.threshold) for r in regressions
                     if blocks(r, fail_on_regression, blocking)],
        "advisory": [r.gate_line(comparison.threshold) for r in regressions
                     if not blocks(r, fail_on_regression, blocking)],
    }
