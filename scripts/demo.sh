#!/usr/bin/env bash
# The demo: train the tiny SD3-architecture model on the shapes dataset (inputs built by scripts/setup.sh),
# then measure how often its samples have the colour their prompt asks for.
# Outputs: runs/demo/version_N/{loss.png, loss.csv, samples/step_*.png, checkpoints/}.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
.venv/bin/ff fit --config configs/demo/sd3_shapes.yaml "$@"
.venv/bin/python benchmarks/demo_colour_accuracy.py --run-dir runs/demo
echo "demo outputs: $(ls -td runs/demo/version_* | head -1)"
