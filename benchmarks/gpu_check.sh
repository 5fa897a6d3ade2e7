#!/usr/bin/env bash
# GPU check (docs/scaling.md, "Checking on a GPU"): each plugin's tiny recipes under single-device, FSDP1, FSDP2
# and DeepSpeed ZeRO-2 (the sharded ones on 2 GPUs when 2 are visible: one GPU shards nothing), each run checkpointed
# halfway, resumed from there and its LoRA export compared with the uninterrupted and the single-device run's; then
# tokens/s and MFU of an SD3.5-medium-sized random transformer. Writes benchmarks/gpu_check.md; copy the figures into
# benchmarks/RESULTS.md.
#
#   ./benchmarks/gpu_check.sh [extra gpu_check.py arguments, e.g. --peak-tflops 989]
#
# Needs the tiny checkpoints and datasets of scripts/setup.sh and scripts/build_inputs.sh in build/ (built here when
# missing) and a CUDA build of torch; DeepSpeed rows are skipped unless `pip install deepspeed` was run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA GPU visible')"
[ -d build/tiny-sd3 ] || ./scripts/setup.sh
./scripts/build_inputs.sh  # keeps what exists
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec timeout 900 "$PYTHON" benchmarks/gpu_check.py "$@"
