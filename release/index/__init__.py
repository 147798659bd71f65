"""Index pages and what they carry: rendered from distributions, PEP 825 variant metadata, pinned third-party files."""
