"""Mutation check of the modules that hold Kiln's invariants (cosmic-ray, one module at a time).

    nice -n 19 python benchmarks/mutation.py [--module publish ...] [--module-timeout 3600]
        [--mutant-timeout 240] [--work .mutation] [--list] [--report-only] [--fresh]

Each module is mutated with the test subset that is meant to guard it (see
:data:`MODULES`), and only inside the functions that hold an invariant: the
rest of a module (log lines, dataclass plumbing, renderers of reports) would
cost hours on a 2-core machine and say little. For every module the script:

1. writes a cosmic-ray config into ``--work`` and, unless a session already
   exists there, runs ``cosmic-ray init`` (a session is resumed, so a run cut
   short by ``--module-timeout`` continues where it stopped);
2. marks as skipped every mutation outside the listed functions and every
   operator in :data:`EXCLUDED_OPERATORS`;
3. runs ``cosmic-ray baseline`` (the subset must pass unmutated), then
   ``cosmic-ray exec`` under ``timeout``;
4. prints killed / survived / timeout / incompetent / pending and each
   survivor with its diff, and writes ``<work>/<module>.json``.

cosmic-ray mutates the file in place and restores it after each mutant; if
the run is cut short the module's original bytes are written back here, so the
checkout is never left mutated. Not part of ``.ci/run``: the full run takes
far more than a few minutes (numbers in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Module:
    name: str
    path: str
    functions: tuple[str, ...]  # "func" or "Class.method"
    tests: tuple[str, ...]  # pytest arguments of the matching subset
    hypothesis: bool = False  # its tests use hypothesis (else its plugin, seconds of import, stays off)


MODULES = (
    Module("index", "release/index/render.py",
           ("group", "_file_entries", "project_pages", "root_pages", "regenerate",
            "parse_project_json", "parse_root_json"),
           ("tests/release/test_index.py", "tests/release/test_index_golden.py"), hypothesis=True),
    Module("plan", "release/publish/plan.py", ("gate", "collect"), ("tests/release/test_publish_local.py",)),
    Module("pages", "release/publish/pages.py",
           ("check_stored", "_merge_files", "cas_pages", "update_pages", "publish_pages"),
           ("tests/release/test_publish_local.py",)),
    Module("publish", "release/publish/protocol.py", ("upload_file",), ("tests/release/test_publish_local.py",)),
    Module("objects", "core/objects.py", ("check_key",), ("tests/core/test_store_local.py",)),
    Module("store", "core/store.py",
           ("LocalStore.get", "LocalStore.get_page", "LocalStore.head", "LocalStore.put_immutable",
            "LocalStore._create", "LocalStore.put_page", "_open_local", "open_store"),
           ("tests/core/test_store_local.py",)),
    Module("staging", "release/stores/staging.py",
           ("StagingStore.get_page", "StagingStore.head", "StagingStore.put_immutable", "StagingStore.put_page",
            "StagingStore.list"),
           ("tests/release/test_staging.py", "tests/release/test_publish_local.py", "-k", "staging or dry_run")),
    Module("s3", "core/s3.py",
           ("translate", "_b64_to_hex", "S3Store.get_page", "S3Store.head", "S3Store.put_immutable",
            "S3Store._create", "S3Store._existing", "S3Store._read_back", "S3Store._hashed", "S3Store.put_page"),
           ("tests/release/test_store_s3.py",)),
    Module("policies", "release/stores/policies.py",
           ("_prefix", "_overlaps", "_validate", "_object_arns", "_step_policy", "policies_for"),
           ("tests/permissions/test_policies.py",)),
    Module("process", "tasks/process.py",
           ("signal_group", "group_alive", "kill_group", "dump_stacks", "terminate", "run_with_deadline", "watch",
            "signal_name"),
           ("tests/testing/test_deadline.py",)),
    Module("classify", "tasks/testing/classify.py",
           ("is_infrastructure_exception", "is_assertion_exception", "classify_phases", "classify_unfinished",
            "merge_attempts", "should_retry", "suite_state"),
           ("tests/testing/test_classify.py",)),
    Module("cache", "tasks/build/cache.py",
           ("BuildCache.put", "BuildCache.get", "BuildCache._drift", "BuildCache.invalidate_batch",
            "BuildCache.verify"),
           ("tests/build/test_cache.py",)),
)

# Kept: negated conditions, removed `not`, and/or, True/False, break/continue,
# exception types, zero-iteration loops, numbers, the natural neighbours of each
# comparison and arithmetic operator. Dropped: arithmetic replaced by bit
# operators, comparisons replaced by identity tests and the like — almost all
# crash at once or are equivalent, and each costs a full test run.
EXCLUDED_OPERATORS = (
    r"core/ReplaceBinaryOperator_.*_(Pow|Mod|RShift|LShift|BitOr|BitAnd|BitXor|FloorDiv)$",
    r"core/ReplaceBinaryOperator_(Pow|Mod|RShift|LShift|BitOr|BitAnd|BitXor|FloorDiv)_.*",
    r"core/ReplaceBinaryOperator_(Add|Sub)_(Mul|Div)$",
    r"core/ReplaceComparisonOperator_(Eq|NotEq|Lt|LtE|Gt|GtE)_(Is|IsNot)$",
    r"core/ReplaceComparisonOperator_(Is|IsNot)_(Lt|LtE|Gt|GtE)$",
    r"core/ReplaceComparisonOperator_(Eq|NotEq)_(Lt|LtE|Gt|GtE)$",
    r"core/ReplaceUnaryOperator_(UAdd|Invert|Delete_USub|Delete_Invert|USub_Invert|USub_Not).*",
    r"core/RemoveDecorator", r"core/VariableReplacer", r"core/VariableInserter",
)


def function_lines(path: Path, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """(first, last) line of each named function or method; a missing name is an error."""
    tree = ast.parse(path.read_text(), str(path))
    found: dict[str, tuple[int, int]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = (node.lineno, node.end_lineno or node.lineno)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = (item.lineno, item.end_lineno or item.lineno)
    missing = sorted(set(names) - set(found))
    if missing:
        raise SystemExit(f"mutation.py: {path} has no function {missing}; update MODULES")
    return [found[n] for n in names]


def test_command(module: Module) -> str:
    plugins = [] if module.hypothesis else ["-p", "no:hypothesispytest"]
    return shlex.join([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *plugins,
                       "-m", "not slow", *module.tests])


def write_config(module: Module, work: Path, mutant_timeout: float) -> Path:
    config = work / f"{module.name}.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(module.path)}\n"
        f"timeout = {mutant_timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(test_command(module))}\n"
        "\n[cosmic-ray.distributor]\nname = \"local\"\n"
    )
    return config


def scope(session: Path, module: Module) -> None:
    """Skip every pending mutation outside the module's functions or of an excluded operator."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    ranges = function_lines(REPO / module.path, module.functions)
    excluded = re.compile("|".join(f"(?:{e})" for e in EXCLUDED_OPERATORS))
    with use_db(str(session), WorkDB.Mode.open) as db:
        skip = [item.job_id for item in db.pending_work_items
                if any(excluded.match(m.operator_name)
                       or not any(a <= m.start_pos[0] <= b for a, b in ranges) for m in item.mutations)]
        if skip:
            db.set_multiple_results(skip, WorkResult(output="out of scope", worker_outcome=WorkerOutcome.SKIPPED))


def run(cmd: list[str], timeout_s: float | None = None) -> int:
    print("+", shlex.join(cmd), flush=True)
    full = ["nice", "-n", "19", *cmd]
    if timeout_s is not None:
        # SIGINT first: cosmic-ray restores the mutated file on KeyboardInterrupt.
        full = ["timeout", "--signal=INT", "--kill-after=60", str(int(timeout_s)), *full]
    return subprocess.run(full, cwd=REPO).returncode


def mutate(module: Module, work: Path, module_timeout: float, mutant_timeout: float) -> None:
    config, session = write_config(module, work, mutant_timeout), work / f"{module.name}.sqlite"
    source = REPO / module.path
    original = source.read_bytes()
    try:
        if not session.exists():
            if run(["cosmic-ray", "init", str(config), str(session)]) != 0:
                raise SystemExit(f"mutation.py: cosmic-ray init failed for {module.path}")
            scope(session, module)
        if run(["cosmic-ray", "baseline", str(config)], timeout_s=mutant_timeout * 3) != 0:
            raise SystemExit(f"mutation.py: {module.name}: the test subset fails without a mutation")
        run(["cosmic-ray", "exec", str(config), str(session)], timeout_s=module_timeout)
    finally:
        if source.read_bytes() != original:
            source.write_bytes(original)
            print(f"mutation.py: restored {module.path} after an interrupted mutant", flush=True)


def report(module: Module, work: Path) -> dict[str, Any]:
    """Counts and survivors of one module's session (cosmic-ray counts a timeout as killed; split here)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "timeout": 0, "survived": 0, "incompetent": 0, "pending": 0}
    survivors = []
    with use_db(str(work / f"{module.name}.sqlite"), WorkDB.Mode.open) as db:
        results = dict(db.results)
        for item in db.work_items:
            result = results.get(item.job_id)
            if result is None:
                counts["pending"] += 1
            elif result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            elif result.worker_outcome != WorkerOutcome.NORMAL or result.test_outcome == TestOutcome.INCOMPETENT:
                counts["incompetent"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                m = item.mutations[0]
                survivors.append({"job": item.job_id, "line": m.start_pos[0], "operator": m.operator_name,
                                  "occurrence": m.occurrence, "diff": result.diff})
            elif (result.output or "").strip() == "timeout":
                counts["timeout"] += 1
            else:
                counts["killed"] += 1
    done = counts["killed"] + counts["timeout"] + counts["survived"]
    score = (counts["killed"] + counts["timeout"]) / done if done else None
    summary = {"module": module.name, "path": module.path, "tests": list(module.tests), **counts,
               "score": score, "survivors": sorted(survivors, key=lambda s: s["line"])}
    (work / f"{module.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_summary(summaries: list[dict[str, Any]]) -> None:
    print("\n| module | tests | killed | timeout | survived | incompetent | pending | score |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summaries:
        score = "—" if s["score"] is None else f"{100 * s['score']:.1f}%"
        print(f"| {s['path']} | `{' '.join(s['tests'])}` | {s['killed']} | {s['timeout']} | {s['survived']} "
              f"| {s['incompetent']} | {s['pending']} | {score} |")
    killed = sum(s["killed"] + s["timeout"] for s in summaries)
    done = killed + sum(s["survived"] for s in summaries)
    if done:
        print(f"\nscore: {killed}/{done} = {100 * killed / done:.1f}%")
    for s in summaries:
        for survivor in s["survivors"]:
            print(f"\nsurvivor {s['path']}:{survivor['line']} {survivor['operator']} (job {survivor['job']})")
            print("".join(survivor["diff"] or ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=[m.name for m in MODULES],
                        help="only this module (repeatable); default all")
    parser.add_argument("--module-timeout", type=float, default=3600, help="bound of one module's run, seconds")
    parser.add_argument("--mutant-timeout", type=float, default=240, help="bound of one mutant's test run, seconds")
    parser.add_argument("--work", type=Path, default=REPO / ".mutation", help="sessions and reports")
    parser.add_argument("--list", action="store_true", help="print modules, functions and test subsets")
    parser.add_argument("--report-only", action="store_true", help="report existing sessions, run nothing")
    parser.add_argument("--fresh", action="store_true", help="discard the modules' sessions and start over")
    args = parser.parse_args()
    modules = [m for m in MODULES if not args.module or m.name in args.module]
    if args.list:
        for m in modules:
            print(f"{m.name}: {m.path} [{', '.join(m.functions)}] <- {test_command(m)}")
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    # A SIGTERM to this script becomes SystemExit, so the finally in mutate() restores the module.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summaries = []
    for module in modules:
        if args.fresh and not args.report_only:
            (args.work / f"{module.name}.sqlite").unlink(missing_ok=True)
        if not args.report_only:
            mutate(module, args.work, args.module_timeout, args.mutant_timeout)
        if (args.work / f"{module.name}.sqlite").exists():
            summaries.append(report(module, args.work))
    print_summary(summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
