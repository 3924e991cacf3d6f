#!/usr/bin/env bash
# The prepared device check: every CUDA test, then a short bench of the compute-bound
# reference regime at concurrency 1, 16, 64 and 256 (the target alone, no speculation,
# every fixed DSpark width and adaptive verification), its figures written as JSON.
#
#   bash benchmarks/device_check.sh [OUT_DIR]   (default: $OUT, else device_check/ in the
#                                               folder it is run from)
#
# On a host without a CUDA device it says so and exits 0; an interpreter ($PYTHON, default
# python3) without torch is an error (exit 1). Nothing is downloaded: packages the host lacks
# come from wheels in .whl/, which benchmarks/device_wheels.sh fetches from PyPI on a machine
# that reaches it. Budget: under 8 minutes on one H200 (tests 4, bench 4).
set -uo pipefail
python=${PYTHON:-python3}
out=${1:-${OUT:-$PWD/device_check}}
case $out in /*) ;; *) out=$PWD/$out ;; esac  # the caller's folder, before the cd below
cd "$(dirname "$0")/.."

if ! command -v "$python" >/dev/null || ! "$python" -c 'import torch' 2>/dev/null; then
    echo "device check: $python cannot import torch; set PYTHON to the interpreter" >&2
    exit 1
fi
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "device check: no CUDA device on this host; nothing to run"
    exit 0
fi
# The folder is checked before any device time is spent on tests whose log it would lose.
if ! mkdir -p "$out" || ! touch "$out/device.json"; then
    echo "device check: cannot write its figures to $out" >&2
    exit 1
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/adaspec-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/adaspec-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" - >"$out/device.json" <<'PY'
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "device": torch.cuda.get_device_name(0)}))
PY

# The cuda marker selects every test that needs the device.
timeout 240 "$python" -m pytest -q -p no:cacheprovider -m cuda -rfEs tests \
    2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}

timeout 240 "$python" -m adaspec bench --quick --device=cuda --model=builtin:target-large \
    --max_seqs_per_batch=256 --concurrency=1,16,64,256 --json >"$out/bench.json" \
    2> >(tee "$out/bench.log" >&2)
bench=$?
echo "device check: tests exit $tests, bench exit $bench; figures in $out"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
