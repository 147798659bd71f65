"""A run's identity: its record, its version, its source."""
