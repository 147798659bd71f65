"""The install hint states the truth of each index, read from what a publish put there.

Real parts: wheels published with the publish protocol into a local directory,
extra indexes on ``file://`` and on a loopback HTTP server. Never the internet:
every lookup here names a local index, and the conftest turns the check off
for every other test (KILN_CHECK_EXTRA_INDEXES=off).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kiln.core.manifest import RunManifest
from kiln.core.store import LocalStore
from kiln.flows.report.hint import first_lines, install_command, install_reason
from kiln.flows.report.summary import render_markdown, render_text
from kiln.release.publish.plan import Plan
from kiln.release.publish.protocol import PublishRequest, publish
from kiln.release.read.remote import Lookup, newest_release
from kiln.tasks import install_hint
from kiln.tasks.install_hint import CHECK_ENV, extra_index_check, install_facts, requires_dist
from tests.helpers.wheelkit import make_wheel

NIGHTLY = "0.8.2.dev20261202205655"
REQUIRES = ("torch>=2.6", 'triton>=3.6; platform_system == "Linux"', "numpy", "demo-runtime==1.0",
            'pytest; extra == "test"')


def publish_run(tmp_path: Path, channel: str = "nightly", version: str = NIGHTLY,
                requires: tuple[str, ...] = REQUIRES) -> tuple[RunManifest, Plan, Path]:
    """A run with one cpu wheel of demo-kernels, published with the demo-runtime wheel beside it."""
    run = RunManifest(tmp_path / "run", "r1", flow=channel, version=version)
    wheel = make_wheel(tmp_path / "run" / "wheels" / "cpu", "demo-kernels", f"{version}+cpu", requires=requires)
    run.add_artifact(wheel, step="build", kind="wheel", variant="cpu")
    runtime = make_wheel(tmp_path / "runtime", "demo-runtime", "1.0")
    plan = publish(run, LocalStore(tmp_path / "index"),
                   PublishRequest(channel=channel, channel_prefix=channel, variants=["cpu"], extra=[(None, runtime)]))
    return run, plan, wheel


def record(run: RunManifest, plan: Plan, install: dict) -> str:
    url = f"{plan.target}/{plan.channel}/cpu/simple/"
    run.info["index_url"] = [url]
    run.info["install"] = install
    return url


def extra_index(root: Path, versions: list[str], name: str = "demo-kernels") -> Path:
    """A PEP 503 index of ``name`` (HTML form only, as a static mirror serves it) with installable wheels."""
    project = root / "simple" / name
    wheels = [make_wheel(project, name, v).name for v in versions]
    links = "".join(f'<a href="{w}">{w}</a>\n' for w in wheels)
    (project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    (root / "simple" / "index.html").write_text(f'<a href="{name}/">{name}</a>\n')
    return root / "simple"


def test_the_hint_says_what_the_index_holds_and_where_each_dependency_comes_from(tmp_path):
    run, plan, _ = publish_run(tmp_path)
    url = record(run, plan, install_facts("demo-kernels", ["https://pypi.example/simple"], plan, check=False))
    assert run.info["install"]["indexes"][url]["holds"] == ["demo-kernels", "demo-runtime"]
    reason = install_reason(url, run.info["install"])
    assert reason.startswith("(this index holds demo-kernels, demo-runtime; ")
    assert "; demo-runtime is on this index; " in reason
    assert "; torch, triton, numpy are not on it and resolve from https://pypi.example/simple (--extra-index-url)" in reason
    assert "pytest" not in reason.split("Requires-Dist)", 1)[1]  # only `pip install demo-kernels[test]` asks for it


def test_the_dependency_text_is_the_published_wheels_requires_dist(tmp_path):
    run, plan, wheel = publish_run(tmp_path)
    url = record(run, plan, install_facts("demo-kernels", [], plan, check=False))
    assert requires_dist(wheel) == list(REQUIRES)
    text = render_text(run)
    assert f"demo-kernels {NIGHTLY}+cpu requires {', '.join(REQUIRES)} (its wheel's Requires-Dist)" in text
    assert "torch, triton, numpy are not on it and must already be installed" in text
    assert f"  - (this index holds demo-kernels, demo-runtime; demo-kernels {NIGHTLY}+cpu requires" in \
        render_markdown(run)
    assert url in text


def test_a_wheel_without_requires_dist_has_no_dependencies_whatever_kiln_toml_says(tmp_path):
    run, plan, _ = publish_run(tmp_path, requires=())
    url = record(run, plan, install_facts("demo-kernels", ["https://pypi.example/simple"], plan, check=False))
    assert install_reason(url, run.info["install"]) == (
        f"(this index holds demo-kernels, demo-runtime; demo-kernels {NIGHTLY}+cpu has no dependencies "
        "(its wheel declares no Requires-Dist))")


def test_a_nightlys_hint_pins_the_exact_version_and_a_releases_does_not(tmp_path):
    run, plan, _ = publish_run(tmp_path / "n")
    url = record(run, plan, install_facts("demo-kernels", ["https://pypi.example/simple"], plan, check=False))
    assert install_command(url, run.info["install"]) == (
        f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {url} --no-deps demo-kernels=={NIGHTLY}+cpu demo-runtime==1.0 && "
        f"env PIP_CONFIG_FILE=/dev/null pip install --isolated --index-url {url} --extra-index-url https://pypi.example/simple demo-kernels=={NIGHTLY}+cpu")
    run, plan, _ = publish_run(tmp_path / "r", channel="release", version="0.9.0")
    url = record(run, plan, install_facts("demo-kernels", ["https://pypi.example/simple"], plan, check=False))
    assert install_command(url, run.info["install"]).endswith(" demo-kernels")


def test_a_version_below_a_release_on_the_extra_index_warns_and_the_hint_pins_it(tmp_path):
    extra = extra_index(tmp_path / "pypi", ["0.8.1", "0.8.5", "0.9.0rc1"])  # a pre-release never counts
    run, plan, _ = publish_run(tmp_path, channel="release", version="0.8.2")
    install = install_facts("demo-kernels", [extra.as_uri()], plan, check=True)
    assert install["extra_check"] == {"state": "below", "version": "0.8.2", "newest": "0.8.5",
                                      "index": extra.as_uri(), "notes": []}
    url = record(run, plan, install)
    assert install_command(url, install).endswith(" demo-kernels==0.8.2+cpu")  # a release, pinned: PyPI would win
    assert render_text(run).splitlines()[1] == (
        f"VERSION BELOW AN EXTRA INDEX: demo-kernels 0.8.2 sorts below release 0.8.5 on {extra.as_uri()}, which an "
        "unpinned install takes instead; raise [project] version above 0.8.5 in kiln.toml")
    assert "**VERSION BELOW AN EXTRA INDEX: demo-kernels 0.8.2" in render_markdown(run)


def test_a_version_above_every_release_on_the_extra_index_says_nothing(tmp_path):
    extra = extra_index(tmp_path / "pypi", ["0.8.1"])
    _, plan, _ = publish_run(tmp_path)
    install = install_facts("demo-kernels", [extra.as_uri()], plan, check=True)
    assert install["extra_check"]["state"] == "ok"
    assert first_lines({"install": install}) == []


def test_the_json_form_of_a_project_page_is_read_and_yanked_files_do_not_count(tmp_path):
    page = tmp_path / "simple" / "demo-kernels"
    page.mkdir(parents=True)
    files = [{"filename": "demo_kernels-2.0-py3-none-any.whl", "yanked": "broken"},
             {"filename": "demo_kernels-1.5.tar.gz", "yanked": False}, {"filename": "demo_kernels-1.0.exe"}]
    (page / "index.json").write_text(json.dumps({"meta": {"api-version": "1.1"}, "name": "demo-kernels",
                                                 "files": files}))
    assert newest_release((tmp_path / "simple").as_uri(), "Demo_Kernels") == \
        Lookup((tmp_path / "simple").as_uri(), "found", "1.5")


def test_a_project_the_extra_index_does_not_have_is_absent(tmp_path):
    extra = extra_index(tmp_path / "pypi", ["1.0"], name="other")
    assert newest_release(extra.as_uri(), "demo-kernels").state == "absent"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    """The extra index on a loopback HTTP server (a static server: HTML only, as many mirrors are)."""
    extra_index(tmp_path / "pypi", ["0.8.5"])
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path / "pypi"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def test_an_extra_index_over_http_is_read(served):
    assert newest_release(served, "demo-kernels") == Lookup(served, "found", "0.8.5")
    assert newest_release(served, "absent-project").state == "absent"


def test_a_page_larger_than_the_cap_is_unknown_not_read_to_the_end(served):
    lookup = newest_release(served, "demo-kernels", max_bytes=16)
    assert lookup.state == "unknown" and "larger than 16 bytes" in lookup.reason


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_extra_index_is_unknown_with_a_note_never_a_failure(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/simple"
    run, plan, _ = publish_run(tmp_path)
    install = install_facts("demo-kernels", [url], plan, check=True, lookup=partial(newest_release, timeout=5))
    assert install["extra_check"]["state"] == "unknown"
    assert install["extra_check"]["notes"][0].startswith(f"{url}: {url}/demo-kernels/: ")
    index = record(run, plan, install)
    assert install_command(index, install).endswith(f"demo-kernels=={NIGHTLY}+cpu")
    assert (f"(whether an extra index holds a release of demo-kernels above {NIGHTLY} is unknown: {url}: "
            in install_reason(index, install))


def test_with_the_check_off_no_extra_index_is_queried(tmp_path):
    def refuse(url: str, project: str) -> Lookup:
        raise AssertionError(f"{url} was queried with {CHECK_ENV}=off")

    _, plan, _ = publish_run(tmp_path)
    checking = install_hint.checks_extra_indexes({CHECK_ENV: "off"})
    install = install_facts("demo-kernels", ["https://pypi.org/simple"], plan, check=checking, lookup=refuse)
    assert install["extra_check"] == {"state": "not checked", "version": NIGHTLY, "notes": []}
    assert install_hint.checks_extra_indexes({}) and not install_hint.checks_extra_indexes({CHECK_ENV: "0"})


def test_the_newest_release_across_extra_indexes_is_the_one_named():
    found = {"a": Lookup("a", "found", "0.8.5"), "b": Lookup("b", "found", "1.2"), "c": Lookup("c", "absent")}
    check = extra_index_check("demo", "1.0.dev3+cpu", ["a", "b", "c"], lambda url, _: found[url])
    assert (check["state"], check["newest"], check["index"], check["version"]) == ("below", "1.2", "b", "1.0.dev3")


def _pip_install(python: Path, command: str, home: Path) -> str:
    """Run a printed ``pip install … [&& pip install …]`` hint into ``python``'s venv; the version of demo-kernels
    it installed. The venv has no pip of its own (ensurepip costs seconds to tens of seconds per venv): the test
    environment's pip installs into it (--python)."""
    import shlex
    import subprocess
    import sys

    env = {"PIP_CONFIG_FILE": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(home)}
    for step in command.split(" && "):
        argv = shlex.split(step)
        assert argv[:5] == ["env", "PIP_CONFIG_FILE=/dev/null", "pip", "install", "--isolated"], command
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-cache-dir",
                               *argv[4:]], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shown = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('demo-kernels'))"],
                           env=env, capture_output=True, text=True, timeout=60)
    return shown.stdout.strip()


@pytest.mark.slow
def test_the_printed_hint_installs_the_nightly_where_an_unpinned_name_takes_the_extra_indexs_release(tmp_path):
    import subprocess
    import sys

    extra = extra_index(tmp_path / "pypi", ["0.8.5"])
    run, plan, _ = publish_run(tmp_path, requires=("demo-runtime==1.0",))
    install = install_facts("demo-kernels", [extra.as_uri()], plan, check=True)
    url = record(run, plan, install)
    hint = install_command(url, install)
    assert f"install: {hint}" in render_text(run)  # what `kiln nightly` prints
    venvs = []
    for name in ("pinned", "unpinned"):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / name)], check=True, timeout=300)
        venvs.append(tmp_path / name / "bin" / "python")
    assert _pip_install(venvs[0], hint, tmp_path) == f"{NIGHTLY}+cpu"
    # The premise: one pip command with both indexes, naming the project alone, installs the extra index's release.
    one_command = hint.split(" && ")[1]
    assert _pip_install(venvs[1], one_command.rsplit("==", 1)[0], tmp_path) == "0.8.5"
