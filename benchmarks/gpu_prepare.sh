#!/usr/bin/env bash
# Prepare the carry of the offline GPU check (benchmarks/gpu_check.sh), here, with PyPI reachable:
# under one git-ignored folder (default .gpu-carry/, at most 60 MiB, its size printed and checked),
# the wheels of everything the check needs beyond what the GPU machine has (it has torch, Triton,
# their CUDA libraries and numpy; see benchmarks/gpu_carry.toml), for the machine's Python and
# manylinux x86_64, plus Kiln's own three wheels, and carry.json naming the target. A target it
# cannot serve (a distribution with no wheel for that Python and platform, a torch or Triton Kiln's
# wheels do not accept) is refused, naming it, and nothing is written.
#
# Usage: benchmarks/gpu_prepare.sh [--python-version 3.12] [--torch-version 2.11.0]
#                                  [--triton-version 3.6.0] [--out .gpu-carry]
#        (from Kiln's dev environment: the versions carried are the ones it has)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_carry.py prepare "$@"
