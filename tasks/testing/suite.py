"""One configured test suite against one variant's wheel: environment, isolated run, reports, unit.

This is what the test stage's Prefect task calls; it turns a ``[[suites]]``
entry of ``kiln.toml`` plus the command line's overrides into a run of
:func:`kiln.tasks.testing.runner.run_tests` inside a fresh environment where
the variant's wheel from the run record is installed (:mod:`.envs`), writes
``<view>/tests/<suite>.<variant>.junit.xml`` and ``.json``, and returns the
unit that says how the suite went. The environment holds the wheel, what it
declares, pytest and the suite's ``requires``, and nothing of Kiln's own
interpreter; an import the wheel does not declare fails its test. A suite that cannot run here — it needs
GPUs this machine lacks, or every test skipped for lack of hardware — is
``not_run`` with the reason, never ``completed``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pydantic import ValidationError

from kiln.core.errors import InfrastructureError, InvalidInputError, ToolchainMissingError
from kiln.core.fsutil import atomic_write_bytes, atomic_write_text
from kiln.core.installenv import resolver_env
from kiln.core.manifest import Unit
from kiln.core.venvs import uv_command
from kiln.tasks.build.buildenv import BuildEnvironmentError, _complete, ensure_env, env_key, uv_source_options
from kiln.tasks.build.interpreters import cell_interpreters
from kiln.tasks.project.config import KilnConfig, Suite, Variant
from kiln.tasks.project.config_matrix import TORCH_ID, built_for, cell_python, claimed_torches, host_torch
from kiln.tasks.testing.baseenv import CREATE_TIMEOUT_S, BaseEnv, site_packages
from kiln.tasks.testing.classify import TestResult, suite_state, summary_line
from kiln.tasks.testing.devices import detect_gpu_count
from kiln.tasks.testing.emulation import no_runner_reason
from kiln.tasks.testing.envs import made_once, make_env, wheel_requirements
from kiln.tasks.testing.jobs import PRELOAD, Isolation, RunOptions
from kiln.tasks.testing.reports import junit_document, summary, write_json, write_junit
from kiln.tasks.testing.runner import run_tests
from kiln.tasks.testing.selection import Outcome, Selector

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuiteTarget:
    """One suite against one variant's installed wheel; a stable-ABI wheel's, under one ``torch`` it claims."""

    suite: Suite
    variant: Variant
    torch: str = ""
    shard: int = 0   # which of ``shards`` units of the suite's tests this is (1-based); 0: the whole suite
    shards: int = 1

    @property
    def suite_unit_id(self) -> str:
        """The id of the suite on this variant, whichever shard this is: its durations and shard count go by it."""
        return f"test/{self.suite.name}/{self.variant.name}" + (f"{TORCH_ID}{self.torch}" if self.torch else "")

    @property
    def suite_name(self) -> str:
        return f"{self.suite.name}.{self.variant.name}" + (f".torch{self.torch}" if self.torch else "")

    @property
    def unit_id(self) -> str:
        return self.suite_unit_id + (f"/shard-{self.shard}-of-{self.shards}" if self.shard else "")

    @property
    def name(self) -> str:
        return self.suite_name + (f".shard-{self.shard}-of-{self.shards}" if self.shard else "")

    def unit(self, state: str, message: str, duration_s: float = 0.0) -> Unit:
        return Unit(id=self.unit_id, stage="test", state=state, suite=self.suite.name,  # type: ignore[arg-type]
                    variant=self.variant.name, message=message, duration_s=duration_s, required=self.suite.required)


ADHOC = "adhoc"  # the suite `kiln test -- PATHS` makes of its paths


def split_test_args(args: Sequence[str], cwd: Path, root: Path) -> tuple[list[str], list[str]]:
    """``kiln test -- ARGS`` → (test paths relative to the project root, other pytest arguments).

    An argument that names an existing file or directory (a node id ``file::test`` counts by its
    file) is a test path; one that looks like a path (``/``, ``.py``, ``::``) but names nothing is
    an error; everything else (``-k EXPR``, ``-x``) is passed to pytest.
    """
    paths, options = [], []
    for arg in args:
        file, sep, node = arg.partition("::")
        candidate = (cwd / file).resolve()
        if not arg.startswith("-") and file and candidate.exists():
            try:
                relative = candidate.relative_to(root.resolve()).as_posix()
            except ValueError:
                raise InvalidInputError(f"test path {arg!r} is outside the project ({root})") from None
            paths.append(relative + sep + node)
        elif not arg.startswith("-") and ("/" in file or file.endswith(".py") or sep):
            raise InvalidInputError(f"test path {arg!r} does not exist (relative to {cwd})")
        else:
            options.append(arg)
    return paths, options


def adhoc_suite(config: KilnConfig, paths: Sequence[str]) -> Suite:
    """``kiln test -- PATHS``: those paths (relative to the project) as one suite of their own.

    It runs like a configured suite — against the CPU variants' installed wheels, each test in
    its own process with the default deadline — and no configured suite runs beside it.
    """
    if not paths:
        raise InvalidInputError("an ad-hoc suite needs at least one test path")
    missing = [p for p in paths if not config.path(p.partition("::")[0]).exists()]
    if missing:
        raise InvalidInputError(f"test paths {missing} do not exist in the project ({config.root})")
    try:
        return Suite(name=ADHOC, paths=tuple(paths))
    except ValidationError as exc:
        raise InvalidInputError(f"test paths {list(paths)}: {exc.errors()[0]['msg']}") from None


def targets(config: KilnConfig, suites: Sequence[Suite], counts: Mapping[str, int] | None = None) -> list[SuiteTarget]:
    """Each suite against each variant's wheel; a stable-ABI variant's, once per torch it claims; a sharded
    suite's, once per shard. ``counts``: the shard count of each ``shards = "auto"`` suite unit, by its id, as
    the run decided it (:mod:`kiln.tasks.testing.shards`); one without a count is one unit."""
    whole = [SuiteTarget(suite, variant, torch) for suite in suites for variant in config.suite_variants(suite)
             for torch in (claimed_torches(variant) or ("",))]
    return [split for target in whole for split in _sharded(target, (counts or {}).get(target.suite_unit_id, 1))]


def _sharded(target: SuiteTarget, auto: int) -> list[SuiteTarget]:
    count = auto if target.suite.shards == "auto" else target.suite.shards
    if count <= 1:
        return [target]
    return [replace(target, shard=n, shards=count) for n in range(1, count + 1)]


class TorchUnavailableError(ToolchainMissingError):
    """A torch a stable-ABI wheel claims cannot be had here: its run is "not run", naming why."""


def torch_base(config: KilnConfig, target: SuiteTarget) -> BaseEnv | None:
    """The environment a stable-ABI suite run under ``target.torch`` stands on: None for the host's torch (the
    shared base, copied from Kiln's interpreter, as today); for another torch, the build environment of that torch
    alone under the build cache (``envs/``, what a build against it makes and shares), found, or made by pip from
    the machine's sources (pip.conf's find-links: local disk). One that cannot be made is
    :class:`TorchUnavailableError`."""
    if not target.torch or target.torch == host_torch():
        return None
    envs = config.path(config.build.cache_dir) / "envs"
    if not _complete(envs / env_key([f"torch=={target.torch}"])):
        why = _cannot_resolve(target.torch)
        if why:
            raise TorchUnavailableError(f"torch {target.torch} is not available here ({why})")
    try:
        made = ensure_env(envs, [f"torch=={target.torch}"], target.variant.name, CREATE_TIMEOUT_S)
    except (BuildEnvironmentError, InfrastructureError) as exc:
        raise TorchUnavailableError(f"torch {target.torch} is not available here ({_first_line(exc)})") from exc
    return BaseEnv(made.root, site_packages(made.root), made.requirements)


def _cannot_resolve(torch: str) -> str:
    """Why ``torch==<torch>`` does not resolve for Kiln's Python from the machine's pip sources, or "" (``uv pip
    compile``: metadata only, nothing downloaded; the check the build makes of a matrix cell's torch). Wheels
    only (``--no-build``: an sdist's build hook is someone else's code) and in the scrubbed environment."""
    with tempfile.TemporaryDirectory(prefix="kiln-torch-resolve-") as tmp:
        listing = Path(tmp) / "requirements.in"
        listing.write_text(f"torch=={torch}\n")
        (Path(tmp) / "home").mkdir(mode=0o700)
        try:
            done = subprocess.run([*uv_command(), "pip", "compile", "--no-build", "--quiet", "--no-header",
                                   "--python-version", f"{sys.version_info[0]}.{sys.version_info[1]}",
                                   *uv_source_options(), str(listing)], capture_output=True, text=True,
                                  timeout=RESOLVE_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False, cwd=tmp,
                                  env=resolver_env(Path(tmp) / "home"))
        except subprocess.TimeoutExpired:
            return f"resolving it took over {RESOLVE_TIMEOUT_S:g} s"
    if done.returncode == 0:
        return ""
    out = done.stdout + done.stderr
    lines = out.splitlines()
    return next((ln.strip() for ln in lines if "cause:" in ln), next(
        (ln.strip() for ln in lines if "error" in ln.lower()), f"uv pip compile exit {done.returncode}"))[:300]


RESOLVE_TIMEOUT_S = 300.0


def _first_line(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = next((ln for ln in lines if "No matching distribution" in ln or "ERROR" in ln), lines[0] if lines else "")
    return why[:300]


def not_run_reason(target: SuiteTarget, gpus_here: int) -> str:
    """Why ``target`` cannot run on this machine, or ""."""
    suite, variant = target.suite, target.variant
    if suite.gpus > gpus_here:
        return f"not run: needs {suite.gpus} GPU{'s' if suite.gpus != 1 else ''}, {gpus_here} on this machine"
    if variant.backend != "cpu" and gpus_here == 0:
        return f"not run: the {variant.name} wheel needs a {variant.backend} GPU, none on this machine"
    return no_runner_reason(built_for(variant), emulate=suite.emulate, python=cell_python(variant))  # aarch64 here


@dataclass(frozen=True)
class SuiteRun:
    suite: str
    results: tuple[TestResult, ...]
    unit: Unit
    reports: tuple[Path, ...]
    elapsed_s: float
    selection: Outcome | None = None  # what test selection ran and carried, when it was on for the run


def check_overrides(isolate: str, timeout: float | None, retries: int) -> None:
    """Refuse bad command-line overrides (InvalidInputError) before a run starts."""
    RunOptions(isolate=isolate, timeout_s=1.0 if timeout is None else timeout, retries=retries)  # type: ignore[arg-type]


def suite_options(config: KilnConfig, suite: Suite, *, isolate: Isolation = "test", timeout: float | None = None,
                  retries: int = 1, pytest_args: Sequence[str] = (), gpus: int | None = None,
                  env: Mapping[str, str] | None = None) -> RunOptions:
    """The runner's options: the suite's markers and timeout unless overridden.

    A suite may use at most the GPUs it declares (that is what its Prefect
    concurrency slots cover), and never more than the machine has.
    """
    devices = min(detect_gpu_count() if gpus is None else gpus, suite.gpus)
    preload = (*PRELOAD, config.project.package)
    return RunOptions(isolate=isolate, timeout_s=suite.test_timeout_s if timeout is None else timeout, retries=retries,
                      markers=suite.markers, pytest_args=tuple(pytest_args), gpus=devices, env=dict(env or {}),
                      preload=preload, pass_env=suite.pass_env)


def suite_outcome(results: Sequence[TestResult]) -> tuple[str, str]:
    """(unit state, message): a suite whose every test was skipped did not run."""
    message = summary_line(results)
    if results and all(r.outcome == "skipped" for r in results):
        return "not_run", f"not run: every test was skipped ({results[0].message or 'no reason given'})"
    return suite_state(results), message


# What a wheel must require for its test environment to stand on the shared base (torch, Triton, numpy, pytest).
BASE_NEEDS = frozenset({"torch", "triton"})


def cell_environment(config: KilnConfig, variant: Variant, wheels: Sequence[Path]) -> tuple[Path | None, bool]:
    """(interpreter, shared base) of a suite's environment: a matrix cell's environment is made by the cell's
    Python, and stands on today's shared base only when its wheel requires torch or Triton (a package that does
    not depend on torch never waits on a torch for another Python). A variant that is no cell: Kiln's
    interpreter and the base, as before. A cell whose wheel needs torch on a Python other than Kiln's is refused,
    naming why: the shared base is made by Kiln's interpreter."""
    if variant.cell is None or not variant.cell.python:
        return None, True
    needs = {canonicalize_name(Requirement(r).name) for w in wheels[:1] for r in wheel_requirements(w)}
    found = cell_interpreters(config, [variant])[variant.name]
    shared = bool(needs & BASE_NEEDS)
    if shared and found.minor != f"{sys.version_info[0]}.{sys.version_info[1]}":
        raise ToolchainMissingError(
            f"cell {variant.name} (Python {found.minor}): its wheel requires {sorted(needs & BASE_NEEDS)}, and the"
            f" shared test base (torch, Triton) is made for Kiln's Python {sys.version_info[0]}.{sys.version_info[1]}"
            f" only; run this cell's suites with Kiln installed under Python {found.minor}")
    return found.path, shared


def run_suite(config: KilnConfig, target: SuiteTarget, wheels: Sequence[Path], view: str | Path,
              options: RunOptions, selector: Selector | None = None) -> SuiteRun:
    """Run ``target`` against ``wheels`` installed in a fresh environment; reports under ``<view>/tests``.
    ``selector``: which tests run and which are carried from an earlier run (:mod:`.selection`)."""
    suite = target.suite
    reports_dir = Path(view).resolve() / "tests"
    start = time.monotonic()
    try:
        python, shared_base = cell_environment(config, target.variant, wheels)
        base = torch_base(config, target)
    except TorchUnavailableError as exc:
        logger.warning("suite %s: %s", target.name, exc)
        return SuiteRun(target.name, (), target.unit("not_run", f"not run: {exc}", 0.0), (), 0.0)
    except ToolchainMissingError as exc:  # a cell this machine cannot test: "not run", never "passed" (invariant 9)
        logger.warning("suite %s: not run: %s", target.name, exc)
        return SuiteRun(target.name, (), target.unit("not_run", f"not run: {exc}", 0.0), (), 0.0)
    root = reports_dir / ".envs" / target.name  # the shard that makes it names it; the suite's shards share it
    env = made_once(reports_dir / ".envs" / target.suite_name, lambda: make_env(
        root, wheels, suite.requires, indexes=config.publish.extra_index_urls, tests_root=config.root,
        test_paths=suite.paths, backend=target.variant.backend,
        build_requires=() if target.torch else target.variant.build_requires, python=python,
        shared_base=shared_base, base=base))
    logger.info("suite %s on %s: running %s (isolate=%s, timeout=%gs per test)", suite.name, ", ".join(env.installed),
                list(suite.paths), options.isolate, options.timeout_s)
    if selector is not None and wheels:
        options = replace(options, pick=selector.picker(env.python, wheels[0], config.root,
                                                        config.project.distribution, then=options.pick))
    results = run_tests(suite.paths, config.root, reports_dir / ".work" / target.name,
                        replace(options, python=str(env.python)))
    chosen = selector.finish(results) if selector is not None and wheels else None
    elapsed = time.monotonic() - start
    junit = write_junit(reports_dir / f"{target.name}.junit.xml", target.name, results)
    report = write_json(reports_dir / f"{target.name}.json", target.name, results, elapsed)
    state, message = suite_outcome(results)
    if chosen is not None and (chosen.carried or chosen.lines):  # a run of every test says so in its counts
        message = "\n".join([f"{message}; {chosen.message()}", *chosen.lines])
    unit = target.unit(state, message, elapsed)
    logger.info("suite %s: %s", target.name, unit.message)
    return SuiteRun(target.name, tuple(results), unit, (junit, report), elapsed, chosen)


def write_combined(runs: Sequence[SuiteRun], junit: str | Path | None, json_path: str | Path | None) -> list[Path]:
    """The ``--junit`` / ``--json`` files: every suite of the run in one document each."""
    written = []
    if junit:
        atomic_write_bytes(junit, junit_document({r.suite: r.results for r in runs}))
        written.append(Path(junit))
    if json_path:
        doc = {"suites": [summary(r.suite, r.results, r.elapsed_s) for r in runs]}
        atomic_write_text(json_path, json.dumps(doc, indent=2) + "\n")
        written.append(Path(json_path))
    return written
