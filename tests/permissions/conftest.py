"""The permissions tests' fixtures: an IAM-enforcing moto server per module (tests/helpers/moto_iam.py)."""

from tests.helpers.moto_iam import kiln_log, moto_server  # noqa: F401 (fixtures)
