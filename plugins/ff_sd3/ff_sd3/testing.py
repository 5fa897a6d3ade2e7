"""A tiny, random-initialised SD3.5 checkpoint in the diffusers layout, built offline in seconds.

:func:`build_tiny_sd3` writes every component of ``StableDiffusion3Pipeline`` (``transformer/``, ``vae/``,
``scheduler/``, ``text_encoder{,_2,_3}/``, ``tokenizer{,_2,_3}/`` and ``model_index.json``) with
``save_pretrained``, so the folder loads both through :class:`ff_sd3.adapter.SD3Adapter` and through diffusers.
Tokenizers and the VAE come from the shared tiny builders (:mod:`ff_core.testing.tiny`): tokenizers built in code
from the shapes vocabulary, and a random VAE, or, given ``vae_train_dir`` (a folder of images, e.g. the shapes
dataset), one trained briefly for reconstruction with ``shift_factor`` / ``scaling_factor`` set from its latent
statistics, as SD3's (Esser et al. 2024, sec. 5.2).

CLI: ``python -m ff_sd3.testing --out DIR [--vae-train-dir IMAGES] [--image-size 32] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ff_core.testing.tiny import build_clip_tokenizer, build_t5_tokenizer, build_tiny_image_vae, seeded


def build_tiny_sd3(
    path: str | Path,
    *,
    seed: int = 0,
    image_size: int = 32,
    text_max_length: int = 16,
    num_layers: int = 3,
    scheduler_shift: float = 1.0,
    vae_train_dir: str | Path | None = None,
    vae_steps: int = 300,
    vae_batch_size: int = 16,
    vae_lr: float = 4e-3,
    vae_kl_weight: float = 1e-5,
    vae_cache_dir: str | Path | None = None,
    vae_shift_factor: float = 0.0,
    vae_scaling_factor: float = 1.0,
) -> Path:
    """Write a tiny random-initialised SD3.5-layout checkpoint to ``path`` and return it.

    Args:
        path: output folder (created; existing component folders are overwritten).
        seed: seed of every random initialisation (and of VAE training).
        image_size: default sample size in pixels (the VAE downsamples by 4, the transformer patch is 1).
        text_max_length: ``model_max_length`` of all three tokenizers (and CLIP's position table).
        num_layers: joint transformer blocks.
        scheduler_shift: ``FlowMatchEulerDiscreteScheduler`` shift (SD3 uses 3.0 at 1024 px; 1.0 suits 32 px).
        vae_train_dir: folder of images (searched recursively for PNG/JPEG) to train the VAE on; ``None`` keeps
            it random (fast path for unit tests; latents then keep ``shift 0, scale 1``).
        vae_steps: Adam steps of VAE training.
        vae_batch_size: images per VAE training step.
        vae_lr: peak Adam learning rate of VAE training (one-cycle schedule).
        vae_kl_weight: weight of the KL term (per latent element) against the pixel MSE.
        vae_cache_dir: where the trained VAE is kept and reused (:func:`ff_core.testing.tiny.build_tiny_image_vae`).
        vae_shift_factor: the random VAE's ``shift_factor`` (a trained one's is fitted).
        vae_scaling_factor: the random VAE's ``scaling_factor`` (a trained one's is fitted).
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    path = Path(path)
    tokenizer = build_clip_tokenizer(text_max_length)
    tokenizer_3 = build_t5_tokenizer(text_max_length)

    def clip(hidden: int, projection: int) -> CLIPTextModelWithProjection:
        cfg = CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=text_max_length, projection_dim=projection,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        return CLIPTextModelWithProjection(cfg)

    text_encoder = seeded(seed + 1, lambda: clip(32, 32))  # CLIP-L stand-in
    text_encoder_2 = seeded(seed + 2, lambda: clip(32, 32))  # CLIP-G stand-in
    t5_cfg = T5Config(
        vocab_size=len(tokenizer_3), d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    text_encoder_3 = seeded(seed + 3, lambda: T5EncoderModel(t5_cfg))
    vae = build_tiny_image_vae(
        seed=seed + 4, image_size=image_size, train_dir=vae_train_dir, steps=vae_steps, batch_size=vae_batch_size,
        lr=vae_lr, kl_weight=vae_kl_weight, train_seed=seed, cache_dir=vae_cache_dir, shift_factor=vae_shift_factor,
        scaling_factor=vae_scaling_factor,
    )  # fmt: skip
    latent_size = image_size // 4
    transformer = seeded(seed + 5, lambda: SD3Transformer2DModel(
        sample_size=latent_size, patch_size=1, in_channels=4, out_channels=4, num_layers=num_layers,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=t5_cfg.d_model, caption_projection_dim=64,
        pooled_projection_dim=text_encoder.config.projection_dim + text_encoder_2.config.projection_dim,
        pos_embed_max_size=max(32, latent_size), qk_norm="rms_norm",  # SD3.5 normalises q and k
    ))  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=scheduler_shift)

    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=build_clip_tokenizer(text_max_length),
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )  # fmt: skip
    pipe.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_sd3.testing", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--vae-train-dir", default=None, help="folder of images to train the VAE on")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-steps", type=int, default=300)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = build_tiny_sd3(
        a.out, seed=a.seed, image_size=a.image_size, vae_train_dir=a.vae_train_dir, vae_steps=a.vae_steps
    )
    vae_cfg = json.loads((out / "vae" / "config.json").read_text())
    print(
        f"wrote tiny SD3.5 checkpoint to {out} in {time.perf_counter() - t0:.1f}s "
        f"(vae shift_factor={vae_cfg['shift_factor']:.4f}, scaling_factor={vae_cfg['scaling_factor']:.4f})"
    )


if __name__ == "__main__":
    main()
