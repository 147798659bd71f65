"""The project description: kiln.toml and the kernel registry."""
