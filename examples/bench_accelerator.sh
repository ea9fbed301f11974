#!/usr/bin/env bash
# `randkv bench` on one GPU or TPU, sized to finish in under 8 minutes: Qwen3-4B-shaped random
# weights (no checkpoint needed), bfloat16, batch 16, prompt 1024, 4096 generated, budget 2048
# (w = i = 64), FullAttention, RandomAttention (Pallas kernel) and TriAttention; decode arm,
# eviction-overhead reference, equal-memory arm (1024 generated) and a serving arm (32 requests).
# Writes $OUT/bench.{json,md,png}; bench.json records the jax version and device it ran on.
#
#   CONFIG=../shared/configs/qwen3-4b.config.json OUT=bench-h200 bash examples/bench_accelerator.sh
#
# Every size is an environment variable (defaults below: the H200 sizing); `tests/test_bench_accelerator.py`
# runs the script end to end at a tiny size on CPU. The paper's full shape (32k generated, 128
# requests) is the recipe in docs/benchmarks.md.
set -euo pipefail
CONFIG=${CONFIG:-../shared/configs/qwen3-4b.config.json}
OUT=${OUT:-bench-accelerator}
python -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout "${LIMIT:-470}" python -m randkv_jax.cli bench --config "$CONFIG" --dtype "${DTYPE:-bfloat16}" \
  --batch "${BATCH:-16}" --prompt "${PROMPT:-1024}" --gen "${GEN:-4096}" --budget "${BUDGET:-2048}" \
  --window 64 --interval 64 --policies full,random,triattention --repeats 3 --no-hf \
  --memory-gen "${MEMORY_GEN:-1024}" --max-batch "${MAX_BATCH:-64}" \
  --requests "${REQUESTS:-32}" --serving-max-len "${SERVING_MAX_LEN:-2048}" --out "$OUT"
