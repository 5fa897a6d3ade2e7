"""Cost of the built-in rewards, and of scoring them during validation.

Run: ``python benchmarks/bench_rewards.py [--batch 32] [--size 512] [--repeats 3]``. Prints two markdown tables:

* per reward, milliseconds per image on the CPU for a batch of random uint8 ``size`` x ``size`` images (best of
  ``repeats``; ``clip_score`` with a small random CLIPModel (ViT 4 layers, width 128, 224 px input) built and saved
  here, so the figure is the preprocessing plus a small model, not a real ViT-B/32);
* ``ff validate`` of the tiny SD3 demo model on 12 shapes prompts (10 Euler steps), without eval rewards and with the
  recipe's (``prompt_colour`` + ``green``): what the rewards add to an evaluation (best of 2, alternated). Run it
  from a checkout where ``scripts/setup.sh`` and ``scripts/build_inputs.sh sd3`` built ``build/`` (the recipe's
  relative paths).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ff_core.objectives.rewards import Rewards
from ff_core.rewards import RewardBatch

REPO = Path(__file__).resolve().parents[1]


def small_clip(folder: Path) -> str:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from ff_core.testing.tiny import build_clip_tokenizer

    tok = build_clip_tokenizer(max_length=77)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, max_position_embeddings=77, **ids),
                     vision_config=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                        num_attention_heads=4, image_size=224, patch_size=32), projection_dim=64)
    CLIPModel(cfg).save_pretrained(folder)
    CLIPProcessor(tokenizer=tok, image_processor=CLIPImageProcessor()).save_pretrained(folder)
    return str(folder)


def reward_costs(batch_size: int, size: int, repeats: int, clip_dir: str) -> list[tuple[str, float]]:
    gen = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=gen) for _ in range(batch_size)]
    batch = RewardBatch(media=[[x] for x in images], prompts=["a red circle on a white background"] * batch_size,
                        metadata=[{}] * batch_size)
    specs = [("colour (closeness)", {"name": "colour"}),
             ("colour (hue_fraction)", {"name": "colour", "args": {"measure": "hue_fraction"}}),
             ("brightness", {"name": "brightness"}),
             ("jpeg_compressibility", {"name": "jpeg_compressibility"}),
             ("clip_score (small random CLIP)", {"name": "clip_score",
                                                 "args": {"pretrained_model_name_or_path": clip_dir}})]
    out = []
    for label, spec in specs:
        rewards = Rewards([spec])
        rewards(batch)  # warm-up
        best = min(_timed(lambda: rewards(batch)) for _ in range(repeats))
        out.append((label, 1000 * best / batch_size))
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


SCORING: list[float] = []


def _timed_call(original):
    def call(self, batch):
        start = time.perf_counter()
        try:
            return original(self, batch)
        finally:
            SCORING.append(time.perf_counter() - start)
    return call


def validate_seconds(eval_rewards: list | None, root: Path) -> tuple[float, dict]:
    from ff_core.cli.flow_cli import FlowCLI
    from ff_core.data.datamodule import FlowDataModule
    from ff_core.module import FlowModule

    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(REPO / "configs/sd3/sft_tiny.yaml"), "--trainer.default_root_dir", str(root),
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--model.eval_rewards", json.dumps(eval_rewards)])
    cli.datamodule.setup("validate")
    start = time.perf_counter()
    metrics = cli.trainer.validate(cli.model, cli.datamodule, verbose=False)[0]
    return time.perf_counter() - start, metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        costs = reward_costs(args.batch, args.size, args.repeats, small_clip(Path(tmp) / "clip"))
        print(f"| reward ({args.batch} images, {args.size} x {args.size}) | ms / image |\n|---|---|")
        for label, ms in costs:
            print(f"| {label} | {ms:.2f} |")
        import yaml

        recipe = yaml.safe_load((REPO / "configs/sd3/sft_tiny.yaml").read_text())["model"]["eval_rewards"]
        # Whole validations are noisy on a shared machine: time the scoring itself (every Rewards call) as well.
        Rewards.__call__ = _timed_call(Rewards.__call__)
        plain = scored = float("inf")
        for i in range(2):
            plain = min(plain, validate_seconds([], Path(tmp) / f"plain{i}")[0])
            SCORING.clear()
            seconds, metrics = validate_seconds(recipe, Path(tmp) / f"scored{i}")
            scored, scoring = min(scored, seconds), sum(SCORING)
        print("\n| `ff validate`, 12 prompts, 10 steps | seconds |\n|---|---|")
        print(f"| no eval rewards | {plain:.2f} |\n| recipe's eval rewards | {scored:.2f} |")
        print(f"| of which scoring ({len(SCORING)} batches) | {scoring:.3f} |")
        print("\n" + ", ".join(f"{k} = {v:.3f}" for k, v in sorted(metrics.items())))


if __name__ == "__main__":
    main()
