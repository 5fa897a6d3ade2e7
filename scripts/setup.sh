#!/usr/bin/env bash
# Create .venv with ff-core and every model plugin in editable mode (CPU torch pinned), then build the demo's inputs:
# the synthetic shapes dataset (build/shapes) and a tiny SD3-architecture base (build/tiny-sd3) whose VAE is trained to
# reconstruct those images. The other tiny recipes' inputs (configs/sd3 DPO/GRPO/shards, configs/wan, configs/ltx2,
# configs/minimax) are built by scripts/build_inputs.sh; the test suite builds its own in temporary folders.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
pip install -q --disable-pip-version-check torch==2.13.0
plugins=()
for p in plugins/*/; do plugins+=(-e "$p"); done
DS_BUILD_OPS=0 pip install -q --disable-pip-version-check transformers==5.24.0 ftfy -e ".[test,deepspeed]" "${plugins[@]}"
export HF_HUB_OFFLINE=1
[ -f build/shapes/train.jsonl ] || python -m ff_core.testing.shapes build/shapes
[ -f build/tiny-sd3/model_index.json ] || python -m ff_sd3.testing --out build/tiny-sd3 --vae-train-dir build/shapes/images
echo "setup done: $(python -c 'import ff_core, torch; print("ff-core ready, torch", torch.__version__)')"
