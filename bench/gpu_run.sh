#!/usr/bin/env bash
# The checks for a lent GPU machine, as one command (it has torch and transformers, no network, no Ray, Prefect or
# SGLang): installs the carried wheels (`make gpu-wheels` here, carry .gpu-wheels), then runs bench/gpu_smoke.py and
# tests/gpu with skips turned into failures. Output: $OUT/gpu_smoke.json, $OUT/gpu_smoke.log, $OUT/pytest.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/spillover-gpu}
mkdir -p "$OUT"
PYLIB=$(mktemp -d)
python3 -m pip install -q --no-index --find-links .gpu-wheels --target "$PYLIB" pydantic fastapi uvicorn orjson \
    > "$OUT/pip.log" 2>&1 || { echo "carried wheels did not install: $OUT/pip.log"; exit 1; }
ln -s "$PWD" "$PYLIB/spillover"  # the repository root is the `spillover` package (pyproject maps it; nothing is installed here)
export PYTHONPATH="$PWD:$PYLIB"
# the engine checks at Qwen2.5-0.5B's shape (random init, bfloat16 like the recipes' checkpoints; no download)
MODEL=$(mktemp -d)/qwen2.5-0.5b-random
python3 -c "import sys, torch; from spillover.bench.gpu_learner import random_qwen2; from pathlib import Path
random_qwen2('0.5b', Path(sys.argv[1]), dtype=torch.bfloat16)" "$MODEL" > "$OUT/model.log" 2>&1 \
    || { echo "the 0.5B model folder was not built: $OUT/model.log"; exit 1; }
timeout 420 python3 bench/gpu_smoke.py --model "$MODEL" > "$OUT/gpu_smoke.json" 2> "$OUT/gpu_smoke.log"
smoke=$?
SPILLOVER_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/gpu tests/gpu \
    --ignore=tests/gpu/test_sglang_gpu.py > "$OUT/pytest.log" 2>&1
tests=$?
tail -1 "$OUT/gpu_smoke.json"; tail -3 "$OUT/pytest.log"
echo "gpu_smoke exit $smoke, tests/gpu exit $tests"
exit $(( smoke || tests ))
