"""A scale-out cluster on loopback, built by the docs' own "Scaling out" recipe (docs/guides/scale-out.md).

PostgreSQL (Debian's package, ``initdb`` in a temporary directory, a free
port), then the recipe's commands run one by one: the Prefect server on that
database, the pools, limits, the zombie-run automation, the deployments of
``flows/scaleout.yaml`` and the workers. Every worker starts in an empty
directory of its own, with its own ``TMPDIR`` (where each flow run clones the
repository), so workers share no path: only the artifact store and the
publish target (moto's S3 server). Every process is started in its own
process group and stopped by PID when the cluster is closed.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.gitrepo import COMMIT_TIME, git_project, vendor_acme_library
from tests.helpers.processes import WORKER_QUERY_S, free_port, healthy, stop
from tests.helpers.s3 import S3_ENV

log = logging.getLogger("kiln.tests.cluster")
REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "guides" / "scale-out.md"
SECTION = "# Scaling out"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def recipe() -> list[str]:
    """The scale-out guide's commands, in order (comments dropped)."""
    text = GUIDE.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines: list[str] = []
    for line in text.splitlines():  # its first indented block: a nested list further down is not a command
        if line.startswith("    ") and line.strip():
            lines.append(line.strip())
        elif lines and line.strip():
            break
    return [re.sub(r"\s+#.*$", "", line) for line in lines]


def _background(line: str) -> bool:
    return line.endswith("&")


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise RuntimeError(f"{name} not found: install Debian's postgresql package (.ci/run does)")
    return found


def _as_postgres() -> list[str]:
    """PostgreSQL refuses to run as root: as root, run its commands as the package's postgres user."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@contextmanager
def postgres() -> Iterator[str]:
    """A PostgreSQL server on a free loopback port; yields the asyncpg URL of its ``prefect`` database."""
    data = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
    port = free_port()
    subprocess.run([*_as_postgres(), _pg_bin("initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True, timeout=180)
    with open(data / "postgres.log", "ab") as out:
        proc = subprocess.Popen([*_as_postgres(), _pg_bin("postgres"), "-D", str(data / "db"), "-p", str(port),
                                 "-h", "127.0.0.1", "-k", str(data)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        end = time.monotonic() + 120
        while subprocess.run([_pg_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                             capture_output=True, timeout=30).returncode != 0:
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError(f"PostgreSQL did not start; see {data / 'postgres.log'}")
            time.sleep(0.5)
        subprocess.run([*_as_postgres(), _pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                        "prefect"], check=True, capture_output=True, timeout=60)
        yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/prefect"
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


@dataclass
class Cluster:
    """The recipe's server and workers; ``workers`` maps a pool to its worker processes."""

    home: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    workers: dict[str, list[subprocess.Popen]] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return self.env["PREFECT_API_URL"]

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(api=self.api_url)

    def run(self, line: str, timeout: float = 300) -> str:
        """A recipe command, in the deploying checkout; its output (the test fails on a non-zero exit)."""
        done = subprocess.run(["bash", "-c", line], cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"{line} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def start(self, line: str, name: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        """A background recipe command in an empty directory of its own (a machine of its own)."""
        machine = self.home / name
        (machine / "tmp").mkdir(parents=True)
        env = {**self.env, "TMPDIR": str(machine / "tmp"), **(extra_env or {})}
        with open(self.home / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(["bash", "-c", line.removesuffix("&").strip()], cwd=machine, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def logs(self, tail: int = 4000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(self.home.glob("*.log")))

    def wait_final(self, flow_run_id, deadline_s: float):
        """The flow run once it reached a final state; fails past the deadline with the logs."""
        end = time.monotonic() + deadline_s
        with self.client() as client:
            while time.monotonic() < end:
                run = client.read_flow_run(flow_run_id)
                if run.state is not None and run.state.type.value in FINAL:
                    return run
                time.sleep(2)
        raise AssertionError(f"flow run {flow_run_id} not final after {deadline_s} s\n{self.logs()}")

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def _export(line: str, env: dict[str, str]) -> None:
    name, _, value = line.removeprefix("export ").partition("=")
    env[name] = subprocess.run(["bash", "-c", f"printf %s {value}"], env=env, capture_output=True, text=True,
                               timeout=30, check=True).stdout


def _pool(line: str) -> str | None:
    words = shlex.split(line)
    return words[words.index("--pool") + 1] if "worker" in words and "--pool" in words else None


@contextmanager
def cluster(home: Path, env: dict[str, str], workers: dict[str, int],
            worker_env: dict[str, dict[str, str]] | None = None) -> Iterator[Cluster]:
    """Run the scale-out guide's recipe up to its last line (the nightly run): ``workers[pool]`` workers per pool."""
    made = Cluster(home, dict(env))
    try:
        for line in recipe()[:-1]:
            if line.startswith("export "):
                _export(line, made.env)
            elif not _background(line):
                made.run(line)
            elif (pool := _pool(line)) is None:
                _start_server(made, line)
            else:
                made.workers[pool] = [made.start(line, f"worker-{pool}-{i}", (worker_env or {}).get(pool))
                                      for i in range(workers.get(pool, 1))]
        yield made
    finally:
        made.close()


def _start_server(made: Cluster, line: str) -> None:
    proc = made.start(line, "server")
    api = f"http://{made.env['PREFECT_HOST']}:{made.env['PREFECT_PORT']}/api"
    end = time.monotonic() + 600  # a fresh database migrates first: minutes on a loaded machine
    while not healthy(api):
        if proc.poll() is not None or time.monotonic() > end:
            raise AssertionError(f"the Prefect server did not become healthy\n{made.logs()}")
        time.sleep(0.5)


def trigger(made: Cluster, line: str | None = None) -> str:
    """The recipe's last line (``prefect deployment run nightly/nightly``): the flow run's id."""
    out = made.run(line or recipe()[-1])
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
    assert match, out
    return match.group(1)


# The acme fixture as a team's repository on the cluster (tests/scaleout, benchmarks/bench_scaleout.py).
ARTIFACTS, INDEX = "kiln-artifacts", "kiln-index"
VARIANTS = ("cu130", "cpu")

DEFAULT_POOLS = """[pools]
build = "kiln-build"
cpu = "kiln-process"
deadline_s = 900
retries = 1
"""

SCALEOUT_TOML = """
[[suites]]
name = "gpu"                 # the same tests against the cu130 wheel, on a (simulated) GPU node
paths = ["tests"]
gpus = 1
pool = "{gpu_pool}"
deadline_s = 900

{pools}

[artifacts]
url = "s3://{artifacts}/store"
endpoint = "{endpoint}"
region = "us-east-1"

[publish.targets.s3]
url = "s3://{index}/simple"
endpoint = "{endpoint}"
region = "us-east-1"

# Each step's credentials: here the workers' own (moto's test keys in their environment).
[permissions.build]
read = ["artifacts/"]
write = ["artifacts/"]
credentials = {{ ambient = true }}

[permissions.test]
read = ["artifacts/"]
write = ["artifacts/"]
credentials = {{ ambient = true }}

[permissions.bench]
read = ["artifacts/", "bench-history/"]
write = ["bench-history/"]
credentials = {{ ambient = true }}

[permissions.publish-nightly]
read = ["nightly/"]
write = ["nightly/"]
credentials = {{ ambient = true }}
"""


def _project(tmp: Path, endpoint: str, pools: str, gpu_pool: str, when: str) -> Path:
    """The acme fixture as a team's repository: S3 store and target, a GPU suite, pools; its directory."""
    def edit(repo: Path) -> None:
        vendor_acme_library(repo)
        text = (repo / "kiln.toml").read_text().replace('default_target = "local"', 'default_target = "s3"')
        extra = SCALEOUT_TOML.format(artifacts=ARTIFACTS, index=INDEX, endpoint=endpoint, pools=pools or DEFAULT_POOLS,
                                     gpu_pool=gpu_pool)
        (repo / "kiln.toml").write_text(text + extra)
    return git_project("acme", tmp, when=when, edit=edit).parent


@contextmanager
def team_cluster(tmp: Path, s3: str, workers: dict[str, int], pools: str = "", gpu_pool: str = "kiln-gpu",
                 when: str = COMMIT_TIME) -> Iterator[tuple[Cluster, Path]]:
    """The acme project (S3 store and target, a GPU suite) on a recipe-built cluster.

    ``workers``: how many workers each pool gets (default one); ``pools``: the project's ``[pools]``
    section; ``gpu_pool``: the GPU suite's pool, whose workers simulate a GPU node; ``when``: the
    commit time (a nightly's version): two projects that differ need two, or their wheels would
    share a version and differ in bytes.
    """
    project = _project(tmp, s3, pools, gpu_pool, when)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= S3_ENV | {"PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
                     "PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                     "PREFECT_LOGGING_EXTRA_LOGGERS": "kiln", "PREFECT_SERVER_UI_ENABLED": "false",
                     "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_S,
                     "PREFECT_HOST": "127.0.0.1", "PREFECT_PORT": str(free_port()), "GPU_NODE": "node1",
                     "REPOSITORY": project.as_uri()}
    with postgres() as database:
        env["DATABASE_URL"] = database
        # The GPU node, simulated: one GPU by the count override, kernels in Triton's interpreter on the CPU.
        gpu = {"KILN_GPU_COUNT": "1", "TRITON_INTERPRET": "1"}
        with cluster(tmp / "machines", env, workers, {gpu_pool: gpu}) as made:
            yield made, project


# A sharded suite on the GPU pool in place of the project's GPU suite (tests/scaleout, benchmarks/bench_shards_rig.py).
SHARDED_SUITE = """
[[suites]]
name = "sharded"
paths = ["sharded"]
variants = ["cu130"]
gpus = 1
pool = "kiln-gpu"
shards = {shards}
required = false
deadline_s = 900
"""


def with_sharded_suite(project: Path, shards: int) -> None:
    """``project``'s kiln.toml with its GPU suite replaced by :data:`SHARDED_SUITE` in ``shards`` shards."""
    config = project / "kiln.toml"
    text = config.read_text()
    gpu = text.index('[[suites]]\nname = "gpu"')
    config.write_text(text[:gpu] + text[text.index("\n\n", gpu) + 2:] + SHARDED_SUITE.format(shards=shards))
