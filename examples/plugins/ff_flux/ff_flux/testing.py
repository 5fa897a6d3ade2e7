"""A tiny, random-initialised FLUX.1 checkpoint in the diffusers layout, built offline in seconds.

:func:`build_tiny_flux` writes every component of ``FluxPipeline`` (``transformer/``, ``vae/``, ``scheduler/``,
``text_encoder{,_2}/``, ``tokenizer{,_2}/`` and ``model_index.json``) with ``save_pretrained``, so the folder loads
both through :class:`ff_flux.adapter.FluxAdapter` and through diffusers. Tokenizers and the VAE come from the shared
tiny builders (:mod:`ff_core.testing.tiny`). ``guidance_embeds=True`` gives a guidance-distilled, FLUX.1-dev-like
transformer; ``False`` a guidance-free, FLUX.1-schnell-like one. The scheduler is FLUX.1's: dynamic shifting with
its ``base_shift`` / ``max_shift`` and sequence lengths, so the resolution-dependent shift is exercised.

An untrained VAE keeps FLUX.1's released ``shift_factor`` / ``scaling_factor`` (0.1159, 0.3611), so a plugin that
ignores them is caught by parity with the pipeline; with ``vae_train_dir`` the VAE is trained briefly on those images
and both are set from its latent statistics.

CLI: ``python -m ff_flux.testing --out DIR [--schnell] [--vae-train-dir IMAGES] [--image-size 32] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ff_core.testing.tiny import build_clip_tokenizer, build_t5_tokenizer, build_tiny_image_vae, seeded

FLUX_VAE_SHIFT, FLUX_VAE_SCALE = 0.1159, 0.3611
"""black-forest-labs/FLUX.1-dev vae/config.json ``shift_factor`` and ``scaling_factor``."""


def build_tiny_flux(
    path: str | Path,
    *,
    seed: int = 0,
    guidance_embeds: bool = True,
    image_size: int = 32,
    text_max_length: int = 16,
    num_layers: int = 1,
    num_single_layers: int = 1,
    vae_train_dir: str | Path | None = None,
    vae_steps: int = 300,
    vae_cache_dir: str | Path | None = None,
    vae_from: str | Path | None = None,
) -> Path:
    """Write a tiny random-initialised FLUX.1-layout checkpoint to ``path`` and return it.

    Args:
        path: output folder (created; existing component folders are overwritten).
        seed: seed of every random initialisation (and of VAE training).
        guidance_embeds: a guidance-distilled transformer (dev-like) or a guidance-free one (schnell-like).
        image_size: default sample size in pixels (the VAE downsamples by 4, latents pack 2 x 2 into a token).
        text_max_length: ``model_max_length`` of both tokenizers (and CLIP's position table).
        num_layers: double-stream (MMDiT) blocks.
        num_single_layers: single-stream blocks.
        vae_train_dir: folder of images to train the VAE on; ``None``: random, with FLUX.1's shift and scale.
        vae_steps: Adam steps of VAE training.
        vae_cache_dir: where the trained VAE is kept and reused (:func:`ff_core.testing.tiny.build_tiny_image_vae`).
        vae_from: a saved ``AutoencoderKL`` folder to use as the VAE instead (another tiny checkpoint's trained
            ``vae/``: FLUX.1's VAE is the same class as SD3's), so a session trains one tiny VAE for every family.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    path = Path(path)
    tokenizer, tokenizer_2 = build_clip_tokenizer(text_max_length), build_t5_tokenizer(text_max_length)
    clip_cfg = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=text_max_length, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    text_encoder = seeded(seed + 1, lambda: CLIPTextModel(clip_cfg))
    t5_cfg = T5Config(
        vocab_size=len(tokenizer_2), d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    text_encoder_2 = seeded(seed + 2, lambda: T5EncoderModel(t5_cfg))
    if vae_from is not None:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(vae_from)
    else:
        vae = build_tiny_image_vae(seed=seed + 3, image_size=image_size, train_dir=vae_train_dir, steps=vae_steps,
                                   train_seed=seed, cache_dir=vae_cache_dir)  # fmt: skip
    if vae_train_dir is None and vae_from is None:
        vae.register_to_config(shift_factor=FLUX_VAE_SHIFT, scaling_factor=FLUX_VAE_SCALE)
    transformer = seeded(seed + 4, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=num_layers,
        num_single_layers=num_single_layers, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=t5_cfg.d_model, pooled_projection_dim=clip_cfg.hidden_size,
        guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    ))  # fmt: skip
    # FLUX.1's scheduler config: the shift follows the image token count (calculate_shift).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )  # fmt: skip
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)  # fmt: skip
    pipe.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_flux.testing", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--schnell", action="store_true", help="a guidance-free transformer (FLUX.1-schnell-like)")
    p.add_argument("--vae-train-dir", default=None, help="folder of images to train the VAE on")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = build_tiny_flux(a.out, seed=a.seed, guidance_embeds=not a.schnell, image_size=a.image_size,
                          vae_train_dir=a.vae_train_dir)  # fmt: skip
    print(f"wrote tiny FLUX.1 checkpoint to {out} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
