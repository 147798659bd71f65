"""A real browser on a real run: the Prefect UI shows what Kiln says it shows.

Starts Kiln's own local server (``kiln server start`` in a fresh
``PREFECT_HOME``: Prefect's ``prefect server start`` with the UI, behind the
home's auth string), runs a small nightly on it as a ``kiln`` process — the
torch-only bench project with one suite that has a planted failing test — and
opens the run's pages in headless Chromium (Debian's ``/usr/bin/chromium``
driven by Playwright; no browser is downloaded), logged in as a person would:
the UI asks for a password, the contents of ``kiln-server.auth``. Then the
run's page, its summary artifact (stages, what needs attention, the link to
the failed tests), the units table, the failed tests table, the benchmark plot
and a retried task's page. Every check waits for the content it checks. The
screenshots are saved under the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.flows.local import server
from kiln.flows.local.server_home import AUTH_FILE
from tests.helpers.gitrepo import init_repo

# The module's first test also waits for the whole nightly (build, tests, bench) on a busy 2-core machine.
pytestmark = [pytest.mark.ui, pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 180_000  # a busy 2-core CI machine renders slowly; every wait is for content, never a sleep

SUITE = '''
def test_passes():
    assert sum([1, 2]) == 3


def test_planted_failure():
    assert "kiln" == "oven", "planted failure for the UI test"
'''


@dataclass(frozen=True)
class LocalServer:
    """Kiln's local server of one Prefect home, as its owner sees it."""

    home: Path
    api_url: str
    env: dict[str, str]  # a kiln command's: the home, and no PREFECT_API_URL (Kiln connects itself)

    @property
    def password(self) -> str:
        return (self.home / AUTH_FILE).read_text().strip()

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(api=self.api_url, auth_string=self.password)


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory) -> Iterator[LocalServer]:
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium binary ({CHROMIUM} missing): apt-get install chromium (.ci/run installs it)")
    home = tmp_path_factory.mktemp("prefect-ui-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_HOME": str(home), "KILN_DAEMON": "off"})
    start = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "server", "start"], env=env,
                           capture_output=True, text=True, timeout=server.START_TIMEOUT_S + 120)
    assert start.returncode == 0, f"{start.stdout}\n{start.stderr}"
    assert str(home / AUTH_FILE) in start.stdout  # where the UI's password is, said where the server is
    info = server.read_state(home)
    assert info is not None
    try:
        yield LocalServer(home, info.api_url, env)
    finally:
        server.stop_server(home)


@pytest.fixture(scope="module")
def nightly(ui_server: LocalServer, tmp_path_factory) -> dict[str, str]:
    """A nightly of the bench project (with a planted failing test), run by `kiln` against the UI's server."""
    base = tmp_path_factory.mktemp("ui-nightly")
    root = base / "benchproj"
    shutil.copytree(REPO / "tests" / "bench" / "fixtures" / "benchproj", root,
                    ignore=shutil.ignore_patterns("__pycache__", "artifacts"))
    (root / "tests").mkdir()
    (root / "tests" / "test_ui.py").write_text(SUITE)
    (root / "kiln.toml").write_text((root / "kiln.toml").read_text().replace(
        "[bench]", '[[suites]]\nname = "ui"\npaths = ["tests"]\ntest_timeout_s = 120\n\n[bench]'))
    init_repo(root)
    out = base / "out"
    proc = subprocess.run([sys.executable, "-m", "kiln.flows.cli", "nightly", "--config", str(root / "kiln.toml"),
                           "--out", str(out)], cwd=root, env=ui_server.env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 1, (f"the planted failure must fail the nightly:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_id = (out / "latest").resolve().name
    with ui_server.client() as client:
        keys = {a.key: str(a.id) for a in client.read_artifacts()}
        uploads = [t for t in client.read_task_runs() if t.name.startswith("upload ")]
    found = {"run": run_id, **keys, "upload_task": str(uploads[0].id) if uploads else ""}
    (base / "ids.json").write_text(json.dumps(found, indent=2))
    return found


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def anonymous(browser, ui_server):
    """A browser page that has not logged in."""
    context = browser.new_context(viewport={"width": 1600, "height": 1000},
                                  base_url=ui_server.api_url.removesuffix("/api"))
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    yield page
    context.close()


def _log_in(page, password: str) -> None:
    page.locator("input[type=password]").fill(password)
    page.get_by_role("button", name="Login").click()


@pytest.fixture
def page(anonymous, ui_server):
    """A page logged in as the owner: the UI's password prompt, answered with kiln-server.auth."""
    anonymous.goto("/runs")
    _log_in(anonymous, ui_server.password)
    anonymous.wait_for_url("**/runs")
    return anonymous


def test_the_ui_asks_for_the_password_and_refuses_a_wrong_one(anonymous, ui_server, tmp_path):
    anonymous.goto("/runs")
    anonymous.wait_for_url("**/login**")
    _log_in(anonymous, "not-" + ui_server.password)
    anonymous.get_by_text("Authentication failed").first.wait_for()
    _shot(anonymous, tmp_path, "login-refused")
    assert "/login" in anonymous.url
    _log_in(anonymous, ui_server.password)
    anonymous.wait_for_url("**/runs")
    anonymous.get_by_text("Work Pools", exact=True).first.wait_for()  # the app's navigation, shown once logged in
    _shot(anonymous, tmp_path, "logged-in")


@pytest.fixture(scope="module")
def a_run(ui_server: LocalServer) -> tuple[str, str]:
    """A flow run on the UI's server (created, not run: its page is what a printed link opens), and the login
    line a `kiln` command prints under that link."""
    from prefect import flow

    @flow(name="kiln-ui-landing")
    def landing() -> None:
        pass

    with ui_server.client() as client:
        run = client.create_flow_run(landing, name="kiln ui landing")
    link = f"{ui_server.api_url.removesuffix('/api')}/runs/flow-run/{run.id}"
    login = server.ui_login_for(ui_server.home, link)
    assert login is not None
    return link, login


def test_the_printed_login_link_asks_for_the_password_without_an_error_and_lands_on_the_run(
        anonymous, ui_server, a_run, tmp_path):
    link, login = a_run
    run_path = link.removeprefix(ui_server.api_url.removesuffix("/api"))
    login_link = next(word for word in login.split() if "/login?redirect=" in word)
    anonymous.goto(login_link)
    anonymous.locator("input[type=password]").wait_for()
    _shot(anonymous, tmp_path, "login-page")
    assert anonymous.get_by_text("Authentication failed").count() == 0  # asked, not scolded
    _log_in(anonymous, ui_server.password)
    anonymous.wait_for_url(f"**{run_path}")
    anonymous.get_by_text("kiln-ui-landing").first.wait_for()  # the run's page: its flow in the breadcrumb
    _shot(anonymous, tmp_path, "landed-on-the-run")


def test_the_run_link_opened_before_logging_in_greets_with_an_error_the_premise_of_the_login_link(
        anonymous, a_run, tmp_path):
    link, _ = a_run
    anonymous.goto(link)  # Prefect's UI: a 401 toast, then its home page rather than the login's redirect
    anonymous.get_by_text("Authentication failed").first.wait_for()
    _shot(anonymous, tmp_path, "run-link-anonymous")


def _shot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def test_the_benchmark_summary_shows_its_plot(page, nightly, tmp_path):
    page.goto(f"/artifacts/artifact/{nightly['kiln-bench-summary']}")
    page.get_by_role("heading", name="Benchmarks — cpu, decided on cpu").wait_for()
    plot = page.locator('img[src^="data:image/png"]').first
    plot.wait_for()
    page.wait_for_function("img => img.complete && img.naturalWidth > 100", arg=plot.element_handle())
    _shot(page, tmp_path, "bench")


def test_a_retried_tasks_page_shows_its_retry_delay_as_a_number(page, nightly, tmp_path):
    assert nightly["upload_task"], "the nightly uploaded nothing"
    page.goto(f"/runs/task-run/{nightly['upload_task']}")
    page.get_by_text("Retry Delay").first.wait_for()
    page.get_by_text("Retry Jitter Factor").first.wait_for()
    _shot(page, tmp_path, "task-run")
    assert "NaN" not in page.inner_text("body")


def _cell(page, text: str):
    """The first table cell whose whole text is ``text`` (Prefect renders table artifacts as HTML tables)."""
    return page.locator("td").get_by_text(text, exact=True).first


def test_the_run_page_shows_the_failed_nightly(page, nightly, tmp_path):
    page.goto(f"/runs/flow-run/{nightly['run']}")
    page.get_by_text("Failed", exact=True).first.wait_for()
    page.get_by_text("nightly", exact=True).first.wait_for()  # the flow's name, in the breadcrumb
    _shot(page, tmp_path, "flow-run")


def test_the_nightly_summary_renders_its_stages_and_what_needs_attention(page, nightly, tmp_path):
    page.goto(f"/artifacts/artifact/{nightly['kiln-nightly-summary']}")
    page.get_by_role("heading", name=f"Kiln nightly run {nightly['run']}").wait_for()
    for stage in ("build", "test", "bench", "publish"):
        _cell(page, stage).wait_for()
    page.get_by_role("heading", name="Needs attention").wait_for()
    _cell(page, "test/ui/cpu").wait_for()  # the failed suite's unit, linked to its table of failed tests
    page.get_by_role("link", name="1 test").first.wait_for()
    _shot(page, tmp_path, "summary")


def test_the_units_table_is_led_by_id_state_and_message(page, nightly, tmp_path):
    page.goto(f"/artifacts/artifact/{nightly['kiln-test-units']}")
    _cell(page, "test/ui/cpu").wait_for()
    headers = [h.strip() for h in page.locator("th").all_inner_texts()]
    assert headers[:3] == ["id", "state", "message"], headers
    row = page.locator("tr", has=_cell(page, "test/ui/cpu"))
    assert "failed" in row.inner_text() and "1 failed" in row.inner_text()
    _shot(page, tmp_path, "units")


def test_the_failed_tests_table_lists_the_planted_failure(page, nightly, tmp_path):
    page.goto(f"/artifacts/artifact/{nightly['kiln-tests-ui-cpu']}")
    _cell(page, "test_planted_failure").wait_for()
    row = page.locator("tr", has=_cell(page, "test_planted_failure"))
    assert "failed" in row.inner_text() and "planted failure for the UI test" in row.inner_text()
    assert "test_passes" not in page.inner_text("body")  # only the problem tests are listed
    _shot(page, tmp_path, "failed-tests")
