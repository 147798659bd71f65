"""The run manifest: the spine of a run.

Every step records what it produced (path, sha256, size, step, state) and
every unit of work records its final state. Publishing reads the manifest; it
never trusts a directory or bucket listing to decide what a release contains.

``run.json`` lives at the root of the run directory; artifact paths are POSIX
paths relative to that root and may not escape it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.core.fsutil import atomic_write_text, sha256_file

SCHEMA_VERSION = 1
MANIFEST_NAME = "run.json"

Stage = Literal["build", "test", "bench", "publish", "verify"]
# not_run: a suite that could not run on this machine (no GPU of its kind); it is never "completed".
UnitState = Literal["completed", "failed", "skipped", "flaky", "not_run"]
# variant-wheel: a PEP 825 variant wheel (or the plain default wheel beside the null variant) of the public
# version, written beside each "wheel" for a combined page; today's per-variant indexes publish only "wheel".
# sdist: a pep517 project's source distribution at the release's public version, for upload targets only.
ArtifactKind = Literal[
    "wheel", "variant-wheel", "sdist", "cubin", "hsaco", "shared-library", "build-manifest", "report", "bench",
    "index", "other"
]


@dataclass(frozen=True)
class Unit:
    """One unit of work (a compile, a test suite, a benchmark, an upload)."""

    id: str
    stage: Stage
    state: UnitState
    variant: str | None = None
    arch: str | None = None
    kernel: str | None = None
    suite: str | None = None
    message: str = ""
    duration_s: float = 0.0
    cache: Literal["hit", "miss", ""] = ""
    required: bool = True


@dataclass(frozen=True)
class Artifact:
    """One file a step produced, with the hash it had when it was recorded."""

    path: str
    sha256: str
    size: int
    step: str
    kind: ArtifactKind
    variant: str | None = None
    state: Literal["ok", "failed"] = "ok"


def check_relative_path(path: str) -> str:
    """Refuse absolute paths and ``..`` so a manifest cannot point outside its run."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path or any(
        ord(ch) < 32 for ch in path
    ):
        raise InvalidInputError(f"artifact path {path!r} must be relative to the run directory, without '..'")
    return str(pure)


@dataclass
class RunManifest:
    """Mutable, thread-safe record of a run; saved atomically as ``run.json``."""

    root: Path
    run_id: str
    flow: str = "nightly"
    created: float = field(default_factory=time.time)
    version: str = ""
    units: list[Unit] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)
    info: dict[str, object] = field(default_factory=dict)
    # Where a missing local file comes from (the run record, see kiln.core.record); None: local only.
    fetch: Callable[[Artifact], Path] | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_unit(self, unit: Unit) -> Unit:
        with self._lock:
            self.units = [u for u in self.units if u.id != unit.id] + [unit]
        return unit

    def add_artifact(
        self, path: Path, *, step: str, kind: ArtifactKind, variant: str | None = None, state: str = "ok"
    ) -> Artifact:
        """Hash ``path`` (inside :attr:`root`) and record it."""
        rel = check_relative_path(Path(path).resolve().relative_to(self.root.resolve()).as_posix())
        full = self.root / rel
        artifact = Artifact(rel, sha256_file(full), full.stat().st_size, step, kind, variant, state)  # type: ignore[arg-type]
        with self._lock:
            self.artifacts = [a for a in self.artifacts if a.path != rel] + [artifact]
        return artifact

    def artifacts_of(self, kind: ArtifactKind, variant: str | None = None) -> list[Artifact]:
        return [a for a in self.artifacts if a.kind == kind and (variant is None or a.variant == variant)]

    def failed_units(self) -> list[Unit]:
        return [u for u in self.units if u.state == "failed"]

    def verify(self, artifact: Artifact) -> Path:
        """Return the artifact's path after checking its bytes against the manifest."""
        full = self.root / check_relative_path(artifact.path)
        if self.fetch is not None:
            full = self.fetch(artifact)
        if not full.is_file():
            raise IntegrityError(f"{artifact.path}: listed in {MANIFEST_NAME} but missing from {self.root}")
        actual = sha256_file(full)
        if actual != artifact.sha256:
            raise IntegrityError(
                f"{artifact.path}: sha256 {actual} does not match {artifact.sha256} recorded in {MANIFEST_NAME};"
                " the file changed after it was built — rebuild it, never publish it"
            )
        return full

    def to_json(self) -> str:
        with self._lock:
            data = {
                "schema_version": SCHEMA_VERSION,
                "run_id": self.run_id,
                "flow": self.flow,
                "created": self.created,
                "version": self.version,
                "info": self.info,
                "units": [asdict(u) for u in sorted(self.units, key=lambda u: u.id)],
                "artifacts": [asdict(a) for a in sorted(self.artifacts, key=lambda a: a.path)],
            }
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def save(self) -> Path:
        path = self.root / MANIFEST_NAME
        atomic_write_text(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: Path) -> RunManifest:
        """Load ``run.json`` (or the directory that holds it)."""
        path = Path(path)
        if path.is_dir():
            path = path / MANIFEST_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise InvalidInputError(
                f"run manifest {path} does not exist; run `kiln build` or `kiln nightly` first"
            ) from exc
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"run manifest {path} is not valid JSON: {exc}") from exc
        if data.get("schema_version") != SCHEMA_VERSION:
            raise InvalidInputError(
                f"run manifest {path} has schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}"
            )
        try:
            units = [Unit(**u) for u in data["units"]]
            artifacts = [Artifact(**a) for a in data["artifacts"]]
        except (KeyError, TypeError) as exc:
            raise InvalidInputError(f"run manifest {path} is malformed: {exc}") from exc
        for artifact in artifacts:
            check_relative_path(artifact.path)
        return cls(
            root=path.parent, run_id=data["run_id"], flow=data.get("flow", ""), created=data.get("created", 0.0),
            version=data.get("version", ""), units=units, artifacts=artifacts, info=data.get("info", {}),
        )
