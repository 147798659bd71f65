"""The wheel stage's work after a build: each variant's wheel assembled (its sources, artifacts, SBOM),
a backend's wheel made the variant's, and checked: manylinux and ABI audits, the device code it holds."""
