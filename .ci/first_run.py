#!/usr/bin/env python3
"""CI's first-run check: the README's first command, verbatim, on a fresh clone.

``first_run.py [--repo DIR] [--timeout S] [--keep]`` clones ``--repo`` (this
checkout by default) into a temporary folder, reads the README's first command
(the indented line that makes a ``.venv`` and runs ``kiln nightly``) from the
clone's own README.md and runs it there with ``bash -c``, exactly as written.
It shares nothing with the test session but the installers' download caches
(pip's, and uv's, which only ever holds downloaded archives and unpacked
wheels) and the machine's own installer settings (``PIP_*``/``UV_*``, like
its pip.conf): ``HOME``, ``TMPDIR``, the Prefect home, Kiln's test environments and
build cache are all inside the temporary folder, and the test session's
virtual environment is off ``PATH``.

Then it asserts what a newcomer needs: exit status 0, every variant this
machine can test (the CPU ones) published and tested, no "will not install"
line anywhere in the output, and ``kiln verify`` of the printed cpu index
passing. It prints the wall time of the install, of the nightly and of each
of its stages (from the lines the nightly logs), for benchmarks/RESULTS.md,
and ends the Kiln server and daemon the run started before it removes the
folder. Its last line is ``first-run: N passed, N failed``.

Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FIRST_COMMAND = re.compile(r"^    (python3 -m venv .*kiln nightly.*)$", re.MULTILINE)
INDEX_LINE = re.compile(r"--index-url (file://\S+/nightly/(\w[\w.-]*)/simple/)")


def first_command(readme: Path) -> str:
    found = FIRST_COMMAND.search(readme.read_text(encoding="utf-8"))
    if found is None:
        raise SystemExit(f"first_run: no first command (an indented 'python3 -m venv … kiln nightly' line) in {readme}")
    return found.group(1)


def fresh_environment(root: Path) -> dict[str, str]:
    """The caller's environment less the test session's: own HOME, TMPDIR and no active venv."""
    real_home = Path.home()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "KILN_", "VIRTUAL_ENV", "PYTEST"))}  # the machine's PIP_*/UV_* stay
    venv_bin = os.environ.get("VIRTUAL_ENV", "")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not (venv_bin and p.startswith(venv_bin)))
    for name in ("home", "tmp"):
        (root / name).mkdir(mode=0o700)
    env.update(HOME=str(root / "home"), TMPDIR=str(root / "tmp"), PYTHONUNBUFFERED="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR", str(real_home / ".cache" / "pip")),
               UV_CACHE_DIR=os.environ.get("UV_CACHE_DIR", str(real_home / ".cache" / "uv")))
    return env


Lines = list[tuple[float, str]]


def _end_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the command's process group, SIGKILL 30 s later if it is still there."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run_logged(command: list[str], cwd: Path, env: dict[str, str], timeout: float, log: Path) -> tuple[int, str, Lines]:
    """Run ``command`` in its own process group under a deadline; every output line is kept, timed and logged."""
    started = time.monotonic()
    lines: Lines = []
    with open(log, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
        timer = threading.Timer(timeout, _end_group, (proc,))  # a silent, hung command ends too
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append((time.monotonic() - started, line.rstrip("\n")))
                sink.write(line)
            status = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _end_group(proc)
    if time.monotonic() - started >= timeout:
        status = 124
    return status, "\n".join(text for _, text in lines), lines


BEGIN_LINE = re.compile(r"Beginning (?:sub)?flow run '([^']+)' for flow '([^']+)'")
END_LINE = re.compile(r"Flow run '([^']+)' - Finished in state (\w+)")


def stage_times(lines: Lines) -> dict[str, float]:
    """Seconds each flow of the nightly took (its stages are subflows), read from Prefect's own log lines,
    and when the nightly began (the install before it)."""
    began: dict[str, tuple[str, float]] = {}
    out: dict[str, float] = {}
    for t, text in lines:
        if (begin := BEGIN_LINE.search(text)) is not None:
            began[begin.group(1)] = (begin.group(2), t)
            if begin.group(2) == "nightly":
                out["install (before the nightly's first line)"] = t
        elif (end := END_LINE.search(text)) is not None and end.group(1) in began:
            flow, t0 = began[end.group(1)]
            out[f"{flow} ({end.group(2)})"] = t - t0
    return out


class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"first-run: {'PASS' if ok else 'FAIL'}: {what}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)


def check_nightly(checks: Checks, status: int, output: str, clone: Path) -> dict[str, str]:
    checks.check(status == 0, f"the README's first command exits 0 (got {status})")
    checks.check("will not install" not in output.lower(), "no variant is published as 'will not install'")
    indexes = dict((variant, url) for url, variant in INDEX_LINE.findall(output))
    checks.check("cpu" in indexes, f"the cpu variant's index is printed (printed: {sorted(indexes) or 'none'})")
    cpu_tested = re.search(r"test/kernels/cpu\W+(completed|passed)", output, re.IGNORECASE) is not None
    checks.check(cpu_tested, "the cpu variant's kernels suite ran and passed")
    untested_cpu = re.search(r"published untested[^\n]*\bcpu\b", output, re.IGNORECASE)
    checks.check(untested_cpu is None, "the cpu variant is not published untested")
    wheels = list((clone / ".kiln" / "index" / "nightly" / "cpu" / "simple").glob("*/*+cpu-*.whl"))
    checks.check(bool(wheels), f"a +cpu wheel is in the published cpu index ({[w.name for w in wheels]})")
    return indexes


def stop_services(clone: Path, env: dict[str, str]) -> None:
    kiln = clone / ".venv" / "bin" / "kiln"
    if not kiln.exists():
        return
    for args in (["server", "stop"], ["daemon", "stop"]):
        subprocess.run([str(kiln), *args], cwd=clone, env=env, timeout=120, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds for the first command (install + nightly)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kiln-first-run-"))
    clone = root / "kiln"
    checks = Checks()
    env: dict[str, str] = {}
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", args.repo, str(clone)], check=True, timeout=300)
        env = fresh_environment(root)
        command = first_command(clone / "README.md")
        print(f"first-run: in {clone}: {command}", flush=True)
        status, output, lines = run_logged(["bash", "-c", command], clone, env, args.timeout, root / "first-run.log")
        total = lines[-1][0] if lines else 0.0
        indexes = check_nightly(checks, status, output, clone)
        if "cpu" in indexes:
            vstatus, voutput, _ = run_logged([str(clone / ".venv" / "bin" / "kiln"), "verify", indexes["cpu"]],
                                             clone, env, 900, root / "verify.log")
            checks.check(vstatus == 0, f"kiln verify {indexes['cpu']} passes (exit {vstatus})"
                         + ("" if vstatus == 0 else "\n" + voutput[-3000:]))
        print(f"first-run: fresh clone -> nightly done: {total:.0f} s wall", flush=True)
        for what, seconds in stage_times(lines).items():
            print(f"first-run:   {what}: {seconds:.0f} s", flush=True)
        if checks.failed:
            print(f"first-run: output tail:\n{output[-6000:]}", flush=True)
    finally:
        if env:
            stop_services(clone, env)
        if args.keep:
            print(f"first-run: kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"first-run: {checks.passed} passed, {len(checks.failed)} failed", flush=True)
    return 0 if not checks.failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
