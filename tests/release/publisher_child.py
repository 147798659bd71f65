"""A publisher process for crash and concurrency tests: ``python -m tests.release.publisher_child``.

Fault injection: when KILN_TEST_KILL_AFTER_REQUESTS is set, the process
SIGKILLs itself after that many S3 requests (see faults.kill_after) — a hook
that exists only in this test driver, never in Kiln's code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import boto3

from kiln.core.manifest import RunManifest
from kiln.core.s3 import S3Store, make_client
from kiln.release.publish.protocol import PublishRequest, PublishSteps, publish
from tests.helpers.faults import kill_after


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--variants", default="cu130,cpu")
    args = parser.parse_args()
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    client = make_client(session, "us-east-1", args.endpoint)
    sent = kill_after(client, int(os.environ.get("KILN_TEST_KILL_AFTER_REQUESTS", "1000000000")))
    plan = publish(RunManifest.load(Path(args.run)), S3Store(client, args.bucket, "site"),
                   PublishRequest(channel="nightly", channel_prefix="nightly", variants=args.variants.split(",")),
                   PublishSteps(clock=lambda: 1_700_000_000.0))
    json.dump({"requests": sent[0], "added": plan.keys("added"), "present": plan.keys("present"),
               "pages": plan.pages}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
