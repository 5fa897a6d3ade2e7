"""The video demo's base checkpoint: a tiny Wan T2V whose VAE is trained to reconstruct the moving-shapes clips.

A random VAE decoder does not invert its encoder, so a demo model that learns the motion in latent space would still
decode noise. :func:`build_demo_base` writes every component of diffusers' ``WanPipeline`` (``transformer/``,
``vae/``, ``text_encoder/`` (UMT5), ``tokenizer/``, ``scheduler/``, ``model_index.json``) with ``save_pretrained``,
after training the VAE briefly on the clips of a dataset folder (:mod:`ff_core.testing.moving_shapes`) and setting
its ``latents_mean`` / ``latents_std`` to the per-channel statistics of the posterior samples, the normalisation
``WanPipeline`` applies (``(z - latents_mean) / latents_std``), so the transformer sees zero-mean, unit-variance
latents as it does with the released Wan checkpoints.

Sizes are chosen for 2 CPU cores: 4x spatial and 4x temporal compression (9 frames of 32x32 become 3 latent frames
of 8x8; ``(F - 1) % 4 == 0`` as for every Wan VAE), and a 2-layer transformer of ~0.1M parameters.

CLI: ``python -m ff_wan.demo_base --out DIR --clips DATASET_DIR [--vae-steps 400] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import Tensor


def load_clips(folder: str | Path, frames: int) -> Tensor:
    """The first ``frames`` frames of every MP4 under ``folder`` (sorted), as float (N, 3, F, H, W) in [-1, 1]."""
    from ff_core.data.media import decode_video

    files = sorted(Path(folder).rglob("*.mp4"))
    if not files:
        raise FileNotFoundError(f"clips={str(folder)!r} holds no .mp4 files")
    clips = []
    for f in files:
        video = decode_video(f).frames[:frames]
        if video.shape[0] < frames:
            raise ValueError(f"{f}: {video.shape[0]} frames, fewer than the {frames} the demo VAE is trained on")
        clips.append(video.permute(3, 0, 1, 2).float() / 127.5 - 1)
    return torch.stack(clips)


def decode_unclamped(vae, z: Tensor) -> Tensor:
    """``vae.decode(z)`` without its final clamp to [-1, 1], for training.

    ``AutoencoderKLWan._decode`` clamps its output; on these mostly black clips (target -1) a fresh decoder soon
    overshoots below -1 everywhere, the clamp zeroes every gradient and training stalls at the background's error.
    Same frame-by-frame causal loop as diffusers' ``_decode`` (latent frame 0 is the first chunk).
    """
    vae.clear_cache()
    h = vae.post_quant_conv(z)
    out = []
    for i in range(h.shape[2]):
        vae._conv_idx = [0]
        out.append(vae.decoder(h[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                               first_chunk=i == 0))  # fmt: skip
    vae.clear_cache()
    return torch.cat(out, 2)


def train_vae(vae, clips: Tensor, *, steps: int, batch_size: int, lr: float, kl_weight: float, seed: int) -> float:
    """Train ``vae`` in place: pixel MSE of the (unclamped) decoded posterior sample + ``kl_weight`` * KL per latent
    element, Adam with a one-cycle schedule; returns the last loss."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the posterior samples with the global generator
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    vae.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x = clips[torch.randint(len(clips), (min(batch_size, len(clips)),), generator=g)]
        posterior = vae.encode(x).latent_dist
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = torch.nn.functional.mse_loss(decode_unclamped(vae, posterior.sample()), x) + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    vae.eval()
    return float(loss.detach())


@torch.no_grad()
def latent_statistics(vae, clips: Tensor) -> tuple[list[float], list[float]]:
    """Per-channel ``(latents_mean, latents_std)`` of posterior samples of ``clips`` (WanPipeline's normalisation)."""
    torch.manual_seed(0)
    z = torch.cat([vae.encode(clips[i : i + 32]).latent_dist.sample() for i in range(0, len(clips), 32)])
    dims = (0, 2, 3, 4)
    return z.mean(dims).tolist(), z.std(dims).tolist()


def build_demo_base(
    path: str | Path,
    clips: str | Path,
    *,
    seed: int = 0,
    frames: int = 9,
    text_max_length: int = 16,
    z_dim: int = 8,
    vae_base_dim: int = 16,
    vae_steps: int = 400,
    vae_batch_size: int = 8,
    vae_lr: float = 8e-3,
    vae_kl_weight: float = 1e-5,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
) -> Path:
    """Write the demo's tiny Wan T2V checkpoint (diffusers ``WanPipeline`` layout) to ``path`` and return it.

    Args:
        path: output folder (created; existing component folders are overwritten).
        clips: folder searched recursively for the MP4 clips to train the VAE on (the moving-shapes dataset).
        seed: seed of every random initialisation and of VAE training.
        frames: frames per clip the VAE trains on ((F - 1) % 4 == 0).
        text_max_length: the tokenizer's ``model_max_length`` (the pipeline's ``max_sequence_length`` for it).
        z_dim: latent channels.
        vae_base_dim: VAE channels at every level.
        vae_steps: Adam steps of VAE training.
        vae_batch_size: clips per VAE training step.
        vae_lr: peak Adam learning rate of VAE training (one-cycle schedule).
        vae_kl_weight: weight of the KL term (per latent element) against the pixel MSE.
        num_layers: transformer blocks.
        num_attention_heads: transformer attention heads.
        attention_head_dim: channels per head (split into the 3D rotary embedding's t/h/w parts).
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from ff_wan.testing import build_umt5_tokenizer  # the tiny factory's: every caption word is one token

    if (frames - 1) % 4:
        raise ValueError(f"frames={frames}: Wan VAEs need (frames - 1) % 4 == 0")
    tokenizer = build_umt5_tokenizer(text_max_length)
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))  # fmt: skip
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(
        base_dim=vae_base_dim, z_dim=z_dim, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[True, True],
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim, scale_factor_spatial=4, scale_factor_temporal=4,
    )  # fmt: skip
    torch.manual_seed(seed + 3)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
        in_channels=z_dim, out_channels=z_dim, text_dim=text_encoder.config.d_model, freq_dim=32,
        ffn_dim=2 * num_attention_heads * attention_head_dim, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    data = load_clips(clips, frames)
    train_vae(vae, data, steps=vae_steps, batch_size=vae_batch_size, lr=vae_lr, kl_weight=vae_kl_weight, seed=seed)
    mean, std = latent_statistics(vae, data)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    # shift 1: sigmas as sampled, no resolution shift at 32 px (Wan's 3.0-5.0 are for 480-720 p).
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)  # fmt: skip
    pipe.save_pretrained(path)
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_wan.demo_base", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--clips", required=True, help="folder of MP4 clips to train the VAE on")
    p.add_argument("--vae-steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = build_demo_base(a.out, a.clips, seed=a.seed, vae_steps=a.vae_steps)
    print(f"wrote the video demo's tiny Wan T2V checkpoint to {out} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
