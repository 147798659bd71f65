"""Quiet, offline-safe Prefect defaults, applied before Prefect is imported.

A release engineer's laptop or a CI box may have no internet: analytics and
telemetry would only produce connection errors in the logs. Values already in
the environment win, so a real deployment can turn any of them back on.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
    "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
    "DO_NOT_TRACK": "1",
    # tasks/ and release/ log through "kiln.*" loggers even outside a flow run.
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # The embedded server migrates a fresh SQLite database on first start; on a
    # busy 2-core machine (load 10) that takes minutes, not Prefect's 20 s default.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600",
    # Route the plain-Python libraries' loggers (tasks/, release/) into Prefect's run logs.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "kiln",
    # Triton's one-time notice about its FP-fusion default changing is noise in every run.
    "TRITON_DEFAULT_FP_FUSION": "1",
}


def apply_defaults() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
