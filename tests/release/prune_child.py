"""A prune process for crash tests: ``python -m tests.release.prune_child``.

Fault injection, only in this test driver, never in Kiln's code: with
``--kill-after N`` the process SIGKILLs itself just before its (N+1)-th
store request (S3: every HTTP request, see faults.kill_after; a local
directory: every write or delete). Prints the number of requests it made.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import boto3

from kiln.core.s3 import S3Store, make_client
from kiln.core.store import LocalStore
from kiln.release.publish.prune import Retention, prune
from tests.helpers.faults import HookedLocalStore, kill_after

NEVER = 1 << 40


class KillingLocalStore(HookedLocalStore):
    """A local store that SIGKILLs the process before its (limit+1)-th write or delete (crash injection)."""

    def __init__(self, root: Path, limit: int) -> None:
        super().__init__(root)
        self.limit, self.sent = limit, 0

    def before_write(self, key: str) -> None:
        if self.sent >= self.limit:
            os.kill(os.getpid(), signal.SIGKILL)
        self.sent += 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", help="a local store's directory")
    parser.add_argument("--endpoint")
    parser.add_argument("--bucket")
    parser.add_argument("--keep", type=int, default=1)
    parser.add_argument("--grace-days", type=float, default=0)
    parser.add_argument("--now", type=float, required=True)
    parser.add_argument("--kill-after", type=int, default=NEVER)
    args = parser.parse_args()
    store: LocalStore | S3Store
    if args.dir:
        store = KillingLocalStore(Path(args.dir), args.kill_after)
        sent = lambda: store.sent  # noqa: E731
    else:
        session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                region_name="us-east-1")
        client = make_client(session, "us-east-1", args.endpoint)
        counter = kill_after(client, args.kill_after)
        store = S3Store(client, args.bucket, "site")
        sent = lambda: counter[0]  # noqa: E731
    plan = prune(store, channel="nightly", channel_prefix="nightly", clock=lambda: args.now,
                 retention=Retention(args.keep, args.grace_days))
    json.dump({"requests": sent(), "deleted": plan.deleted, "removed": plan.removed}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
