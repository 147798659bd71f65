"""The upload seam: a new upload kind is one module (an Uploader and its target's config model) and one table entry.

The kind here is a fake written for the test (``test-directory``: its "index"
is a folder under tmp_path, its config model has keys of its own), registered
in ``UPLOAD_KINDS`` by the test alone. kiln.toml's loader validates its target
by its model, and the release's upload path (:func:`kiln.flows.pypi.plan_uploads`
then :func:`~kiln.flows.pypi.upload_release`, as the release flow calls them)
reaches its uploader, credentials included, through the table with no other edit.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import pytest
from prefect import flow
from pydantic import BaseModel, ConfigDict

from kiln.core.errors import ConfigError
from kiln.core.fsutil import sha256_file
from kiln.core.record import RunRecord
from kiln.flows.pypi import plan_uploads, upload_release
from kiln.release.upload.kinds import UPLOAD_KINDS, UploadKind, UploadTargetConfig
from kiln.release.upload.pypi_plan import IndexFile, PlannedFile, UploadPlan
from kiln.release.upload.pypi_release import PreparedUpload, UploadRequest
from kiln.release.upload.twine import Endpoint, IndexCredentials, Outcome, candidate
from kiln.release.upload.uploaders import PyPIUploader, Uploader, uploader_for
from kiln.tasks import uploading
from kiln.tasks.project.config import KilnConfig, load_config
from tests.helpers.gitrepo import commit_all, init_repo
from tests.helpers.runkit import make_record
from tests.helpers.wheelkit import make_wheel

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "fixtures" / "projects" / "tiny"
FAKE_KIND = "test-directory"


class DirectoryTarget(BaseModel):
    """The fake kind's ``[publish.targets.<name>]``: the keys the release reads, and two of its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["test-directory"]
    url: str
    index_url: str
    pypi_variant: str
    sdist: bool = False
    size_limit_mib: int = 100
    quota_gib: float = 10
    timeout_s: float = 60
    token_block: str | None = None  # its token's Secret block, read by the fake's credentials
    mint_for: str | None = None  # instead: the fake mints a token for this user, as Trusted Publishing would


class DirectoryUploader:
    """The test's fake kind: the index is a local folder (``file://`` URLs name it); every file is sent as is."""

    def __init__(self) -> None:
        self.asked: list[str] = []  # the targets its credentials were asked for, one per send
        self.sent_with: list[IndexCredentials] = []

    def holds(self, index_url: str, project: str) -> list[IndexFile]:
        return [IndexFile(p.name, sha256_file(p), p.stat().st_size) for p in sorted(_folder(index_url).glob("*"))]

    def plan(self, request: UploadRequest, out_dir: Path, now: datetime) -> PreparedUpload:
        held = {f.filename for f in self.holds(request.endpoint.index_url, request.project)}
        files = [PlannedFile(candidate(p), "skip" if p.name in held else "upload") for p in request.wheels]
        return PreparedUpload(UploadPlan(request.endpoint.name, request.version, files),
                              {p.name: p for p in request.wheels})

    def send(self, path: Path, endpoint: Endpoint, credentials: IndexCredentials) -> Outcome:
        self.sent_with.append(credentials)
        shutil.copyfile(path, _folder(endpoint.upload_url) / path.name)
        return "added"

    def credentials(self, target: UploadTargetConfig, name: str, secret: Callable[[str], str]) -> IndexCredentials:
        assert isinstance(target, DirectoryTarget)
        self.asked.append(name)
        if target.mint_for is not None:
            return IndexCredentials(target.mint_for, f"minted-for-{name}")
        assert target.token_block is not None
        return IndexCredentials("fake", secret(target.token_block))


def _folder(url: str) -> Path:
    return Path(urlparse(url).path)


@pytest.fixture
def fake_kind() -> Iterator[DirectoryUploader]:
    # the one table entry a new kind adds
    UPLOAD_KINDS[FAKE_KIND] = UploadKind(f"{__name__}:DirectoryUploader", f"{__name__}:DirectoryTarget")
    try:
        fake = uploader_for(FAKE_KIND)
        assert isinstance(fake, DirectoryUploader)
        fake.asked.clear()  # the table keeps one uploader per entry: an earlier test's sends are not this one's
        fake.sent_with.clear()
        yield fake
    finally:
        del UPLOAD_KINDS[FAKE_KIND]


def _config(tmp_path: Path, folder: Path, block: str, kind: str = FAKE_KIND) -> tuple[Path, KilnConfig]:
    """tiny's kiln.toml with one upload target of ``kind``: the loader takes its kinds from
    :data:`~kiln.release.upload.kinds.UPLOAD_KINDS`, so the table entry is all a new kind needs."""
    path = _write_config(tmp_path, folder, kind, f'token_block = "{block}"')
    return path, load_config(path)


def _write_config(tmp_path: Path, folder: Path, kind: str, *keys: str) -> Path:
    root = tmp_path / "tiny"
    shutil.copytree(TINY, root, ignore=shutil.ignore_patterns(".kiln", "__pycache__"))
    init_repo(root)
    path = root / "kiln.toml"
    text = path.read_text()
    cpu_only = text[:text.index("[[variants]]")] + text[text.index('[[variants]]\nname = "cpu"'):]
    path.write_text(cpu_only + "\n".join([
        "", "[publish.targets.folder]", f'kind = "{kind}"', f'url = "file://{folder}"',
        f'index_url = "file://{folder}"', 'pypi_variant = "cpu"', *keys, ""]))
    commit_all(root, "upload the cpu variant to a folder")
    return path


@flow
def plan_then_upload(config: KilnConfig, run: RunRecord) -> tuple[list[str], list[str]]:
    _, refusals = plan_uploads(config, run, "0.3.0")
    return refusals, [state.message or "" for state in upload_release(config, run, "0.3.0")]


def test_the_pypi_kind_is_the_table_entry_upload_and_an_unknown_kind_is_named():
    uploader: Uploader = uploader_for("upload")
    assert isinstance(uploader, PyPIUploader)
    with pytest.raises(ConfigError, match=r"upload kind 'gs-bucket' has no uploader; the kinds are \['upload'\]"):
        uploader_for("gs-bucket")


def test_a_kind_registered_in_the_table_is_reached_by_the_release_upload_path(prefect_server, fake_kind, tmp_path):
    from prefect.blocks.system import Secret

    block = f"kiln-fake-{uuid.uuid4().hex[:8]}"
    Secret(value="fake-kind-token").save(block)
    folder = tmp_path / "index"
    folder.mkdir()
    path, config = _config(tmp_path, folder, block)
    assert uploading.uploader(config, "folder") is fake_kind
    run = make_record(path, tmp_path / "out", {})
    wheel = make_wheel(run.view / "wheels" / "cpu", "tiny-kernels", "0.3.0+cpu", payload="this build")
    run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")

    refusals, messages = plan_then_upload(config, run)
    assert refusals == []
    assert messages == ["upload to folder: 1 files sent, 0 skipped"]
    assert [p.name for p in folder.iterdir()] == [wheel.name]
    assert sha256_file(folder / wheel.name) == sha256_file(wheel)
    assert [c.password for c in fake_kind.sent_with] == ["fake-kind-token"]  # read inside the send, as PyPI's
    assert fake_kind.asked == ["folder"]  # by the target's own uploader
    assert {u.id: u.state for u in run.units() if u.id.startswith("publish/folder/")} == {
        f"publish/folder/{wheel.name}": "completed"}

    assert plan_then_upload(config, run)[1] == ["upload to folder: 0 files sent, 1 skipped"]  # the fake's holds


@pytest.mark.parametrize("kind, needle", [
    ("test-directory", "targets.folder.kind: 'test-directory' is not a target kind; the kinds are ['upload']"),
    ("uplaod", "targets.folder.kind: 'uplaod' is not a target kind (did you mean 'upload'?); the kinds are"),
])
def test_a_kind_not_in_the_table_is_refused_at_load_naming_the_key_and_the_kinds(tmp_path, kind, needle):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, tmp_path / "index", "kiln-unused-block", kind)  # the fake kind is not registered here
    assert needle in str(info.value)


def test_loading_a_config_with_an_upload_target_imports_no_uploader_nor_twine_nor_wheel(tmp_path):
    # A wheel's environment (the bench harness, the test server) loads kiln.toml without twine or wheel installed.
    path = _write_config(tmp_path, tmp_path / "index", "upload", 'token_block = "kiln-unused-block"')
    probe = ("import sys\n"
             "from kiln.tasks.project.config import load_config\n"
             f"config = load_config({str(path)!r})\n"
             "assert config.publish.upload_targets['folder'].kind == 'upload'\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('twine', 'wheel')"
             " or m == 'kiln.release.upload.uploaders'))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_kind_whose_uploader_mints_its_credentials_uploads_without_any_token_block(
        prefect_server, fake_kind, tmp_path):
    folder = tmp_path / "index"
    folder.mkdir()
    path = _write_config(tmp_path, folder, FAKE_KIND, 'mint_for = "ci-identity"')
    config = load_config(path)
    assert config.publish.upload_targets["folder"] == DirectoryTarget(
        kind=FAKE_KIND, url=f"file://{folder}", index_url=f"file://{folder}", pypi_variant="cpu",
        mint_for="ci-identity")  # the kind's own model, its own keys
    assert uploading.missing_tokens(config) == []  # a real release is not refused for want of a token block
    run = make_record(path, tmp_path / "out", {})
    wheel = make_wheel(run.view / "wheels" / "cpu", "tiny-kernels", "0.3.0+cpu", payload="this build")
    run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")

    assert plan_then_upload(config, run) == ([], ["upload to folder: 1 files sent, 0 skipped"])
    assert fake_kind.asked == ["folder"]
    assert fake_kind.sent_with == [IndexCredentials("ci-identity", "minted-for-folder")]


@pytest.mark.parametrize("kind, key", [
    ("upload", 'tokn_block = "kiln-token"'),  # a misspelt key of its own
    ("upload", 'mint_for = "ci-identity"'),  # the fake kind's key: the upload kind's model does not know it
    (FAKE_KIND, 'username = "__token__"'),  # the upload kind's key: the fake's model does not know it
])
def test_a_key_the_kinds_model_does_not_know_is_refused_at_load_naming_it(fake_kind, tmp_path, kind, key):
    path = _write_config(tmp_path, tmp_path / "index", kind, key)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"unknown key 'publish.targets.folder.{key.split()[0]}'" in str(info.value)
