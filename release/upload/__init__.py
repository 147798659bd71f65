"""Uploads to indexes outside Kiln's own: the uploader protocol and its kinds, PyPI's rules, twine,
trusted publishing."""
