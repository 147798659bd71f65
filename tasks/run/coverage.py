"""The run's coverage table: one row per requested cell, its wheel, and what became of it.

A cell is what a user's environment must match to find a wheel: the Python, the torch, the backend, the archs
and the CPU (``platform``: the wheel's platform tags' CPU, ``any`` for a pure wheel; what the variant asks for
while it has no wheel). A ``[[variants]]`` entry without matrix axes is one cell (built by the build's
interpreter against its variant's torch); one with ``python``/``torch`` axes is one cell per combination left
after its exclusions (:mod:`kiln.tasks.project.config_matrix`), each a row of its own. A row says which wheel
it got (its Python tag, and the torch its ``Requires-Dist`` asks for; a cell without a wheel shows what it
asked for) and its state, read from the run's units alone:

- ``not built``: the variant's wheel unit did not complete (its message says why);
- ``failed``: a suite failed against the wheel (which ones);
- ``untested``: no suite ran against it (the suites not run, and why);
- ``tested``: every suite that ran passed (a suite that could not run is still named).

Pure: a function of the config and the run manifest, so the summary (``run.json``) and the Prefect table
artifact show the same rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from kiln.core.errors import KilnError
from kiln.core.manifest import Artifact, RunManifest, Unit
from kiln.tasks.install_hint import requires_dist
from kiln.tasks.project.config import PLATFORMS, KilnConfig, Variant
from kiln.tasks.project.config_matrix import TORCH_ID, built_for, claimed_torches

CoverageState = Literal["tested", "untested", "failed", "not built"]
COVERAGE_INFO = "coverage"  # run info key: the rows, as dicts


@dataclass(frozen=True)
class CoverageRow:
    variant: str
    python: str
    torch: str
    backend: str
    archs: str
    wheel: str
    state: CoverageState
    why: str
    platform: str = "-"

    def as_dict(self) -> dict[str, str]:
        return dict(asdict(self))


def _first(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""


def _torch(requires: list[str]) -> str:
    """What the wheel asks of torch: its specifier (``==2.14.1``), ``any`` unbounded, ``-`` not at all."""
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) == "torch" and not requirement.marker:
            return str(requirement.specifier) or "any"
    return "-"


def wheel_platform(filename: str) -> str:
    """The CPUs a wheel's platform tags name (``x86_64``, ``aarch64``; ``any`` for a pure wheel), by name."""
    cpus = set()
    for tag in parse_wheel_filename(filename)[3]:
        cpus.add(next((cpu for cpu in PLATFORMS if tag.platform.endswith(f"_{cpu}")), tag.platform))
    return " ".join(sorted(cpus))


def wheel_facts(manifest: RunManifest, artifact: Artifact) -> tuple[str, str]:
    """(Python tags, torch requirement) of a built wheel."""
    tags = parse_wheel_filename(artifact.path.rsplit("/", 1)[-1])[3]
    python = ",".join(sorted({tag.interpreter for tag in tags}))
    return python, _torch(requires_dist(manifest.verify(artifact)))


def _state(wheel_unit: Unit | None, tests: list[Unit]) -> tuple[CoverageState, str]:
    if wheel_unit is None or wheel_unit.state != "completed":
        return "not built", _first(wheel_unit.message) if wheel_unit else "no build unit in this run"
    failed = [u for u in tests if u.state == "failed"]
    if failed:
        return "failed", "; ".join(f"{u.suite or u.id}: {_first(u.message)}" for u in failed)
    passed = [u for u in tests if u.state in ("completed", "flaky")]
    missing = "; ".join(f"{u.suite or u.id} {u.state.replace('_', ' ')}: {_first(u.message)}" for u in tests
                        if u.state in ("not_run", "skipped"))
    if not passed:
        return "untested", missing or "no suite runs against this wheel"
    ran = ", ".join(u.suite or u.id for u in passed)
    return "tested", f"passed: {ran}" + (f"; {missing}" if missing else "")


def _requested(variant: Variant) -> tuple[str, str]:
    """What a matrix cell asked for (``cp312``, ``==2.14.1``), shown while it has no wheel to read; ``-`` else."""
    cell = variant.cell
    if cell is None:
        return "-", "-"
    return (f"cp{cell.python.replace('.', '')}" if cell.python else "-"), (f"=={cell.torch}" if cell.torch else "-")


def _row(manifest: RunManifest, variant: Variant, torch: str = "") -> CoverageRow:
    units = [u for u in manifest.units if u.variant == variant.name]
    wheel_unit = next((u for u in units if u.id == f"build/{variant.name}/wheel"), None)
    tests = [u for u in units if u.stage == "test" and (not torch or u.id.endswith(f"{TORCH_ID}{torch}"))]
    state, why = _state(wheel_unit, tests)
    wheel = next((a for a in manifest.artifacts_of("wheel") if a.variant == variant.name), None)
    python, requested_torch = _requested(variant)
    if wheel is not None and state != "not built":
        try:
            python, requested_torch = wheel_facts(manifest, wheel)
        except KilnError as exc:  # the record lost the wheel: the row says so, the rest of the table stands
            python, requested_torch, why = "?", "?", f"{why}; its wheel cannot be read: {_first(str(exc))}"
    if torch:  # a stable-ABI wheel's row under one torch it claims: that torch, and what the wheel asks
        requested = f"{torch} ({requested_torch})" if requested_torch not in ("-", "?") else torch
    else:
        requested = requested_torch
    filename = wheel.path.rsplit("/", 1)[-1] if wheel is not None else "-"
    platform = wheel_platform(filename) if wheel is not None else " ".join(built_for(variant))
    return CoverageRow(variant.name, python, requested, variant.backend, " ".join(variant.archs) or "-",
                       filename, state, why, platform)


def coverage_rows(config: KilnConfig, manifest: RunManifest) -> list[CoverageRow]:
    """One row per requested cell (each ``[[variants]]`` entry, in ``kiln.toml``'s order); a stable-ABI cell's,
    one per torch it claims (its suites run under each: ``2.13.0 (>=2.13)``)."""
    return [_row(manifest, variant, torch) for variant in config.variants
            for torch in (claimed_torches(variant) or ("",))]
