"""Tiny, random-initialised Wan checkpoints in the diffusers layout, built offline in seconds.

:func:`build_tiny_wan` writes every component of diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline``
(``transformer/`` [``transformer_2/``], ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``,
[``image_encoder/``, ``image_processor/``] and ``model_index.json``) with ``save_pretrained``, so the folder loads
both through the ff adapters and through diffusers. One factory covers every variant the adapters tell apart by config:

============  =========================================================================================
``t2v``       Wan2.1 T2V: ``WanPipeline``, transformer ``in_channels = z_dim``.
``i2v``       Wan2.1 I2V: ``WanImageToVideoPipeline``, ``in_channels = 2 z_dim + 4`` (noise, mask, condition
              latents), ``image_dim`` + a CLIP vision encoder (penultimate hidden states).
``flf2v``     Wan2.1 FLF2V: as ``i2v`` plus ``pos_embed_seq_len`` (two CLIP images, first and last frame).
``ti2v``      Wan2.2 TI2V: ``expand_timesteps`` (first latent frame pinned, per-token timesteps),
              ``in_channels = z_dim``.
``a14b``      Wan2.2 I2V-A14B: two experts (``transformer``, ``transformer_2``) switched at ``boundary_ratio``,
              ``in_channels = 2 z_dim + 4``, no image encoder.
``t2v_a14b``  Wan2.2 T2V-A14B: ``WanPipeline`` with two experts switched at ``boundary_ratio``.
============  =========================================================================================

Sizes: a 1-layer transformer with 2 heads of 8 channels, a Wan VAE with ``base_dim`` 4 and ``dim_mult`` (1, 1, 1, 1)
(4x temporal, 8x spatial compression as the real one), ``z_dim`` 4 with non-trivial ``latents_mean`` / ``latents_std``
so normalisation is really exercised; the tokenizer is :func:`ff_core.testing.tiny.build_t5_tokenizer` on the video
vocabulary (UMT5's special tokens). 9 frames at 32x32 are 3 latent frames of 4x4, 2x2 tokens each after patching.

:func:`write_moving_squares` writes a tiny V2 video dataset (MP4 targets with ``fps``, optional ``first_frame`` images).

CLI: ``python -m ff_wan.testing --out DIR [--variant t2v]``; ``--dataset [--i2v] [--preference] [--n 16]`` writes
the dataset instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from ff_core.testing.moving_shapes import write_mp4
from ff_core.testing.tiny import VIDEO_WORDS, build_t5_tokenizer, seeded

VARIANTS: tuple[str, ...] = ("t2v", "i2v", "flf2v", "ti2v", "a14b", "t2v_a14b")


def build_tiny_wan(
    path: str | Path,
    *,
    variant: str = "t2v",
    seed: int = 0,
    text_max_length: int = 16,
    num_layers: int = 1,
    z_dim: int = 4,
    scheduler_shift: float = 3.0,
    boundary_ratio: float = 0.875,
    image_size: int = 32,
    scheduler: str = "euler",
) -> Path:
    """Write a tiny random-initialised Wan checkpoint of ``variant`` to ``path`` and return it.

    Args:
        path: output folder (created; existing component folders are overwritten).
        variant: one of :data:`VARIANTS`.
        seed: seed of every random initialisation (components get ``seed + k``).
        text_max_length: ``model_max_length`` of the tokenizer.
        num_layers: transformer blocks.
        z_dim: VAE latent channels (the real Wan2.1 VAE has 16).
        scheduler_shift: ``FlowMatchEulerDiscreteScheduler`` shift (Wan2.1 uses flow_shift 3.0 at 480p, 5.0 at 720p).
        boundary_ratio: the two-expert switch of ``a14b`` (Wan2.2 I2V-A14B: 0.9; 0.875 puts the switch between
            the steps of a 4-step test run).
        image_size: the CLIP image encoder's input side (``i2v`` / ``flf2v``).
        scheduler: ``euler`` (``FlowMatchEulerDiscreteScheduler(shift=scheduler_shift)``) or ``unipc``: the
            ``UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
            flow_shift=scheduler_shift)`` released Wan2.1 / Wan2.2 checkpoints ship (their scheduler_config.json;
            diffusers' docs/source/en/api/pipelines/wan.md, "By default, Wan uses ...").
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    path = Path(path)
    tokenizer = build_t5_tokenizer(text_max_length, VIDEO_WORDS)  # stands in for UMT5's: same special tokens
    text_cfg = UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    text_encoder = seeded(seed + 1, lambda: UMT5EncoderModel(text_cfg))
    g = torch.Generator().manual_seed(seed + 2)
    latents_mean = [round(float(v), 4) for v in torch.randn(z_dim, generator=g) * 0.2]
    latents_std = [round(float(v), 4) for v in 0.5 + torch.rand(z_dim, generator=g)]
    vae = seeded(seed + 3, lambda: AutoencoderKLWan(
        base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=latents_mean, latents_std=latents_std,
    ))  # fmt: skip
    two_channels = variant in ("i2v", "flf2v", "a14b")  # noise + (4 mask + z_dim condition) channels
    clip = variant in ("i2v", "flf2v")
    image_encoder = image_processor = None
    clip_dim = 8
    if clip:
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        vision_cfg = CLIPVisionConfig(hidden_size=clip_dim, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=2, image_size=image_size, patch_size=16)  # fmt: skip
        image_encoder = seeded(seed + 4, lambda: CLIPVisionModel(vision_cfg))
        image_processor = CLIPImageProcessor(crop_size=image_size, size={"shortest_edge": image_size})
    clip_tokens = (image_size // 16) ** 2 + 1

    def transformer(k: int) -> WanTransformer3DModel:
        return seeded(seed + 5 + k, lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
            in_channels=2 * z_dim + 4 if two_channels else z_dim, out_channels=z_dim, text_dim=text_cfg.d_model,
            freq_dim=32, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            image_dim=clip_dim if clip else None, pos_embed_seq_len=2 * clip_tokens if variant == "flf2v" else None,
            rope_max_seq_len=32,
        ))  # fmt: skip

    if scheduler not in ("euler", "unipc"):
        raise ValueError(f"scheduler must be 'euler' or 'unipc', got {scheduler!r}")
    sampler = (FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=scheduler_shift) if scheduler == "euler"
               else UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                            use_flow_sigmas=True, flow_shift=scheduler_shift))  # fmt: skip
    common = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sampler,
                  transformer=transformer(0))  # fmt: skip
    if variant == "t2v":
        pipe = WanPipeline(**common)
    elif variant == "ti2v":
        pipe = WanPipeline(**common, expand_timesteps=True)
    elif variant == "t2v_a14b":
        pipe = WanPipeline(**common, transformer_2=transformer(1), boundary_ratio=boundary_ratio)
    elif variant == "a14b":
        pipe = WanImageToVideoPipeline(**common, transformer_2=transformer(1), boundary_ratio=boundary_ratio)
    else:
        pipe = WanImageToVideoPipeline(**common, image_encoder=image_encoder, image_processor=image_processor)
    pipe.save_pretrained(path)
    return path


def moving_square(colour: tuple[int, int, int], direction: int, frames: int, size: int = 32) -> np.ndarray:
    """uint8 (F, H, W, 3): a square of ``colour`` crossing a grey canvas left to right (``direction`` 1) or back."""
    clip = np.full((frames, size, size, 3), 96, np.uint8)
    side = size // 4
    for k in range(frames):
        x = int(round((size - side) * (k / max(frames - 1, 1))))
        x = x if direction > 0 else size - side - x
        clip[k, size // 2 - side // 2 : size // 2 + side // 2, x : x + side] = colour
    return clip


COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}


def write_moving_squares(
    root: str | Path, n: int = 4, *, i2v: bool = False, preference: bool = False, frames: int = 12, fps: float = 8.0
) -> Path:
    """A V2 dataset folder of ``n`` (>= 2) moving squares: ``train.jsonl``, MP4 targets with ``fps`` under ``videos/``,
    ``test.txt`` prompts; the clips are 12 frames at 8 fps by default (longer than a 9-frame training clip), clip ``i``
    a red / blue / green square moving right (even ``i``) or left, as its caption says.

    Args:
        root: the dataset folder (created).
        n: training records.
        i2v: each record binds its clip's first frame (a PNG under ``images/``) to the ``first_frame`` slot, and the
            evaluation prompts are ``test.jsonl`` rows with an ``image``.
        preference: records are preference pairs (offline DPO): chosen moves as the caption says, rejected the other
            way (same colour and first frame).
        frames: frames per clip.
        fps: the clips' frame rate (written in the file and in each record's ``fps``).
    """
    from PIL import Image

    if n < 2:
        raise ValueError(f"write_moving_squares needs n >= 2, got {n}")
    root = Path(root)
    lines, prompts = [], []
    for i in range(n):
        name = list(COLOURS)[i % len(COLOURS)]
        direction = 1 if i % 2 == 0 else -1
        clip = moving_square(COLOURS[name], direction, frames)
        video = {"type": "video", "path": f"videos/{i:03d}.mp4", "fps": fps}
        write_mp4(root / video["path"], clip, fps)
        prompts.append(f"a {name} square moving {'right' if direction > 0 else 'left'}")
        media = []
        if i2v:
            (root / "images").mkdir(parents=True, exist_ok=True)
            Image.fromarray(clip[0]).save(root / "images" / f"{i:03d}.png")
            media = [{"type": "image", "path": f"images/{i:03d}.png", "slot": "first_frame"}]
        if preference:
            reverse = {"type": "video", "path": f"videos/{i:03d}_reverse.mp4", "fps": fps}
            write_mp4(root / reverse["path"], moving_square(COLOURS[name], -direction, frames), fps)
            supervision = {"type": "preference", "chosen": {"media": [video]}, "rejected": {"media": [reverse]}}
        else:
            supervision = {"type": "demonstration", "target": {"media": [video]}}
        record = {"schema_version": 2, "input": {"prompt": prompts[-1], "media": media}, "supervision": supervision,
                  "metadata": {"direction": "right" if direction > 0 else "left", "colour": name}}  # fmt: skip
        lines.append(json.dumps(record))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    if i2v:  # evaluation binds a first frame too: legacy prompt + image rows (the first two clips')
        rows = [{"prompt": p, "image": f"{k:03d}.png"} for k, p in enumerate(prompts[:2])]
        (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        (root / "test.txt").write_text("\n".join(prompts[:2]) + "\n")
    return root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_wan.testing", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--variant", default="t2v", choices=VARIANTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", action="store_true", help="write a moving-squares MP4 dataset to --out instead")
    p.add_argument("--i2v", action="store_true", help="with --dataset: bind each clip's first frame (first_frame)")
    p.add_argument("--preference", action="store_true", help="with --dataset: preference pairs (reverse motion)")
    p.add_argument("--n", type=int, default=16, help="with --dataset: number of clips")
    a = p.parse_args(argv)
    if a.dataset:
        out = write_moving_squares(a.out, a.n, i2v=a.i2v, preference=a.preference)
        print(f"wrote {a.n} moving-square clips to {out}")
        return
    out = build_tiny_wan(a.out, variant=a.variant, seed=a.seed)
    print(f"wrote tiny Wan {a.variant} checkpoint to {out}")


if __name__ == "__main__":
    main()
