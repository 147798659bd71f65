"""Virtual environments, one way: the tool that makes and fills them, where their packages live, and how
one sees another's packages after its own.

**The isolation rule**, said once for every interpreter Kiln starts: the working directory and the
script's directory are never on its ``sys.path``, so a module planted where Kiln was started (named like a
wheel's package, like ``uv``, ``pip`` or ``venv``) is never imported in its place.

- Kiln's own interpreter, run for a tool (``python -m uv``, ``-m pip``, ``-m venv``), runs isolated
  (:data:`TOOL_ISOLATION`, ``-I``): the tool is in Kiln's environment, and nothing of the caller's
  ``PYTHON*`` variables or user site has a say in what it imports.
- An environment's interpreter, which runs the code under test or a build backend, gets ``-P``
  (Python 3.11+): the variables Kiln sets for that code still apply. Python 3.10 has no ``-P``, so a 3.10
  environment gets ``-I`` (``kiln.tasks.build.interpreters.safe_path_flag`` reads which from its
  ``pyvenv.cfg``).

**Layers.** An environment sees another's packages after its own through one ``.pth`` file in its
site-packages (:func:`layer`): a plain path line (the other site-packages' modules only), or, with
``run_pth``, :func:`site.addsitedir` (its ``.pth`` files run too, so an editable install there works
here as it does there). Its own packages always win.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TOOL_ISOLATION = "-I"
# Run by an environment's interpreter: the site-packages directory its packages install into.
PURELIB_QUERY = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


def tool_python() -> list[str]:
    """Kiln's own interpreter, isolated, to run a tool module with (``[*tool_python(), "-m", "venv", …]``)."""
    return [sys.executable, TOOL_ISOLATION]


def uv_command() -> list[str]:
    """uv: the ``uv`` on ``PATH``, else the one installed beside Kiln's interpreter, else ``python -I -m uv``."""
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    return [found] if found else [*tool_python(), "-m", "uv"]


def layer(site: Path, name: str, parent: str | Path, *, run_pth: bool = False) -> Path:
    """Let the environment whose site-packages is ``site`` see ``parent``'s packages after its own.

    ``name`` names the ``.pth`` file (``.pth`` files run in name order: ``zz_…`` comes after what the
    environment installed itself). ``run_pth``: through :func:`site.addsitedir`, so ``parent``'s own ``.pth``
    files (an editable install's finder) run too; else a plain path line. Returns the file written.
    """
    line = f"import site; site.addsitedir({str(parent)!r})" if run_pth else str(parent)
    path = site / f"{name}.pth"
    path.write_text(line + "\n")
    return path
