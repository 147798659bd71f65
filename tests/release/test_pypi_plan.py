"""The upload planner (PyPI's rules, refused before anything moves) and the PyPI variant's public wheel."""

from __future__ import annotations

import json
import os
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInputError, RecordMismatchError
from kiln.core.wheels import check_record, core_metadata
from kiln.release.upload.pypi_plan import MIB, Candidate, IndexFile, Limits, plan_upload
from kiln.release.upload.reversion import public_wheel
from kiln.release.upload.twine import candidate
from kiln.tasks.project.config import load_config
from tests.helpers.wheelkit import make_wheel

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
MANYLINUX = "py3-none-manylinux_2_28_x86_64"
SBOM = "kiln_kernels-1.2.0+cu130.dist-info/sboms/kiln.cdx.json"
REPO = Path(__file__).resolve().parents[2]


def _sbom(version: str) -> bytes:
    ref = f"pkg:pypi/kiln-kernels@{version.replace('+', '%2B')}"
    return json.dumps({"metadata": {"component": {"name": "kiln-kernels", "version": version, "bom-ref": ref,
                                                  "purl": ref}},
                       "components": [{"name": "kiln_kernels/_aot/k.cubin", "bom-ref": "file:k.cubin"}],
                       "dependencies": [{"ref": ref, "dependsOn": ["file:k.cubin"]}]}).encode()


def _candidate(filename: str, size: int = 1000, sha: str = "a" * 64) -> Candidate:
    return Candidate(filename, sha, size)


def test_the_public_wheel_keeps_every_binary_and_names_the_public_version(tmp_path):
    binary = os.urandom(4096)
    wheel = make_wheel(tmp_path / "in", "kiln-kernels", "1.2.0+cu130", tag=MANYLINUX,
                       files={"kiln_kernels/_aot/k.cubin": binary, SBOM: _sbom("1.2.0+cu130")})
    public = public_wheel(wheel, tmp_path / "out")
    assert public.name == f"kiln_kernels-1.2.0-{MANYLINUX}.whl"
    check_record(public.name, public)  # a new RECORD that describes every member
    assert b"Version: 1.2.0\n" in core_metadata(public.name, public)
    with zipfile.ZipFile(wheel) as old, zipfile.ZipFile(public) as new:
        assert new.read("kiln_kernels/_aot/k.cubin") == binary == old.read("kiln_kernels/_aot/k.cubin")
        assert new.read("kiln_kernels/__init__.py") == old.read("kiln_kernels/__init__.py")
        assert not [n for n in new.namelist() if "+cu130" in n]
        sbom = json.loads(new.read("kiln_kernels-1.2.0.dist-info/sboms/kiln.cdx.json"))
    subject = sbom["metadata"]["component"]
    assert (subject["version"], subject["purl"]) == ("1.2.0", "pkg:pypi/kiln-kernels@1.2.0")
    assert sbom["dependencies"][0]["ref"] == "pkg:pypi/kiln-kernels@1.2.0"
    again = public_wheel(wheel, tmp_path / "again")  # a re-run writes the same bytes: the index already holds them
    assert again.read_bytes() == public.read_bytes()


def test_a_wheel_whose_record_lies_is_not_re_versioned(tmp_path):
    wheel = make_wheel(tmp_path, "kiln-kernels", "1.2.0+cu130", tag=MANYLINUX)
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr("kiln_kernels/extra.so", b"not in RECORD")
    with pytest.raises(RecordMismatchError, match="extra.so is not listed in RECORD"):
        public_wheel(wheel, tmp_path / "out")


def test_a_file_over_the_limit_is_refused_with_its_ten_largest_members(tmp_path):
    members = {f"kiln_kernels/lib{i:02d}.so": os.urandom((i + 1) * 8 * 1024) for i in range(12)}
    wheel = make_wheel(tmp_path, "kiln-kernels", "1.2.0", tag=MANYLINUX, files=members)
    plan = plan_upload("pypi", "1.2.0", [candidate(wheel)], [], NOW, Limits(file_bytes=MIB // 2))
    [refused] = plan.refusals
    assert f"{wheel.name} is 0.6 MiB, over the project's limit of 0.5 MiB" in refused.reason
    listed = refused.reason.split("Largest members: ")[1]
    assert [name.split(" ")[0] for name in listed.split(", ")] == [f"kiln_kernels/lib{i:02d}.so"
                                                                    for i in range(11, 1, -1)]
    assert plan.uploads == []


def test_a_quota_projection_over_the_limit_refuses_the_upload():
    existing = [IndexFile(f"kiln_kernels-1.{i}.0-py3-none-any.whl", "b" * 64, 3 * MIB) for i in range(3)]
    plan = plan_upload("pypi", "1.3.0", [_candidate("kiln_kernels-1.3.0-py3-none-any.whl", 2 * MIB)], existing, NOW,
                       Limits(file_bytes=100 * MIB, quota_bytes=10 * MIB))
    [refused] = plan.refusals
    assert "would hold 11.0 MiB after this upload (9.0 MiB now), over its quota of 10.0 MiB" in refused.reason
    assert plan.projected_bytes == 11 * MIB and "9.0 MiB now, 11.0 MiB after this upload, quota 10.0 MiB" in (
        plan.to_markdown())


@pytest.mark.parametrize("age_days, refused", [(15, True), (13, False)])
def test_a_release_whose_first_file_is_over_14_days_old_takes_no_new_file(age_days, refused):
    first = NOW - timedelta(days=age_days)
    existing = [IndexFile("kiln_kernels-1.2.0-py3-none-any.whl", "b" * 64, 10, first),
                IndexFile("kiln_kernels-1.1.0-py3-none-any.whl", "c" * 64, 10, NOW - timedelta(days=400))]
    plan = plan_upload("pypi", "1.2.0", [_candidate(f"kiln_kernels-1.2.0-{MANYLINUX}.whl")], existing, NOW)
    assert plan.first_upload == first
    if refused:
        assert "release's first file was uploaded on 2026-11-21 (15 days ago)" in plan.refusals[0].reason
        assert "older than 14 days" in plan.refusals[0].reason
    else:
        assert [c.filename for c in plan.uploads] == [f"kiln_kernels-1.2.0-{MANYLINUX}.whl"]
        assert "new files accepted until 2026-12-07" in plan.to_markdown()


@pytest.mark.parametrize("filename, reason", [
    ("kiln_kernels-1.2.0+cu130-py3-none-manylinux_2_28_x86_64.whl", "has a local label (+cu130); PyPI refuses"),
    ("kiln_kernels-1.2.0-cp311-cp311-linux_x86_64.whl", "platform tag linux_x86_64 is refused by PyPI"),
    ("kiln_kernels-1.2.0+cpu.tar.gz", "has a local label (+cpu)"),
])
def test_what_pypi_refuses_is_refused_in_the_plan_with_the_reason(filename, reason):
    plan = plan_upload("pypi", "1.2.0", [_candidate(filename)], [], NOW)
    assert [f.action for f in plan.files] == ["refuse"] and reason in plan.files[0].reason


@pytest.mark.parametrize("filename", [f"kiln_kernels-1.2.0-{MANYLINUX}.whl", "kiln_kernels-1.2.0-py3-none-any.whl",
                                      "kiln_kernels-1.2.0.tar.gz"])
def test_what_pypi_takes_is_planned_for_upload(filename):
    assert [c.filename for c in plan_upload("pypi", "1.2.0", [_candidate(filename)], [], NOW).uploads] == [filename]


def test_a_file_on_the_index_is_checked_first_same_bytes_skipped_other_bytes_refused_by_name():
    same, other = "kiln_kernels-1.2.0-py3-none-any.whl", f"kiln_kernels-1.2.0-{MANYLINUX}.whl"
    existing = [IndexFile(same, "a" * 64, 1000, NOW - timedelta(days=30)), IndexFile(other, "f" * 64, 1000)]
    plan = plan_upload("pypi", "1.2.0", [_candidate(same), _candidate(other)], existing, NOW)
    assert [(f.action, f.candidate.filename) for f in plan.files] == [("skip", same), ("refuse", other)]
    assert plan.files[1].reason.startswith(f"{other} is already on the index with sha256 {'f' * 64}")
    assert "bump the version" in plan.files[1].reason


def test_a_limit_over_pypis_largest_grant_is_refused():
    with pytest.raises(InvalidInputError, match="at most 1 GiB"):
        Limits(file_bytes=2 << 30)


def _config(tmp_path: Path, table: str) -> Path:
    text = (REPO / "tests" / "fixtures" / "projects" / "tiny" / "kiln.toml").read_text()
    path = tmp_path / "kiln.toml"
    kind = "" if "kind =" in table else "kind = \"upload\"\n"
    path.write_text(text + "\n[publish.targets.pypi]\n" + kind + table)
    (tmp_path / "tinyk").mkdir()
    (tmp_path / "tests").mkdir()
    return path


def test_an_upload_target_is_read_from_publish_targets(tmp_path):
    config = load_config(str(_config(tmp_path, 'url = "https://upload.pypi.org/legacy/"\n'
                                               'index_url = "https://pypi.org/simple/"\npypi_variant = "cpu"\n'
                                               'size_limit_mib = 400\n')))
    target = config.publish.upload_targets["pypi"]
    assert (target.pypi_variant, target.size_limit_mib, target.quota_gib) == ("cpu", 400, 10)
    assert "pypi" not in config.publish.targets  # stores, policies and credentials see file:// and s3:// only


@pytest.mark.parametrize("table, needle", [
    ('url = "https://u/legacy/"\nindex_url = "https://p/simple/"\npypi_variant = "cu13"\n',
     "unknown variant 'cu13' (did you mean 'cu130'?)"),
    ('url = "https://u/legacy/"\nindex_url = "https://p/simple/"\npypi_variant = "cpu"\nsize_limit_mib = 2048\n',
     "less than or equal to 1024"),
    ('url = "ftp://u/legacy/"\nindex_url = "https://p/simple/"\npypi_variant = "cpu"\n',
     "publish.targets.pypi.url: 'ftp://u/legacy/' must be an http(s)://"),
    ('url = "https://u/legacy/"\nindex_url = "https://p/simple/"\npypi_varient = "cpu"\n',
     "missing key 'publish.targets.pypi.pypi_variant'\n  - unknown key 'publish.targets.pypi.pypi_varient'"),
    ('url = "https://u/legacy/"\nindex_url = "https://p/simple/"\npypi_variant = "cpu"\nkind = "s3"\n',
     "targets.pypi.kind: 's3' is not a target kind"),
])
def test_a_bad_upload_target_is_a_config_error_naming_it(tmp_path, table, needle):
    with pytest.raises(Exception, match="pypi") as info:
        load_config(str(_config(tmp_path, table)))
    assert needle in str(info.value)


def test_a_file_of_another_version_than_the_release_is_refused_naming_both():
    plan = plan_upload("pypi", "0.3.0", [_candidate("tiny_kernels-0.3.0.tar.gz"),
                                         _candidate("tiny_kernels-0.2.0.tar.gz", sha="b" * 64)], [], NOW)
    assert [c.filename for c in plan.uploads] == ["tiny_kernels-0.3.0.tar.gz"]
    [refused] = plan.refusals
    assert refused.reason.startswith("tiny_kernels-0.2.0.tar.gz: version 0.2.0 is not the release's 0.3.0")
