"""The generated IAM documents: shape, determinism, and refusal of bad input."""

from __future__ import annotations

import fnmatch
import json
import os
import tomllib

import pytest

from kiln.core.errors import ConfigError
from kiln.flows.cli.policies import policies_command
from kiln.release.stores.policies import DESTRUCTIVE_ACTIONS, StepAccess, policies_for, render, session_policy
from kiln.tasks.build.compile_tier import COMPILE_PREFIX
from tests.helpers.moto_iam import REPO

CHANNELS = {"nightly": "nightly", "release": "release"}
STEPS = {
    "build": StepAccess(("artifacts/",), ("artifacts/",)),
    "test": StepAccess(("artifacts/",), ("artifacts/",)),
    "bench": StepAccess(("artifacts/", "bench-history/"), ("bench-history/",)),
    "publish-nightly": StepAccess(("nightly/",), ("nightly/",)),
    "publish-release": StepAccess(("release/",), ("release/",)),
}


def _statements(document, effect, action):
    return [s for s in document["Statement"] if s["Effect"] == effect and action in s["Action"]]


def _resources(document, effect, action):
    return sorted(r for s in _statements(document, effect, action) for r in s["Resource"])


def test_each_step_writes_only_its_declared_prefixes():
    docs = policies_for("b", "simple", STEPS, CHANNELS)
    assert sorted(docs) == sorted(STEPS)
    assert _resources(docs["build"], "Allow", "s3:PutObject") == ["arn:aws:s3:::b/simple/artifacts/*"]
    assert _resources(docs["bench"], "Allow", "s3:PutObject") == ["arn:aws:s3:::b/simple/bench-history/*"]
    assert _resources(docs["publish-nightly"], "Allow", "s3:PutObject") == ["arn:aws:s3:::b/simple/nightly/*"]
    assert _resources(docs["publish-release"], "Allow", "s3:PutObject") == ["arn:aws:s3:::b/simple/release/*"]


def test_non_publishers_are_denied_every_index_and_publishers_the_other_channel():
    docs = policies_for("b", "simple", STEPS, CHANNELS)
    both = ["arn:aws:s3:::b/simple/nightly/*", "arn:aws:s3:::b/simple/release/*"]
    ledger = "arn:aws:s3:::b/simple/artifacts/build-ledger/*"  # only the build writes what bisect trusts
    assert _resources(docs["build"], "Deny", "s3:PutObject*") == both
    for step in ("test", "bench"):
        assert _resources(docs[step], "Deny", "s3:PutObject*") == [ledger, *both]
    assert _resources(docs["publish-nightly"], "Deny", "s3:PutObject*") == [ledger, "arn:aws:s3:::b/simple/release/*"]
    assert _resources(docs["publish-release"], "Deny", "s3:PutObject*") == [ledger, "arn:aws:s3:::b/simple/nightly/*"]


def test_every_step_is_denied_deletes_and_bucket_settings_and_never_allowed_them():
    for step, doc in policies_for("b", "", STEPS, CHANNELS).items():
        denied = _statements(doc, "Deny", "s3:Delete*")
        assert denied and set(DESTRUCTIVE_ACTIONS) <= set(denied[0]["Action"]), step
        assert denied[0]["Resource"] == ["arn:aws:s3:::b", "arn:aws:s3:::b/*"]
        allowed = {a for s in doc["Statement"] if s["Effect"] == "Allow" for a in s["Action"]}
        assert allowed <= {"s3:GetObject", "s3:ListBucket", "s3:PutObject", "s3:AbortMultipartUpload"}, step


def test_listing_is_scoped_to_the_read_prefixes():
    doc = policies_for("b", "simple/", STEPS, CHANNELS)["bench"]
    (listing,) = _statements(doc, "Allow", "s3:ListBucket")
    assert listing["Resource"] == ["arn:aws:s3:::b"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["simple/artifacts/*", "simple/bench-history/*"]}}


def test_output_is_deterministic_and_fits_a_session_policy():
    shuffled = dict(reversed(list(STEPS.items())))
    first = {s: render(d) for s, d in policies_for("b", "simple", STEPS, CHANNELS).items()}
    second = {s: render(d) for s, d in policies_for("b", "/simple/"[1:], shuffled, dict(reversed(CHANNELS.items()))).items()}
    assert first == second
    for doc in map(json.loads, first.values()):
        assert len(session_policy(doc)) <= 2048


@pytest.mark.parametrize(
    "step, access, needle",
    [
        ("build", StepAccess((), ("nightly/",)), "only publish-nightly may write an index"),
        ("bench", StepAccess((), ("",)), "overlaps the nightly index prefix"),
        ("test", StepAccess((), ("release/sub/",)), "only publish-release may write an index"),
        ("publish-nightly", StepAccess((), ("release/",)), "outside the nightly channel prefix"),
        ("publish-release", StepAccess((), ("artifacts/",)), "outside the release channel prefix"),
        ("build", StepAccess(("../x/",), ()), "plain relative path"),
        ("build", StepAccess((), ("art*/",)), "IAM wildcards"),
        ("deploy", StepAccess(), "unknown steps ['deploy']"),
    ],
)
def test_bad_permissions_are_refused_with_the_key(step, access, needle):
    with pytest.raises(ConfigError, match=None) as info:
        policies_for("b", "simple", {**STEPS, step: access}, CHANNELS)
    assert needle in str(info.value)


def test_policies_command_writes_one_file_per_step(tmp_path):
    assert policies_command(str(REPO / "kiln.toml"), str(tmp_path / "pol")) == 0
    files = sorted(p.name for p in (tmp_path / "pol").iterdir())
    assert files == ["bench.json", "build.json", "prune-nightly.json", "publish-nightly.json", "publish-release.json",
                     "test.json"]
    doc = json.loads((tmp_path / "pol" / "publish-release.json").read_text())
    assert _resources(doc, "Allow", "s3:PutObject") == ["arn:aws:s3:::kiln-wheels/simple/bench-history/published/*",
                                                        "arn:aws:s3:::kiln-wheels/simple/release/*"]


def test_only_the_release_publisher_may_write_the_release_baseline(tmp_path):
    """The bench step writes benchmark history, never the baseline a release is judged against: its document,
    and every other step's but publish-release's, denies ``<history>/published/`` explicitly."""
    assert policies_command(str(REPO / "kiln.toml"), str(tmp_path / "pol")) == 0
    baseline = "arn:aws:s3:::kiln-wheels/simple/bench-history/published/*"
    for path in sorted((tmp_path / "pol").iterdir()):
        doc = json.loads(path.read_text())
        denied = baseline in _resources(doc, "Deny", "s3:PutObject*")
        allowed = baseline in _resources(doc, "Allow", "s3:PutObject")
        assert (allowed, denied) == ((True, False) if path.stem == "publish-release" else (False, True)), path.stem
        session_policy(doc)  # still fits STS's session policy limit
    bench = json.loads((tmp_path / "pol" / "bench.json").read_text())
    assert _resources(bench, "Allow", "s3:PutObject") == ["arn:aws:s3:::kiln-wheels/simple/bench-history/*"]
    with pytest.raises(ConfigError, match="release baseline prefix 'release/published/' overlaps the release index"):
        policies_for("b", "simple", STEPS, CHANNELS, baselines="release/published/")


def test_policies_command_with_a_bad_config_writes_nothing(tmp_path):
    text = (REPO / "kiln.toml").read_text()
    bad = text.replace('[permissions.build]\nread = ["artifacts/"]\nwrite = ["artifacts/"]',
                       '[permissions.build]\nread = ["artifacts/"]\nwrite = ["release/"]')
    assert bad != text
    config = tmp_path / "kiln.toml"
    config.write_text(bad)
    os.symlink(REPO / "kernels", tmp_path / "kernels")
    os.symlink(REPO / "release", tmp_path / "release")  # publish.pins must exist, or that error comes first
    for suite in tomllib.loads(text)["suites"]:  # every suite path must exist, or that error comes first
        for suite_dir in suite["paths"]:
            (tmp_path / suite_dir).mkdir(parents=True, exist_ok=True)
    with pytest.raises(ConfigError, match="permissions.build.write: 'release/'"):
        policies_command(str(config), str(tmp_path / "pol"))
    assert not (tmp_path / "pol").exists()


def test_policies_need_an_s3_target(tmp_path):
    tiny = REPO / "tests" / "fixtures" / "projects" / "tiny" / "kiln.toml"
    with pytest.raises(ConfigError, match="has no s3:// publish target"):
        policies_command(str(tiny), str(tmp_path / "pol"))
    assert not (tmp_path / "pol").exists()


@pytest.mark.parametrize("bucket", ["", "b/simple", "b*"])
def test_a_bucket_that_is_not_a_bucket_name_is_refused(bucket):
    with pytest.raises(ConfigError, match="is not a bucket name"):
        policies_for(bucket, "simple", STEPS, CHANNELS)


@pytest.mark.parametrize("missing", sorted(CHANNELS))
def test_a_channel_without_a_prefix_is_refused_naming_it(missing):
    channels = {c: p for c, p in CHANNELS.items() if c != missing}
    with pytest.raises(ConfigError, match=f"channels has no '{missing}' prefix"):
        policies_for("b", "simple", STEPS, channels)


def test_only_the_build_may_write_the_shared_build_cache():
    docs = policies_for("b", "simple", STEPS, CHANNELS, build_cache="build-cache")
    cache = "arn:aws:s3:::b/simple/artifacts/build-cache/*"
    assert cache not in _resources(docs["build"], "Deny", "s3:PutObject*")
    for step in ("test", "bench", "publish-nightly", "publish-release"):
        assert cache in _resources(docs[step], "Deny", "s3:PutObject*"), step
        session_policy(docs[step])  # still fits STS's limit
    # the compile cache's shared tier lives below the same prefix, so the same rule keeps it the build's alone
    compile_key = f"arn:aws:s3:::b/simple/artifacts/build-cache/{COMPILE_PREFIX}/0123abcd"
    assert not [r for r in _resources(docs["build"], "Deny", "s3:PutObject*") if fnmatch.fnmatchcase(compile_key, r)]
    for step in ("test", "bench", "publish-nightly", "publish-release"):
        assert [r for r in _resources(docs[step], "Deny", "s3:PutObject*") if fnmatch.fnmatchcase(compile_key, r)]
    # without a shared tier the documents are as before
    assert policies_for("b", "simple", STEPS, CHANNELS) == policies_for("b", "simple", STEPS, CHANNELS, None)
