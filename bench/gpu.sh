#!/usr/bin/env bash
# The GPU checks, in one run (a few minutes on one H100/H200-class GPU): the GPU tests, one epoch on
# one GPU with and without --amp, the article's data path (pinned DataLoader, non_blocking copies) for
# comparison, --check and each --compress over NCCL. Prints a Markdown table of train seconds and
# accuracy; writes its files to OUT.
#   bash bench/gpu.sh [OUT]        (needs Debian's dataset-fashion-mnist, or FashionMNIST in ./data)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu}
mkdir -p "$OUT" data/FashionMNIST/raw
[ -e data/FashionMNIST/raw/train-images-idx3-ubyte.gz ] || cp /usr/share/datasets/fashion-mnist/*.gz data/FashionMNIST/raw/
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -m pytest -q -rs tests/test_cuda_script.py tests/test_cli.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
common=(--dataset fashion-mnist --data-dir data --log-interval 100)
for run in 1 2; do
  python convnet_distributed_cuda.py --num-gpu-processes 1 --batch-size 128 "${common[@]}" --metrics-json "$OUT/fp32-$run.json" > "$OUT/fp32-$run.log" 2> "$OUT/fp32-$run.err"
  python convnet_distributed_cuda.py --num-gpu-processes 1 --batch-size 128 --amp "${common[@]}" --metrics-json "$OUT/amp-$run.json" > "$OUT/amp-$run.log" 2> "$OUT/amp-$run.err"
  python bench/torchvision_reference.py --device cuda --batch-size 128 --dataset fashion-mnist --data-dir data --metrics-json "$OUT/article-$run.json" > "$OUT/article-$run.log"
done
# NCCL paths the tests cover only through Gloo: --check, and each --compress hook on one GPU (one run each).
python convnet_distributed_cuda.py --num-gpu-processes 1 --check > "$OUT/check.log"
for compress in bf16 powersgd; do
  python convnet_distributed_cuda.py --num-gpu-processes 1 --batch-size 128 --compress $compress "${common[@]}" \
    --checkpoint "$OUT/$compress.pt" --metrics-json "$OUT/$compress.json" > "$OUT/$compress.log"
done
# DDP warns once per process when a gradient's strides differ from its bucket's (a copy every step).
grep -l "Grad strides do not match" "$OUT"/*.err 2>/dev/null && echo "DDP copied gradients: see the files above" || true
python - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
print("| run | train seconds (median of 2) | test accuracy |\n|---|---|---|")
for name, label in (("fp32", "convnet_distributed_cuda.py, 1 GPU"), ("amp", "the same with --amp"),
                    ("article", "article's path: DataLoader, pin_memory, non_blocking")):
    runs = [json.load(open(f"{out}/{name}-{r}.json")) for r in (1, 2)]
    seconds = statistics.median(m["train_seconds"] for m in runs)
    print(f"| {label} | {seconds:.2f} | {100 * runs[-1]['test_accuracy']:.2f}% |")
for name in ("bf16", "powersgd"):
    m = json.load(open(f"{out}/{name}.json"))
    print(f"| the same with --compress {name} (1 run) | {m['train_seconds']:.2f} | {100 * m['test_accuracy']:.2f}% |")
PY
