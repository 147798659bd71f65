"""What a torch extension's ``setup.py`` can build, and the switches its build reads (pure: text in).

Three patterns, each common to several public kernel packages:

* **a prebuilt-wheel download** (flash-attention's ``bdist_wheel``, copied by
  many): unless ``<NAME>_FORCE_BUILD=TRUE``, the build guesses a release URL and
  downloads someone else's wheel. Kiln sets the switch in the GPU variant's
  ``build_env`` (and its builds reach no download host either:
  :func:`kiln.tasks.build.backend.build_environ`).
* **CUDA only when a GPU is seen** (the PyTorch Geometric family's
  ``FORCE_CUDA=1``): build machines have no GPU, so the switch goes into the GPU
  variant's ``build_env``.
* **which variants are real**: a CPU variant only where the build has a CPU path
  (a ``CppExtension`` it builds); a ``*_SKIP_CUDA_BUILD`` switch makes an sdist
  and a wheel without kernels, never a CPU build; a GPU variant only where it
  compiles device code (a ``CUDAExtension``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

_ENV_READ = (r"""(?:getenv|environ\.get)\(\s*["']({name})["'](?:\s*,\s*[^)]*)?\)(?:\.\w+\(\))*"""
             r"""(?:\s*==\s*["']([^"']+)["'])?""")
_FORCE_BUILD = re.compile(_ENV_READ.format(name=r"[A-Z][A-Z0-9_]*_FORCE_BUILD"))
_SKIP_CUDA = re.compile(r"""["']([A-Z][A-Z0-9_]*_SKIP_CUDA_BUILD)["']""")
_FORCE_CUDA = re.compile(_ENV_READ.format(name=r"(?:[A-Z][A-Z0-9_]*_)?FORCE_CUDA(?:_EXTENSION|_BUILD)?"))
_DOWNLOAD = re.compile(r"\b(CachedWheelsCommand|urlretrieve|urlopen|requests\.get)\b")


@dataclass(frozen=True)
class Switches:
    cuda_extension: bool  # it builds a CUDAExtension (device code)
    cpu_extension: bool  # it builds a CppExtension: a real CPU path
    gpu_env: tuple[tuple[str, str], ...]  # what its GPU variants' build_env sets
    reasons: tuple[str, ...]


def _used_names(tree: ast.Module | None) -> set[str]:
    """Names the module uses (an import alone does not count: flash-attention imports CppExtension, unused)."""
    if tree is None:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def _switch(pattern: re.Pattern[str], text: str, default: str) -> tuple[str, str] | None:
    match = pattern.search(text)
    return (match.group(1), match.group(2) or default) if match else None


def read_switches(setup_py: str, tree: ast.Module | None) -> Switches:
    """The build switches and extension kinds of a ``setup.py`` (``tree``: its syntax tree, None if unparsable)."""
    used = _used_names(tree)
    reasons: list[str] = []
    env: list[tuple[str, str]] = []
    force = _switch(_FORCE_BUILD, setup_py, "TRUE")
    if force is not None:
        env.append(force)
        reasons.append(f"build_env {force[0]}={force[1]}: unless it is set, setup.py's bdist_wheel downloads a"
                       " prebuilt wheel instead of building one")
    elif _DOWNLOAD.search(setup_py):
        reasons.append("setup.py may download during the build and names no *_FORCE_BUILD switch: Kiln's build"
                       " reaches no download host, so such a download fails the unit rather than publish it")
    cuda = _switch(_FORCE_CUDA, setup_py, "1")
    if cuda is not None:
        env.append(cuda)
        reasons.append(f"build_env {cuda[0]}={cuda[1]}: setup.py compiles its CUDA code only when it sees a GPU or"
                       " that switch, and build machines have no GPU")
    skip = _SKIP_CUDA.search(setup_py)
    if skip is not None:
        reasons.append(f"{skip.group(1)} makes a wheel without its kernels (for sdists): no CPU variant")
    return Switches("CUDAExtension" in used, "CppExtension" in used, tuple(env), tuple(reasons))
