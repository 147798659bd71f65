"""The bisect flow: the first commit between ``--good`` and ``--bad`` where one test fails, or where one
benchmark got slower than at ``--good``.

Each tried commit is a task run of its own in the Prefect UI (``try <commit>``), with where its wheel
came from (a stored run, or built now because no run stored one) and the test's outcome. The plain
steps live in :mod:`kiln.tasks.run.bisect`. The store is read through a read-only wrapper with read-only
credentials; only a wheel bisect built is kept, with the build step's credentials.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from kiln.core.errors import InvalidInputError, KilnError, PermanentError
from kiln.core.objects import Store
from kiln.core.record import RunHeader, open_record
from kiln.flows.build import build_flow
from kiln.flows.run.common import store_session, sync_state, unwalked
from kiln.release.stores.readonly import ReadOnlyStore
from kiln.tasks.bench.compare import compare_case
from kiln.tasks.bench.measure import run_measure
from kiln.tasks.bench.results import CaseResult
from kiln.tasks.process import run_in_group
from kiln.tasks.project.config import KilnConfig, load_config
from kiln.tasks.run import bisect
from kiln.tasks.run.runs import artifact_store
from kiln.tasks.testing.envs import TestEnv, make_env

TEST_TIMEOUT_S = 900
_TAIL = 1500


def _requires(config: KilnConfig, nodeid: str) -> list[str]:
    """What the suites that hold ``nodeid``'s file require beyond the wheel (e.g. hypothesis)."""
    path = nodeid.split("::", 1)[0]
    return sorted({r for s in config.suites for r in s.requires
                   if any(path == p or path.startswith(p.rstrip("/") + "/") for p in s.paths)})


def _drop_worktree(root: Path, tree: Path) -> None:
    """Remove the worktree; a failure is logged, never raised over the build's own outcome."""
    try:
        bisect.git(root, "worktree", "remove", "--force", str(tree), error=PermanentError)
    except KilnError as exc:
        get_run_logger().warning("could not remove the bisect worktree %s: %s", tree, exc)
    try:
        bisect.git(root, "worktree", "prune", error=PermanentError)  # and any a killed bisect left registered
    except KilnError as exc:
        get_run_logger().warning("git worktree prune failed: %s", exc)


def _read_only(config: KilnConfig) -> Store:
    """The artifact store as bisect reads it: writes refused, and on S3 the test step's reads alone."""
    session = store_session(config, "test", config.artifacts.kind, read_only=True)
    return ReadOnlyStore(artifact_store(config, session), "kiln bisect only reads stored runs and wheels")


def _build_at(config: KilnConfig, commit: str, variant: str, work: Path) -> Path:
    """Build ``variant`` at ``commit`` in a git worktree of it; the wheel it wrote."""
    tree = work / "worktree"
    bisect.git(config.root, "worktree", "add", "--detach", str(tree), commit, error=PermanentError)
    try:
        there = tree / config.config_file.relative_to(config.root)
        state = sync_state(build_flow(config_path=str(there), out=str(work / "out"), variants=[variant],
                                      return_state=True))
        if not state.is_completed():
            raise PermanentError(f"building {variant} at {commit[:12]} failed: {state.message}")
        built = load_config(there)
        store = _read_only(built)
        run = open_record(store, str(state.state_details.flow_run_id), work / "out")
        found = bisect.stored_wheel(store, [run.header], variant, work)
        if found is None:
            raise PermanentError(f"building {variant} at {commit[:12]} wrote no wheel")
        kept = work / "built" / found[0].name
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(found[0], kept)  # out of the worktree, which goes next
        return kept
    finally:
        _drop_worktree(config.root, tree)


def _wheel_for(config: KilnConfig, store: Store, runs: dict[str, list[RunHeader]], commit: str, variant: str,
               work: Path) -> tuple[Path, str]:
    found = bisect.stored_wheel(store, runs.get(commit, []), variant, work)
    if found is not None:
        return found
    cached = bisect.cached_build(store, commit, variant, work)
    if cached is not None:
        return cached, bisect.BUILT_EARLIER
    get_run_logger().warning("no stored %s wheel of %s: building it once (kept for later bisects)", variant,
                             commit[:12])
    built = _build_at(config, commit, variant, work)
    bisect.keep_build(artifact_store(config, store_session(config, "build", config.artifacts.kind)), commit,
                      variant, built)
    return built, bisect.BUILT_NOW


@task(name="try-commit", task_run_name="try {commit}", cache_policy=NO_CACHE)
def try_commit(config: KilnConfig, store: Store, runs: dict[str, list[RunHeader]], commit: str, variant: str,
               nodeid: str, work: Path) -> bisect.Trial:
    """Install ``commit``'s wheel in a fresh environment and run ``nodeid`` from that commit's tests."""
    here = work / commit[:12]
    wheel, origin = _wheel_for(config, store, runs, commit, variant, here)
    tree = bisect.checkout_tree(config.root, commit, here / "src")
    env = _env(config, variant, wheel, here / "env", _requires(config, nodeid), tree)
    # -P: the checkout's own package (a flat layout) never shadows the installed wheel; a group of its own,
    # ended by the shared ladder at the deadline and by a cancel of the run.
    ladder, output = run_in_group([str(env.python), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
                                  TEST_TIMEOUT_S, cwd=tree)
    if ladder.timed_out:
        return bisect.Trial(commit, True, f"timed out after {TEST_TIMEOUT_S} s:\n{output[-_TAIL:]}", origin)
    if ladder.returncode in (4, 5):  # usage error, or nothing collected: the test is not there at that commit
        raise InvalidInputError(f"{nodeid} does not run at {commit[:12]} (pytest exit {ladder.returncode}): "
                                f"{output.strip()[-_TAIL:]}")
    trial = bisect.Trial(commit, ladder.returncode != 0, output.strip()[-_TAIL:], origin)
    get_run_logger().info("%s: %s (wheel: %s)", commit[:12], "FAILS" if trial.bad else "passes", origin)
    return trial


BENCH_TIMEOUT_S = 1800.0
_DECISION_ORDER = ("graph_replay", "cpu", "eager")  # the metric a case is decided on, when measured


def _env(config: KilnConfig, variant: str, wheel: Path, root: Path, requires: list[str], tests: Path) -> TestEnv:
    """A fresh environment of ``wheel`` on ``variant``'s base (its backend, its build torch), as its suites get."""
    chosen = config.variant(variant)
    return make_env(root, [wheel], requires, indexes=config.publish.extra_index_urls, tests_root=tests,
                    backend=chosen.backend, build_requires=chosen.build_requires)


def _measure(config: KilnConfig, variant: str, wheel: Path, tree: Path, kernel: str, case: str | None,
             work: Path) -> dict[str, CaseResult]:
    """``kernel``'s cases (only ``case`` when named) measured from ``wheel``, on their decision metric."""
    env = _env(config, variant, wheel, work / "env", [], tree)
    there = tree / config.config_file.relative_to(config.root)
    answer = run_measure(str(env.python), str(there), work / "bench", size=config.bench.size, metric="auto",
                         kernel=kernel, timeout_s=BENCH_TIMEOUT_S)
    cases = [CaseResult.model_validate(c) for c in answer["cases"] if case in (None, c["name"])]
    metric = next((m for m in _DECISION_ORDER if any(c.metric == m for c in cases)), None)
    if metric is None:
        raise InvalidInputError(f"no benchmark case {kernel}/{case or '*'} at this commit")
    return {c.name: c for c in cases if c.metric == metric}


@task(name="try-commit-bench", task_run_name="bench {commit}", cache_policy=NO_CACHE)
def try_bench(config: KilnConfig, store: Store, runs: dict[str, list[RunHeader]], commit: str, variant: str,
              target: str, baseline: dict[str, CaseResult] | None,
              work: Path) -> tuple[bisect.Trial, dict[str, CaseResult]]:
    """Measure ``target`` (KERNEL[/CASE]) at ``commit``; bad when a case regressed against ``baseline``."""
    here = work / commit[:12]
    wheel, origin = _wheel_for(config, store, runs, commit, variant, here)
    kernel, _, case = target.partition("/")
    measured = _measure(config, variant, wheel, bisect.checkout_tree(config.root, commit, here / "src"), kernel,
                        case or None, here)
    if baseline is None:
        lines = [f"{name}: {c.stats.median * 1e6:.2f} µs (IQR {c.stats.spread * 1e6:.2f})"
                 for name, c in measured.items()]
        return bisect.Trial(commit, False, "\n".join(lines), origin), measured
    compared = [compare_case(baseline[name], c, config.bench.threshold, c.metric, same_reference=True)
                for name, c in measured.items() if name in baseline]
    if not compared:
        raise InvalidInputError(f"no case of {target} measured at {commit[:12]} ({sorted(measured)}) was measured "
                                f"at --good ({sorted(baseline)}): nothing to compare")
    bad = any(c.verdict.regression for c in compared)
    message = "\n".join(c.gate_line(config.bench.threshold) for c in compared)
    get_run_logger().info("%s: %s (wheel: %s)", commit[:12], "SLOWER" if bad else "not slower", origin)
    return bisect.Trial(commit, bad, message, origin), measured


def _report(root: Path, first: str, trials: dict[str, bisect.Trial]) -> str:
    subject = bisect.git(root, "log", "-1", "--format=%h %s", first).strip()
    lines = [f"first bad commit: {first} ({subject})", "", "tried, in order:"]
    lines += [f"  {c[:12]}  {'bad ' if t.bad else 'good'}  wheel: {t.wheel_from}" for c, t in trials.items()]
    lines += ["", f"the evidence at {first[:12]}:", trials[first].message]
    return "\n".join(lines) + "\n"


def _checked_mode(test: str | None, bench: str | None) -> None:
    if (test is None) == (bench is None):
        raise InvalidInputError("name exactly one of --test NODEID and --bench KERNEL[/CASE]")


@flow(name="bisect", flow_run_name="bisect {good}..{bad}")
def bisect_flow(good: str, bad: str, test: str | None = None, bench: str | None = None,
                config_path: str = "kiln.toml", variant: str = "cpu") -> str:
    """The first commit after ``good`` up to ``bad`` where ``test`` (a pytest node id) fails, or where
    ``bench`` (KERNEL[/CASE]) is slower than at ``good`` beyond the threshold and the measured noise."""
    _checked_mode(test, bench)
    config = load_config(config_path)
    if variant not in {v.name for v in config.variants}:
        raise InvalidInputError(f"--variant {variant!r}: kiln.toml defines {[v.name for v in config.variants]}")
    good_sha, candidates = bisect.commit_range(config.root, good, bad)
    store = _read_only(config)
    runs = bisect.runs_by_commit(store)
    trials: dict[str, bisect.Trial] = {}
    baseline: list[dict[str, CaseResult]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bisect-") as scratch:
        def is_bad(commit: str) -> bool:
            if commit in trials:
                return trials[commit].bad
            if test is not None:
                trials[commit] = try_commit(config, unwalked(store), unwalked(runs), commit, variant, test,
                                            Path(scratch))
            else:
                trials[commit], measured = try_bench(config, unwalked(store), unwalked(runs), commit, variant,
                                                     str(bench), unwalked(baseline[0] if baseline else None),
                                                     Path(scratch))
                baseline[:] = baseline or [measured]
            return trials[commit].bad

        what = test or f"benchmark {bench}"
        if is_bad(good_sha):
            raise InvalidInputError(f"{what} fails at --good {good} ({good_sha[:12]}) already:\n"
                                    f"{trials[good_sha].message}")
        if not is_bad(candidates[-1]):
            raise InvalidInputError(f"{what} is fine at --bad {bad} ({candidates[-1][:12]}): nothing to bisect\n"
                                    f"{trials[candidates[-1]].message}")
        first = bisect.first_bad(candidates, is_bad)
    return _report(config.root, first, trials)
