"""Views of a store and their permissions: a read-only store, a copy-on-write staging view, least-privilege policies."""
