"""Kiln's error hierarchy.

Every error Kiln raises derives from :class:`KilnError`, which derives from
``Exception`` (Prefect reports a ``BaseException`` as Crashed, not Failed).
Whether an error is worth retrying is a property of its type: retry
conditions look at :attr:`KilnError.retryable` and nothing else.

This module lives in ``release/`` because it is the lowest layer: ``tasks``
and ``flows`` import it, and ``release`` must stay importable without them.
"""

from __future__ import annotations

from typing import ClassVar

# The exit statuses of every Kiln command line, one table: an error carries its own (exit_status).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class KilnError(Exception):
    """Root of every error Kiln raises on purpose."""

    retryable: ClassVar[bool] = False
    exit_status: ClassVar[int] = EXIT_FAILED  # what a command that ends on this error exits with


class RetryableError(KilnError):
    """A transient fault: the same call may succeed if tried again."""

    retryable = True


class PermanentError(KilnError):
    """A real fault: retrying cannot help; fail at once with the message."""

    retryable = False


# --- bad input (invariant 7) -------------------------------------------------


class InvalidInputError(PermanentError):
    """Input that is malformed: a bad name, version, path or value."""

    exit_status = EXIT_USAGE


class ConfigError(InvalidInputError):
    """``kiln.toml`` or a flow parameter is invalid; nothing was started."""


# --- storage and publishing --------------------------------------------------


class IntegrityError(PermanentError):
    """Bytes do not match the hash that was promised for them."""


class AlreadyPublishedError(IntegrityError):
    """A create-only key already holds other bytes; published files are immutable.

    Its own type because the publisher reports it as a conflict of one file
    (the rest is still published), while other integrity errors stop a publish.
    Its message is written here only, by :meth:`held`, so every store says it once.
    """

    @classmethod
    def held(cls, location: str, existing: str | None, wanted: str) -> AlreadyPublishedError:
        return cls(f"{location} already holds sha256 {existing}, not {wanted}; "
                   f"{IMMUTABLE_HINT}")


IMMUTABLE_HINT = "published files are immutable — bump the version instead"


class AccessDeniedError(PermanentError):
    """The store refused the call for lack of permission."""


class ThrottledError(RetryableError):
    """The store asked us to slow down (S3 ``SlowDown``, HTTP 503...)."""


class TransientStoreError(RetryableError):
    """A connection reset, a timeout or a 5xx from the store."""


class WorkerLostError(RetryableError):
    """The worker running a dispatched unit was lost (its flow run Crashed); another may run it."""


class ConflictError(RetryableError):
    """A compare-and-swap lost a race; re-read and try again."""


class FetchError(PermanentError):
    """A page or file of an index could not be read from its URL (missing, refused, unreadable).

    ``status`` is the HTTP status when a server answered, so a caller can tell
    "absent" (404) from "broken"."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type, tuple[str, int | None]]:
        return type(self), (str(self), self.status)


# --- build -------------------------------------------------------------------


class CompileError(PermanentError):
    """A kernel failed to compile for one target."""


class AbiAuditError(CompileError):
    """A wheel's binaries break the ABI its tag or its variant claims (abi3, the torch stable ABI)."""


class CacheDriftError(RetryableError):
    """A cache entry's artifact is missing or its hash differs.

    The build stage invalidates the entry's whole batch and rebuilds it.
    """


class ToolchainMissingError(PermanentError):
    """A required compiler or tool is not installed."""


class BuildWorkerError(PermanentError):
    """A build worker's call failed for a reason that is not the compiler's: an import,
    a registry or config problem, a bug. The unit's code was never judged, so this is not
    a :class:`CompileError`; its cause is the worker's exception, with the worker's traceback."""

    def __init__(self, worker: str, target: str, error_type: str, detail: str) -> None:
        super().__init__(f"build worker {worker} failed running {target}: {error_type}: {detail}"
                         " (an error of the worker or its environment, not a compile failure)")
        self.worker, self.target, self.error_type, self.detail = worker, target, error_type, detail

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str]]:
        return type(self), (self.worker, self.target, self.error_type, self.detail)


# --- test --------------------------------------------------------------------


class InfrastructureError(RetryableError):
    """A worker was lost, a rendezvous failed, a device ran out of memory."""


class DistributedTestError(PermanentError):
    """One or more ranks of a distributed test failed."""


class TestTimeoutError(PermanentError):
    """A test or rank ran past its deadline and was terminated."""

    __test__ = False  # not a pytest test class


# --- benchmark / release -------------------------------------------------------


class RegressionError(PermanentError):
    """A benchmark regressed beyond both the threshold and the noise."""


def is_retryable(exc: BaseException) -> bool:
    """True when ``exc`` (or what it was raised from) is a retryable Kiln error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KilnError):
            return current.retryable
        seen.add(id(current))
        current = current.__cause__
    return False


class BenchmarkError(PermanentError):
    """A benchmark case could not run (its kernel or reference raised)."""


# --- hostile input: bombs, links, off-index URLs ------------------------------


class MemberTooLargeError(InvalidInputError):
    """A wheel member Kiln reads (METADATA, RECORD, WHEEL, a manifest) is larger than its limit.

    Checked from the zip header before reading and again while inflating, so
    a header that lies about the size cannot make Kiln inflate past the limit.
    """


class RecordMismatchError(IntegrityError):
    """A wheel's RECORD does not describe its members (a hash, a size, a member missing or extra)."""


class UnsafePathError(InvalidInputError):
    """A path Kiln writes (or reads) goes through a symbolic link under its root, or leaves the root."""


class LinkRefusedError(FetchError):
    """An index links outside itself (another scheme, host or port than the index's own and the named
    extra indexes'); the link is reported and never fetched."""


class TooLargeError(FetchError):
    """A download ran past its cap (the size the page declares, or the configured maximum) or its deadline;
    reading stopped there."""
