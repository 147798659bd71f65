"""Kiln's local process plumbing: the Prefect server, the build daemon, the console launcher."""
