#!/usr/bin/env bash
# Fetches, into .whl/, the wheels the device machine's image lacks (it reaches no package
# registry; see benchmarks/device_check.sh). Run it where PyPI is reachable; .whl/ is ignored
# by git and travels with the device run as a carried path.
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl \
    "transitions>=0.9" "structlog>=24.1" "pytest-asyncio>=0.23"
ls .whl
