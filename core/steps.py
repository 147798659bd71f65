"""The pipeline's steps: the names each gets its own credentials and policy under (``[permissions.<step>]``), the
channel each publishing step owns, the prefixes only one step writes, and what a permission prefix may be.

The configuration validates against this vocabulary and the policies (``kiln.release.stores.policies``) are generated
from it; both read it here, below them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

# The steps that get their own credentials and policy; kiln.toml [permissions.<step>] keys.
Step = Literal["build", "test", "bench", "publish-nightly", "publish-release", "prune-nightly"]
STEPS: tuple[Step, ...] = get_args(Step)
# Which channel each publishing step owns; every other step owns none.
CHANNEL_OF_STEP: Mapping[str, str] = {"publish-nightly": "nightly", "publish-release": "release",
                                      "prune-nightly": "nightly"}
# The one step that writes the release baseline (benchmark results of published releases).
BASELINE_STEP = "publish-release"
# The build ledger, in the artifact store: only the build step writes it (kiln.tasks.run.ledger).
LEDGER_STEP = "build"
BUILD_LEDGER = "build-ledger/"
# The steps that may delete, only under their own write prefixes (kiln.release.publish.prune); no step deletes
# a release.
DELETING_STEPS = frozenset({"prune-nightly"})


def prefix_problem(value: object) -> str | None:
    """Why ``value`` is not a prefix IAM reads as written, or None. ``kiln.toml``
    is checked with this at load, the policies again when they are generated."""
    if not isinstance(value, str):
        return f"{value!r} is not a string prefix"
    bad = [c for c in ("*", "?", "$", "\\") if c in value]
    parts = value.strip("/").split("/")
    if bad or any(p in (".", "..") for p in parts) or value.startswith("/"):
        return (f"prefix {value!r} must be a plain relative path such as 'nightly/' "
                f"(no leading '/', '..', or IAM wildcards)")
    return None


__all__ = ["BASELINE_STEP", "BUILD_LEDGER", "CHANNEL_OF_STEP", "DELETING_STEPS", "LEDGER_STEP", "STEPS", "Step",
           "prefix_problem"]
