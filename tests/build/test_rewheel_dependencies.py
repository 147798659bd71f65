"""pep517: ``[project] dependencies`` are merged into the backend's ``Requires-Dist``; members are read bounded.

Real parts: wheels written with ``wheel.WheelFile`` (as a backend writes them), rewritten by the rewheel step,
published with the publish protocol into a local directory, and the summary rendered from that run.
"""

from __future__ import annotations

import json
import zipfile
from email.parser import BytesParser
from pathlib import Path

import pytest

from kiln.core.errors import CompileError
from kiln.core.manifest import RunManifest
from kiln.core.store import LocalStore
from kiln.flows.report.summary import render_text
from kiln.release.publish.protocol import PublishRequest, publish
from kiln.tasks.install_hint import install_facts, requires_dist
from kiln.tasks.project.config import load_config
from kiln.tasks.wheel import rewheel
from kiln.tasks.wheel.assemble import WheelStamp, write_wheel
from kiln.tasks.wheel.rewheel import merged_requires, rewrite_wheel
from tests.helpers.projects import copy_project

OWN = ("numpy>=1.20", 'pytest; extra == "test"')


def _built(tmp_path: Path, requires: tuple[str, ...] = OWN, extra: dict[str, bytes] | None = None) -> Path:
    """A wheel as a backend writes it: plaincuda 1.0.0 with ``requires`` as its Requires-Dist."""
    metadata = "Metadata-Version: 2.1\nName: plaincuda\nVersion: 1.0.0\nProvides-Extra: test\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires) + "\nDescription.\n"
    members = {"plaincuda/__init__.py": b"x = 1\n", "plaincuda-1.0.0.dist-info/METADATA": metadata.encode(),
               "plaincuda-1.0.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: setuptools\n"
                                                  b"Root-Is-Purelib: true\nTag: py3-none-any\n", **(extra or {})}
    stamp = WheelStamp.for_commit("c" * 40, 1764536823, {}, environ={})
    return write_wheel(tmp_path / "built", "plaincuda-1.0.0-py3-none-any.whl", sorted(members.items()), stamp)


def _rewrite(tmp_path: Path, dependencies: list[str] | None) -> Path:
    kiln_toml = copy_project("plaincuda", tmp_path)
    if dependencies is not None:
        text = kiln_toml.read_text().replace('source = "plaincuda"\n',
                                             f'source = "plaincuda"\ndependencies = {json.dumps(dependencies)}\n')
        kiln_toml.write_text(text)
    config = load_config(kiln_toml)
    stamp = WheelStamp.for_commit("c" * 40, 1764536823, {}, environ={})
    return rewrite_wheel(config, config.variant("cpu"), "1.0.0.dev5+cpu", _built(tmp_path), [], [],
                         tmp_path / "run" / "wheels" / "cpu", stamp)


def _summary(tmp_path: Path, wheel: Path) -> str:
    run = RunManifest(tmp_path / "run", "r1", flow="nightly", version="1.0.0.dev5")
    run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")
    plan = publish(run, LocalStore(tmp_path / "index"),
                   PublishRequest(channel="nightly", channel_prefix="nightly", variants=["cpu"]))
    install = install_facts("plaincuda", [], plan, check=False)
    run.info["index_url"] = list(install["indexes"])
    run.info["install"] = install
    return render_text(run)


def test_project_dependencies_are_merged_into_the_wheels_requires_dist_and_the_summary_says_so(tmp_path):
    wheel = _rewrite(tmp_path, ["NumPy<3", "packaging>=22", 'pytest; extra == "test"'])
    requires = requires_dist(wheel)
    # the backend's numpy joined with kiln.toml's under its canonical name, the same pytest line once, then the new one
    assert requires == ["numpy<3,>=1.20", 'pytest; extra == "test"', "packaging>=22"]
    assert f"plaincuda 1.0.0.dev5+cpu requires {', '.join(requires)} (its wheel's Requires-Dist)" in \
        _summary(tmp_path, wheel)


def test_without_project_dependencies_the_wheel_keeps_the_backends_own_and_the_summary_states_those(tmp_path):
    wheel = _rewrite(tmp_path, None)
    assert requires_dist(wheel) == list(OWN)
    assert f"plaincuda 1.0.0.dev5+cpu requires {', '.join(OWN)} (its wheel's Requires-Dist)" in \
        _summary(tmp_path, wheel)


def test_a_backend_wheel_without_requires_dist_gets_exactly_the_project_dependencies(tmp_path):
    assert merged_requires([], ["torch>=2.6", "triton"]) == ["torch>=2.6", "triton"]
    assert merged_requires(["Torch>=2.6"], ["torch>=2.6"]) == ["Torch>=2.6"]  # the same requirement once
    # a different marker or extra condition is another requirement, kept apart
    assert merged_requires(["numpy"], ['numpy<2; python_version < "3.10"']) == \
        ["numpy", 'numpy<2; python_version < "3.10"']


def test_a_member_past_its_limit_is_refused_naming_the_wheel_and_member_before_it_is_inflated(tmp_path, monkeypatch):
    built = _built(tmp_path, extra={"plaincuda/big.bin": b"\0" * 4096})
    monkeypatch.setattr(rewheel, "MAX_LIBRARY_BYTES", 1024)  # fault injection: a small limit, not a 4 GiB file
    with pytest.raises(CompileError, match=r"plaincuda-1.0.0-py3-none-any.whl.*plaincuda/big.bin.*4096 bytes"):
        rewheel.read_members(built)
    dist_info, members = rewheel.read_members(_built(tmp_path / "ok"))
    assert dist_info == "plaincuda-1.0.0.dist-info" and members["plaincuda/__init__.py"] == b"x = 1\n"
    with zipfile.ZipFile(built) as archive:  # the member really is larger than the limit
        assert archive.getinfo("plaincuda/big.bin").file_size == 4096


def test_rewritten_metadata_parses_with_the_merged_lines(tmp_path):
    wheel = _rewrite(tmp_path, ["packaging"])
    with zipfile.ZipFile(wheel) as archive:
        metadata = BytesParser().parsebytes(archive.read("plaincuda-1.0.0.dev5+cpu.dist-info/METADATA"))
    assert metadata.get_all("Requires-Dist") == ["numpy>=1.20", 'pytest; extra == "test"', "packaging"]
    assert metadata.get_payload() == "Description.\n"
