"""What a fresh test environment gets besides its own installs: the base layer, Kiln's harness, the guard.

- :func:`layer_base`: the base environment's site-packages as a ``.pth`` path
  line, so it comes *after* the environment's own; its ``*.dist-info``
  directories are copied into the environment's site-packages too, so uv
  sees torch & co. as installed (and, with :func:`installed_pins` as
  constraints, never downloads them).
- :func:`expose_harness`: a directory holding only ``kiln/flows``,
  ``kiln/release`` and ``kiln/tasks`` (copies of where this Kiln's modules
  live, editable or not: a test that edits them reaches neither Kiln nor
  another suite), on the path after everything else: the worker
  (``python -P -m kiln.tasks.testing.pytest_server``) and the bench server import
  Kiln from it, and nothing else of Kiln's site-packages is visible.
  ``kiln.runtime`` comes from the ``kiln-runtime`` wheel installed into the
  environment (``kiln`` is a namespace package).
- :func:`install_guard`: :mod:`.importguard` copied in, configured with what
  the wheel's modules and the test files may not import.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

from kiln.core.errors import InfrastructureError
from kiln.core.fsutil import atomic_write_text
from kiln.core.venvs import layer, safe_path_flag
from kiln.tasks.testing import importguard

log = logging.getLogger(__name__)

HARNESS_PACKAGES = ("core", "flows", "release", "tasks")  # kiln.<these>; kiln.runtime is the kiln-runtime wheel's
GUARD_TIMEOUT_S = 120.0


def layer_base(site: Path, base_site: Path) -> None:
    """Put ``base_site`` on the environment's path after its own site-packages; copy its dist-infos in.

    Copies, not links: uv rewrites an installed distribution's dist-info when it reinstalls one (a wheel
    requiring ``jinja2``, which the base holds, gets it installed into the environment), and through a link
    that write would land in the shared base.
    """
    layer(site, "zz_kiln_base", base_site)
    for info in sorted(base_site.glob("*.dist-info")):
        shutil.copytree(info, site / info.name, copy_function=shutil.copyfile)


def installed_pins(site: Path) -> list[str]:
    """``name==version`` of every distribution installed in ``site``."""
    found = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=[str(site)])}
    return [f"{name}=={version}" for name, version in sorted(found.items())]


def expose_harness(site: Path, harness: Path) -> None:
    """Kiln's own packages (only them) importable in the environment, from ``harness``."""
    package = harness / "kiln"
    package.mkdir(parents=True)
    for name in HARNESS_PACKAGES:
        spec = importlib.util.find_spec(f"kiln.{name}")
        if spec is None or not spec.submodule_search_locations:
            raise InfrastructureError(f"kiln.{name} is not importable here, so the test environment cannot run "
                                      "Kiln's harness; reinstall Kiln")
        shutil.copytree(Path(list(spec.submodule_search_locations)[0]), package / name)
    (site / "zzz_kiln_harness.pth").write_text(f"{harness}\n")


def install_guard(site: Path, python: Path, wheel: str, distribution: str, test_roots: Sequence[str],
                  tests_root: Path | None, test_paths: Sequence[str] = (), installed: Sequence[Path] = ()) -> None:
    """Configure and install the import guard for ``distribution`` (the wheel ``wheel``) in ``site``.

    Test code is what lies under ``test_paths`` (relative to ``tests_root``, node ids allowed; none: all of
    it) and the conftest files above them; nothing under ``installed`` (the environment, its base) is.
    """
    args = json.dumps({"wheel_dist": distribution, "extra_roots": list(test_roots)})
    try:
        done = subprocess.run([str(python), safe_path_flag(python), "-c", importguard.REFUSALS_SCRIPT, args],
                              capture_output=True,
                              text=True, timeout=GUARD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InfrastructureError(f"listing what {wheel} declares did not finish in {GUARD_TIMEOUT_S:g}s") from exc
    if done.returncode != 0:
        raise InfrastructureError(f"listing what {wheel} declares failed (exit {done.returncode}): "
                                  f"{done.stderr.strip()[-1500:]}")
    config = json.loads(done.stdout)
    if not config["packages"]:
        log.warning("the import guard of %s knows no module of %s (no RECORD?): it guards only the tests", site, wheel)
    root = tests_root.resolve() if tests_root else None
    config.update(wheel=wheel, tests_root=str(root or ""),
                  test_paths=[str((root / p.partition("::")[0]).resolve()) for p in test_paths] if root else [],
                  installed=sorted({str(p) for r in installed for p in (r.absolute(), r.resolve())}))
    atomic_write_text(site / importguard.CONFIG, json.dumps(config, indent=1, sort_keys=True) + "\n")
    shutil.copyfile(importguard.__file__, site / f"{importguard.MODULE}.py")
    (site / f"{importguard.MODULE}.pth").write_text(f"import {importguard.MODULE}; {importguard.MODULE}.install()\n")
    log.info("import guard of %s: its modules %s may not import %d undeclared top-level names",
             wheel, config["packages"], len(config["for_package"]))
