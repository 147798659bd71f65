""":class:`~kiln.tasks.onboarding.inspect.Findings` -> a commented ``kiln.toml`` (pure: text in, text out).

The defaults it fills in where the package says nothing (the CUDA variant's
name, torch and archs) are data, in ``defaults.toml`` beside this module.
"""

from __future__ import annotations

import json

from kiln.tasks.onboarding.defaults import Defaults, load_defaults
from kiln.tasks.onboarding.inspect import Findings, SuitePlan


def _q(value: str) -> str:
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's


def _list(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(_q(v) for v in values) + "]"


def _table(pairs: tuple[tuple[str, str], ...]) -> str:
    return "{ " + ", ".join(f"{name} = {_q(value)}" for name, value in pairs) + " }"


def _choice(f: Findings, field: str) -> str:
    """A commented choice after ``field``'s value where kiln init could not decide it (never a silent guess)."""
    others = dict(f.undecided).get(field)
    if not others:
        return ""
    also = ", ".join(_q(o) for o in others)
    then = " (and source, its folder)" if field == "package" else ""
    return f"  # kiln init could not decide: also {also} - pick one{then}"


def _header(f: Findings) -> list[str]:
    lines = ["# Written by `kiln init`: what it inferred from this repository, and why:"]
    lines += [f"#   - {reason}" for reason in f.reasons]
    lines += [f"# ASSUMED (the package does not say; check it): {value}" for value in f.assumed]
    if f.missing_sources:
        missing = ", ".join(f.missing_sources)
        lines.append(f"# WARNING: its build names native sources this tree does not hold ({missing}); every build"
                     " of it fails until they are there (an sdist's MANIFEST.in left them out?)")
    lines += ["# Edit freely: `kiln nightly` reads only this file. The README's `kiln.toml` section lists every key.",
              "", "[project]", f"package = {_q(f.package)}{_choice(f, 'package')}",
              f"distribution = {_q(f.distribution)}{_choice(f, 'distribution')}",
              f"version = {_q(f.version)}                 # nightlies are <version>.dev<commit time>",
              f"source = {_q(f.source)}", f"requires_python = {_q(f.requires_python)}"]
    if f.registry:
        lines.append(f"registry = {_q(f.registry)}")
    if f.runtime:
        lines.append('dependencies = ["kiln-runtime"]   # the package launches through kiln.runtime\'s loader')
    return lines


def _variants(f: Findings, d: Defaults) -> list[str]:
    if f.kind == "triton-jit":
        return ["", "# A pure-Triton package: one portable py3-none-any wheel (no local label), which every suite",
                "# tests: CPU suites through Triton's interpreter, GPU suites on their pools.", "[[variants]]",
                f"name = {_q(d.jit_variant)}", 'backend = "cpu"                   # built on the CPU; runs anywhere']
    lines: list[str] = []
    if f.cuda_build:
        archs = d.registry_archs if f.kind == "registry" else d.extension_archs
        lines += ["", "[[variants]]", f"name = {_q(d.cuda_variant)}", 'backend = "cuda"',
                  f"archs = {_list(archs)}             # widen for a release: every arch is a build"]
        if f.torch_extension:
            lines.append(f"build_requires = {_list([d.cuda_torch])}   # its CUDAExtension builds against a CUDA torch")
        if f.arch_policy == "narrow":
            lines.append('arch_policy = "narrow"            # setup.py names its own archs: Kiln\'s nvcc keeps the'
                         " variant's")
        elif f.arch_policy == "at_least":
            lines.append('arch_policy = "at_least"          # its build picks its own archs too: recorded, not refused')
        if f.gpu_env:
            lines.append(f"build_env = {_table(f.gpu_env)}   # its build switches (the header says why each)")
    if f.cpu_build or not f.cuda_build:
        lines += ["", "[[variants]]", f"name = {_q(d.cpu_variant)}", 'backend = "cpu"                   # Kiln\'s'
                  " own (CPU) torch"]
        if f.cpu_env:
            lines.append(f"build_env = {_table(f.cpu_env)}   # the switch that opens its CPU path")
    if f.also_read:
        lines += ["# also read by its build, not set by kiln init (what each controls, where it is read):",
                  *(f"#   {line}" for line in f.also_read)]
    return lines


def _build(f: Findings) -> list[str]:
    if f.kind == "registry":
        return ["", "[build]", "jobs = 2"]
    own = "setup.py (setuptools' legacy backend)" if f.setup_py_only else "pyproject.toml"
    lines = ["", "[build]", f'backend = "pep517"                # the package\'s own {own} builds each wheel']
    if f.kind == "triton-jit":
        lines.append('kind = "triton-jit"               # kernels compile at run time: no device code expected')
    if f.torch_extension:
        lines += ["", "[build.toolchain]", "torch = true                       # its wheels pin the torch they built"
                  " against"]
    return lines


def _suite(s: SuitePlan, d: Defaults) -> list[str]:
    lines = ["", f"[[suites]]                          # {s.why}", f"name = {_q(s.name)}", f"paths = {_list(s.paths)}"]
    if s.markers:
        lines.append(f"markers = {_q(s.markers)}")
    if s.gpus:
        lines.append(f"gpus = {s.gpus}")
    if s.requires:
        lines.append(f"requires = {_list(s.requires)}            # Triton's interpreter runs the kernels on the CPU")
    if s.publish_untested:
        lines.append("publish_untested = true            # where no GPU runs it, the wheel is published marked"
                     " untested")
    return lines


def render(f: Findings, d: Defaults | None = None) -> str:
    """The ``kiln.toml`` text for ``f``: valid for :func:`kiln.tasks.project.config.parse_config` as it is."""
    d = d or load_defaults()
    lines = _header(f) + _variants(f, d) + _build(f)
    for suite in f.suites:
        lines += _suite(suite, d)
    lines += ["", "[publish]", 'default_target = "local"', "", "[publish.targets.local]",
              f"url = {_q(d.publish_url)}         # {{out}}: the --out directory of the run",
              "# An s3:// target (and an s3:// [artifacts] store) needs credentials per step: add",
              "# [permissions.<step>] credentials = { block = \"...\" } (see the README's Permissions)."]
    return "\n".join(lines) + "\n"
