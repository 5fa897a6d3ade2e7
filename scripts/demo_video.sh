#!/usr/bin/env bash
# The video demo, beside the image one (scripts/demo.sh): train a tiny Wan2.1-architecture text-to-video model on
# the moving-shapes clips, then measure how often its clips move the way their prompt says against the untrained base.
# Builds its inputs when missing (after scripts/setup.sh): build/moving_shapes (the clips), build/tiny-wan-demo
# (a tiny Wan T2V checkpoint whose VAE is trained to reconstruct them) and build/moving_shapes_latents (the clips'
# latents and text embeddings as tensor-parquet shards, so training steps run only the transformer).
# The shards hold that base's latents: delete build/tiny-wan-demo and build/moving_shapes_latents together to
# rebuild (a base built before the VAE's narrow-posterior default should be rebuilt: benchmarks/RESULTS.md).
# Outputs: runs/demo_video/version_N/{loss.png, metrics.csv, samples/, checkpoints/}.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
[ -f build/moving_shapes/train.jsonl ] || .venv/bin/python -m ff_core.testing.moving_shapes build/moving_shapes
[ -f build/tiny-wan-demo/model_index.json ] || \
  .venv/bin/python -m ff_wan.demo_base --out build/tiny-wan-demo --clips build/moving_shapes
if [ -d build/moving_shapes_latents ] && [ build/tiny-wan-demo/model_index.json -nt build/moving_shapes_latents ]; then
  echo "build/moving_shapes_latents is older than build/tiny-wan-demo: its latents come from an earlier base;" \
       "delete build/moving_shapes_latents to rebuild them" >&2
  exit 1
fi
# One VAE posterior sample per clip, stored once and reused every epoch (docs/datasets.md, "Which latents"), in
# float32: the storage the demo's figures in benchmarks/RESULTS.md were measured with (the command's default is bf16).
[ -d build/moving_shapes_latents ] || .venv/bin/ff data preprocess-latents --dtype float32 \
  --config configs/demo/wan_moving_shapes.yaml --output build/moving_shapes_latents \
  --data.datasets '[{name: moving_shapes, dataset_dir: build/moving_shapes, train: {weight: 1}}]'
.venv/bin/ff fit --config configs/demo/wan_moving_shapes.yaml "$@"
.venv/bin/python benchmarks/demo_motion_accuracy.py --run-dir runs/demo_video
echo "video demo outputs: $(ls -td runs/demo_video/version_* | head -1)"
