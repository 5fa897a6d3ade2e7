#!/usr/bin/env bash
# Build the inputs of the tiny recipes in configs/ (after scripts/setup.sh, which builds only the demo's: build/shapes
# and build/tiny-sd3). Each family is a few CPU minutes at most; nothing is downloaded; what exists is kept.
#
#   ./scripts/build_inputs.sh                 # every family
#   ./scripts/build_inputs.sh wan ltx2        # only these (sd3, wan, ltx2, minimax)
#
# sd3 (configs/sd3/): preference pairs for offline DPO (build/shapes_dpo), colourless shape prompts for GRPO
# (build/prompts, also the Wan GRPO recipe's) and the shapes training split as tensor-parquet shards of the tiny base
# (build/shapes_latents, for configs/sd3/sft_latents_tiny.yaml).
# wan (configs/wan/): tiny Wan2.1 T2V and I2V checkpoints (build/tiny-wan-t2v, build/tiny-wan-i2v) and moving-square
# MP4 datasets (build/wan-squares, build/wan-squares-i2v with first frames, build/wan-squares-dpo preference pairs).
# ltx2 (configs/ltx2/): tiny LTX-2 text/image-to-audio+video checkpoints (build/tiny-ltx2-t2av, build/tiny-ltx2-i2av),
# MP4+WAV clip datasets (build/ltx2-clips, build/ltx2-clips-dpo preference pairs, build/ltx2-clips-i2av[-dpo] with
# first frames), prompt + first-frame rows for I2AV GRPO (build/ltx2-prompts-i2av) and tensor-parquet shards of the
# SFT, DPO and I2AV clips (build/ltx2-clips_latents, build/ltx2-clips-dpo_latents, build/ltx2-clips-i2av_latents).
# minimax (configs/minimax/): tiny T2VA, FL2VA and Ref2VA checkpoints (build/tiny-minimax-{t2va,fl2va,ref2va}), MP4+WAV
# clip datasets (build/minimax-clips, build/minimax-clips-dpo preference pairs), prompt rows for GRPO
# (build/minimax-prompts) and the same with keyframes (build/minimax-keyframes[-dpo], build/minimax-keyframe-prompts)
# or references (build/minimax-references[-dpo], build/minimax-reference-prompts), and tensor-parquet shards of the SFT,
# DPO, keyframe and reference clips (build/minimax-clips_latents, build/minimax-clips-dpo_latents,
# build/minimax-keyframes_latents, build/minimax-references_latents).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then . .venv/bin/activate; fi  # else the python on PATH, with ff installed
python -c "import ff_sd3, ff_wan, ff_ltx2, ff_minimax" 2>/dev/null ||
  { echo "build_inputs.sh: ff and its plugins are not installed here; run scripts/setup.sh first" >&2; exit 1; }
export HF_HUB_OFFLINE=1
families=("$@")
[ ${#families[@]} -gt 0 ] || families=(sd3 wan ltx2 minimax)

sd3() {
  [ -f build/shapes/train.jsonl ] || python -m ff_core.testing.shapes build/shapes
  [ -f build/tiny-sd3/model_index.json ] || python -m ff_sd3.testing --out build/tiny-sd3 --vae-train-dir build/shapes/images
  [ -f build/shapes_dpo/train.jsonl ] || python -m ff_core.testing.shapes build/shapes_dpo --preference
  [ -f build/prompts/train.txt ] || python -m ff_core.testing.shapes build/prompts --prompts
  [ -d build/shapes_latents ] || ff data preprocess-latents --config configs/sd3/sft_tiny.yaml --output build/shapes_latents
}

wan() {
  [ -f build/prompts/train.txt ] || python -m ff_core.testing.shapes build/prompts --prompts
  [ -f build/tiny-wan-t2v/model_index.json ] || python -m ff_wan.testing --out build/tiny-wan-t2v --variant t2v
  [ -f build/tiny-wan-i2v/model_index.json ] || python -m ff_wan.testing --out build/tiny-wan-i2v --variant i2v
  [ -f build/wan-squares/train.jsonl ] || python -m ff_wan.testing --out build/wan-squares --dataset --n 16
  [ -f build/wan-squares-i2v/train.jsonl ] || python -m ff_wan.testing --out build/wan-squares-i2v --dataset --i2v --n 8
  [ -f build/wan-squares-dpo/train.jsonl ] || python -m ff_wan.testing --out build/wan-squares-dpo --dataset --preference --n 16
}

ltx2() {
  [ -f build/tiny-ltx2-t2av/model_index.json ] || python -m ff_ltx2.testing --out build/tiny-ltx2-t2av --variant t2av
  [ -f build/tiny-ltx2-i2av/model_index.json ] || python -m ff_ltx2.testing --out build/tiny-ltx2-i2av --variant i2av
  [ -f build/ltx2-clips/train.jsonl ] || python -m ff_ltx2.testing --out build/ltx2-clips --dataset --n 8
  [ -f build/ltx2-clips-dpo/train.jsonl ] || python -m ff_ltx2.testing --out build/ltx2-clips-dpo --dataset --preference --n 8
  [ -f build/ltx2-clips-i2av/train.jsonl ] || python -m ff_ltx2.testing --out build/ltx2-clips-i2av --dataset --i2av --n 8
  [ -f build/ltx2-clips-i2av-dpo/train.jsonl ] || python -m ff_ltx2.testing --out build/ltx2-clips-i2av-dpo --dataset --i2av --preference --n 8
  [ -f build/ltx2-prompts-i2av/train.jsonl ] || python -m ff_ltx2.testing --out build/ltx2-prompts-i2av --dataset --i2av --prompts --n 8
  [ -d build/ltx2-clips_latents ] || ff data preprocess-latents --config configs/ltx2/sft_tiny.yaml --output build/ltx2-clips_latents --no-progress
  [ -d build/ltx2-clips-dpo_latents ] || ff data preprocess-latents --config configs/ltx2/offline_dpo_tiny.yaml --output build/ltx2-clips-dpo_latents --no-progress
  [ -d build/ltx2-clips-i2av_latents ] || ff data preprocess-latents --config configs/ltx2/i2av_sft_tiny.yaml --output build/ltx2-clips-i2av_latents --no-progress
}

minimax() {
  for v in t2va fl2va ref2va; do
    [ -f build/tiny-minimax-$v/model_index.json ] || python -m ff_minimax.testing --out build/tiny-minimax-$v --variant $v
  done
  [ -f build/minimax-clips/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-clips --dataset --n 8
  [ -f build/minimax-clips-dpo/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-clips-dpo --dataset --preference --n 8
  [ -f build/minimax-prompts/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-prompts --dataset --prompts --n 8
  [ -f build/minimax-keyframes/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-keyframes --dataset --condition keyframes --n 6
  [ -f build/minimax-keyframes-dpo/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-keyframes-dpo --dataset --condition keyframes --preference --n 6
  [ -f build/minimax-keyframe-prompts/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-keyframe-prompts --dataset --condition keyframes --prompts --n 4
  [ -f build/minimax-references/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-references --dataset --condition references --n 6
  [ -f build/minimax-references-dpo/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-references-dpo --dataset --condition references --preference --n 6
  [ -f build/minimax-reference-prompts/train.jsonl ] || python -m ff_minimax.testing --out build/minimax-reference-prompts --dataset --condition references --prompts --n 4
  [ -d build/minimax-clips_latents ] || ff data preprocess-latents --config configs/minimax/t2va_sft_tiny.yaml --output build/minimax-clips_latents --no-progress
  [ -d build/minimax-clips-dpo_latents ] || ff data preprocess-latents --config configs/minimax/t2va_offline_dpo_tiny.yaml --output build/minimax-clips-dpo_latents --no-progress
  [ -d build/minimax-keyframes_latents ] || ff data preprocess-latents --config configs/minimax/fl2va_sft_tiny.yaml --output build/minimax-keyframes_latents --no-progress
  [ -d build/minimax-references_latents ] || ff data preprocess-latents --config configs/minimax/ref2va_sft_tiny.yaml --output build/minimax-references_latents --no-progress
}

for family in "${families[@]}"; do
  case "$family" in
    sd3 | wan | ltx2 | minimax) "$family" ;;
    *) echo "build_inputs.sh: unknown family '$family' (sd3, wan, ltx2, minimax)" >&2; exit 2 ;;
  esac
done
echo "inputs built: ${families[*]}"
