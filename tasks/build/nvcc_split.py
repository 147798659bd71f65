"""Kiln's nvcc for a package's own build: each arch of a compile its own call through the compile cache.

ccache keys an nvcc call on its whole command line, so a package whose build passes nvcc every arch at once
(a ``setup.py``'s ``-gencode`` list, torch's ``cpp_extension``) would recompile every arch of a translation unit
when its variant gains one. Kiln's nvcc (the build's ``PYTORCH_NVCC``, ``nvcc`` first on ``PATH``, or
``$CUDA_HOME/bin/nvcc`` under ``arch_policy = "narrow"``) runs such a compile as one nvcc call per arch, each
through ccache, and combines the per-arch objects into the object the build asked for as Kiln's own nvcc units do
(:func:`kiln.tasks.build.nvcc_arch.combine`): adding an arch compiles that arch alone. Every build of the package
takes this path, cold, warm and the release witness alike, so its wheel is the same bytes whether a compile hit.

What is split: a compile to an object (``-c``, ``-o``) of one ``.cu`` whose targets span two or more archs, with
no relocatable device code (``-rdc``, ``-dc``, ``-dlink``) and no fat-binary options (the combined fat binary is
Kiln's own ``fatbinary`` call). Anything else runs as it came, one call through the cache. The per-arch objects
lie in ``<object>.kiln-arch/``, named by arch, so a compile's command line is the same on every build.

- Its dependency file (``-MF``/``--dependency-output``): each arch writes its own; the first arch's is written
  where the build asked, naming the object the build asked for (ninja reads it).
- Its statistics: each arch's ccache counters go to the build's statistics log as ``<source> [sm_XX]``.
- ``--threads N`` (``-t``): up to N arch compiles at once (0: all), as nvcc runs N of its own steps; one otherwise.

Run as ``python -I -m kiln.tasks.build.nvcc_split OPTIONS -- NVCC-ARGS`` by the shim the build's environment names
(:func:`kiln.tasks.build.nvcc_narrow.front_command`); a call below a compile-cache shim (the launcher's variable
set) runs the real nvcc directly. A CMake build runs it as ``CMAKE_CUDA_COMPILER_LAUNCHER`` (``--launched``), the
compiler CMake found first among its arguments: a launcher runs before the compiler, so only there can a CMake
project's compile be split.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import CompileError, ToolchainMissingError
from kiln.tasks.build.nvcc_arch import combine, find_combine_tools
from kiln.tasks.build.nvcc_narrow import NarrowError, Target, gencode_flags, narrow_args, read_targets

# the unit's own deadline ends the build's whole process group first; this bounds one compile left alone
_PART_TIMEOUT_S = 4 * 3600
_COMBINE_TIMEOUT_S = 120
_NOT_AN_OBJECT = frozenset({
    "-E", "--preprocess", "-M", "--generate-dependencies", "-MM", "--generate-nonsystem-dependencies",
    "-ptx", "--ptx", "-cubin", "--cubin", "-fatbin", "--fatbin", "-cuda", "--cuda", "-dc", "--device-c",
    "-dw", "--device-w", "-dlink", "--device-link", "-lib", "--lib", "-link", "--link", "-run", "--run",
    "-optix-ir", "--optix-ir", "-ltoir", "--ltoir", "-dlto", "--dlink-time-opt"})
_UNSPLIT_PREFIXES = ("-Xfatbin", "--fatbin-options", "-compress-mode", "--compress-mode", "-no-compress",
                     "--no-compress", "-lto", "-gen-opt-lto", "--gen-opt-lto")
_RDC = ("-rdc", "--relocatable-device-code")
_OUTPUT = ("-o", "--output-file")
_DEPFILE = ("-MF", "--dependency-output")
_THREADS = ("-t", "--threads")
_WRITES_DEPFILE = frozenset({"-MD", "--generate-dependencies-with-compile", "-MMD",
                             "--generate-nonsystem-dependencies-with-compile"})
_CODE_NUMBER = re.compile(r"^(?:sm|compute|lto)_([0-9]+[af]?)$")


@dataclass(frozen=True)
class Split:
    """One compile as per-arch compiles: ``parts`` (``sm_XX``, that arch's ``-gencode`` flags), the other
    arguments with ``-o`` and the dependency file at :data:`OBJECT` and :data:`DEPFILE`, and what to write."""

    parts: tuple[tuple[str, tuple[str, ...]], ...]
    args: tuple[str, ...]
    source: str
    obj: str
    depfile: str | None
    threads: int


OBJECT, DEPFILE = "\0object", "\0depfile"  # placeholders in Split.args, replaced per arch


def _value(args: Sequence[str], index: int, names: Sequence[str]) -> tuple[str, int] | None:
    """The value of option ``names`` at ``args[index]`` (``-o x``, ``-o=x``) and how many tokens it took."""
    name, eq, value = args[index].partition("=")
    if name not in names:
        return None
    if eq:
        return value, 1
    return (args[index + 1], 2) if index + 1 < len(args) else None


def _per_arch(targets: Sequence[Target]) -> list[tuple[str, tuple[str, ...]]]:
    """``targets`` grouped by each code's arch number (``sm_90`` and ``compute_90``: ``sm_90``), in order."""
    groups: dict[str, list[Target]] = {}
    for virtual, codes in targets:
        for code in codes:
            match = _CODE_NUMBER.match(code)
            if match is None:
                raise NarrowError(f"cannot read the nvcc code {code!r}")
            groups.setdefault(f"sm_{match[1]}", []).append((virtual, [code]))
    return [(sm, tuple(gencode_flags(entries))) for sm, entries in groups.items()]


def plan_split(args: Sequence[str]) -> Split | None:
    """``args`` as per-arch compiles, or None where they are not one compile of a ``.cu`` to an object for two or
    more archs (see the module's doc)."""
    try:
        targets, rest = read_targets(args)
        parts = _per_arch(targets)
    except NarrowError:
        return None  # nvcc says what is wrong with it
    if len(parts) < 2 or not ({"-c", "--compile"} & set(rest)) or _NOT_AN_OBJECT & set(rest):
        return None
    out: list[str] = []
    obj = depfile = None
    threads = 1
    sources = []
    index = 0
    while index < len(rest):
        token = rest[index]
        name = token.partition("=")[0]
        if name.startswith(_UNSPLIT_PREFIXES) or (name in _RDC and _rdc_on(rest, index)):
            return None
        for names, placeholder in ((_OUTPUT, OBJECT), (_DEPFILE, DEPFILE)):
            found = _value(rest, index, names)
            if found is not None:
                obj, depfile = (found[0], depfile) if placeholder == OBJECT else (obj, found[0])
                out += [name, placeholder]
                index += found[1]
                break
        else:
            found = _value(rest, index, _THREADS)
            if found is not None and found[0].isdigit():
                threads = int(found[0])
            elif token.endswith(".cu") and not token.startswith("-"):
                sources.append(token)
            out.append(token)
            index += 1
    if obj is None or len(sources) != 1 or (depfile is None and _WRITES_DEPFILE & set(rest)):
        return None  # a dependency file nvcc names after the object would be named after an arch's
    return Split(tuple(parts), tuple(out), sources[0], obj, depfile, threads or len(parts))


def _rdc_on(args: Sequence[str], index: int) -> bool:
    found = _value(args, index, _RDC)
    return found is None or found[0].lower() not in ("false", "0")


def _part_args(split: Split, flags: Sequence[str], obj: str, depfile: str) -> list[str]:
    swap = {OBJECT: obj, DEPFILE: depfile}
    return [*flags, *(swap.get(a, a) for a in split.args)]


def _labelled_stats(log: Path, label: str) -> str:
    """ccache's statistics log for one arch's compile, each source named ``<source> [sm_XX]``."""
    try:
        text = log.read_text()
    except FileNotFoundError:
        return ""
    return re.sub(r"(?m)^# (.+)$", lambda m: f"# {m[1]} [{label}]", text)


def _append(path: str, text: str) -> None:
    """``text`` appended to ``path`` in one write (other compiles of the build append to it as well)."""
    if not text:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _rewrite_depfile(written: Path, wanted: str, part_obj: str, obj: str) -> None:
    """The first arch's dependency file, written to ``wanted`` with its target ``obj`` (it named ``part_obj``)."""
    text = written.read_text()
    head, sep, tail = text.partition(":")
    if sep and head.strip() == part_obj:
        text = f"{obj} :{tail}"
    temporary = Path(f"{wanted}.kiln-tmp")
    temporary.write_text(text)
    os.replace(temporary, wanted)


def _tool(cmd: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    """One combining tool, in this process's group (not :func:`kiln.tasks.process.run_tool`'s group of its own):
    the unit's deadline ends the build's whole process group, and with it this tool."""
    return subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, check=False)


def run_split(split: Split, real: str, launcher: str, cuobjdump: str) -> int:
    """Compile each arch of ``split`` through ``launcher`` and combine them into its object; nvcc's exit status."""
    tools = find_combine_tools(real, cuobjdump)  # before any compile: a missing tool is said at once
    folder = Path(f"{split.obj}.kiln-arch")
    shutil.rmtree(folder, ignore_errors=True)  # a rebuild in the same tree starts from nothing
    folder.mkdir(parents=True)
    stats_log = os.environ.get("CCACHE_STATSLOG", "")

    def compile_one(part: tuple[str, tuple[str, ...]]) -> tuple[int, str]:
        sm, flags = part
        obj, depfile = str(folder / f"{sm}.o"), str(folder / f"{sm}.d")
        env = os.environ | ({"CCACHE_STATSLOG": str(folder / f"{sm}.stats")} if stats_log else {})
        done = subprocess.run([launcher, real, *_part_args(split, flags, obj, depfile)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=_PART_TIMEOUT_S,
                              check=False)
        return done.returncode, done.stdout

    with ThreadPoolExecutor(max_workers=max(1, min(split.threads, len(split.parts)))) as pool:
        results = list(pool.map(compile_one, split.parts))
    for (sm, _), (_, output) in zip(split.parts, results, strict=True):
        sys.stderr.write(output)
        if stats_log:
            _append(stats_log, _labelled_stats(folder / f"{sm}.stats", sm))
    failed = next((code for code, _ in results if code != 0), 0)
    if failed:
        return failed
    here = folder.absolute()  # the combining tools run in the objects' folder
    combine([(sm, here / f"{sm}.o") for sm, _ in split.parts], Path(split.obj).absolute(), tools,
            lambda cmd, timeout, cwd: _tool(cmd, min(timeout, _COMBINE_TIMEOUT_S), cwd), split.source)
    if split.depfile is not None:
        first = split.parts[0][0]
        _rewrite_depfile(folder / f"{first}.d", split.depfile, str(folder / f"{first}.o"), split.obj)
    return 0


def _narrowed(args: list[str], options: dict[str, str]) -> list[str] | None:
    """``args`` narrowed to the ``--sass``/``--ptx`` archs, each change logged; None when refused (said why)."""
    try:
        new, dropped = narrow_args(args, filter(None, options["--sass"].split(",")),
                                   filter(None, options["--ptx"].split(",")))
    except NarrowError as exc:
        print(f"kiln nvcc (arch_policy narrow): {exc}", file=sys.stderr)
        _append(options["--log"], json.dumps({"refused": str(exc)}) + "\n")
        return None
    if dropped:
        kept = [new[i + 1] for i, token in enumerate(new[:-1]) if token == "-gencode"]
        print(f"kiln nvcc (arch_policy narrow): dropped {dropped}, kept {kept}", file=sys.stderr)
        _append(options["--log"], json.dumps({"dropped": dropped, "kept": kept}) + "\n")
    return new


def _compiler(args: list[str], options: dict[str, str]) -> tuple[str, list[str], bool]:
    """The compiler to run, its arguments, and whether it is an nvcc: ``--real`` and ``args``; or, run as CMake's
    CUDA compiler launcher (``--launched``: the nvcc shim standing for ``--real``), the compiler CMake put first
    (the shim, an nvcc the project named by path, or another CUDA compiler, which is cached whole)."""
    if "--launched" not in options:
        return options["--real"], args, True
    compiler, rest = args[0], args[1:]
    if os.path.realpath(compiler) == os.path.realpath(options["--launched"]):
        return options["--real"], rest, True
    return compiler, rest, os.path.basename(compiler) == "nvcc"


def main(argv: list[str]) -> int:
    split_at = argv.index("--")
    options = dict(zip(argv[:split_at:2], argv[1:split_at:2], strict=True))
    if "--launched" in options and len(argv) == split_at + 1:
        print("kiln nvcc: run as a compiler launcher with no compiler to run", file=sys.stderr)
        return 2
    real, args, is_nvcc = _compiler(argv[split_at + 1:], options)
    if "--sass" in options:
        narrowed = _narrowed(args, options)
        if narrowed is None:
            return 2
        args = narrowed
    launcher, active = options.get("--launcher"), options.get("--active", "")
    if not launcher or not active or os.environ.get(active):  # no cache, or nested below a compile-cache shim
        os.execv(real, [real, *args])
    os.environ[active] = "1"  # nvcc's own host compiles run the real compilers
    plan = plan_split(args) if is_nvcc and options.get("--cuobjdump") else None
    if plan is None:
        os.execv(launcher, [launcher, real, *args])
    try:
        return run_split(plan, real, launcher, options["--cuobjdump"])
    # its caller (ninja, setuptools) reads an exit status and a message
    except (CompileError, ToolchainMissingError, OSError, subprocess.SubprocessError) as exc:
        print(f"kiln nvcc: combining the per-arch compiles of {plan.source} failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
