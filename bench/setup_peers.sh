#!/usr/bin/env bash
# The peers `tlt bench peers` compares against, installed only for the benchmark (never by the
# core install): TRL (with accelerate and datasets). transformers is already a test dependency.
set -euo pipefail
python -m pip install "trl>=1.16"
