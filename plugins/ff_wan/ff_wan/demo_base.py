"""The video demo's base checkpoint: a tiny Wan T2V whose VAE is trained to reconstruct the moving-shapes clips.

A random VAE decoder does not invert its encoder, so a demo model that learns the motion in latent space would still
decode noise. :func:`build_demo_base` writes every component of diffusers' ``WanPipeline`` (``transformer/``,
``vae/``, ``text_encoder/`` (UMT5), ``tokenizer/``, ``scheduler/``, ``model_index.json``) with ``save_pretrained``,
after training the VAE briefly on the clips of a dataset folder (:mod:`ff_core.testing.moving_shapes`) and setting
its ``latents_mean`` / ``latents_std`` to the per-channel statistics of the posterior samples, the normalisation
``WanPipeline`` applies (``(z - latents_mean) / latents_std``), so the transformer sees zero-mean, unit-variance
latents as it does with the released Wan checkpoints.

Sizes are chosen for 2 CPU cores: 4x spatial and 4x temporal compression (9 frames of 32x32 become 3 latent frames
of 8x8; ``(F - 1) % 4 == 0`` as for every Wan VAE), and a 2-layer transformer of 143k parameters.

CLI: ``python -m ff_wan.demo_base --out DIR --clips DATASET_DIR [--vae-steps 800] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import Tensor


def load_clips(dataset_dir: str | Path, frames: int) -> tuple[Tensor, list[str]]:
    """The first ``frames`` frames of each training record's target video of a moving-shapes dataset folder
    (``train.jsonl``), as float (N, 3, F, H, W) in [-1, 1], with the records' prompts."""
    import json

    from ff_core.data.media.decode import decode_video

    root = Path(dataset_dir)
    records = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines() if line.strip()]
    clips = []
    for line, record in enumerate(records, 1):
        video = decode_video(root / record["supervision"]["target"]["media"][0]["path"],
                             referenced_by=(root / "train.jsonl", line), field="supervision.target.media[0].path")
        if video.frames.shape[0] < frames:
            raise ValueError(f"{root / 'train.jsonl'}:{line}: {video.frames.shape[0]} frames, fewer than the "
                             f"{frames} the demo VAE is trained on")
        clips.append(video.frames[:frames].permute(3, 0, 1, 2).float() / 127.5 - 1)
    return torch.stack(clips), [r["input"]["prompt"] for r in records]


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


def shape_weights(x: Tensor, weight: float) -> Tensor:
    """Per-pixel loss weights for clips ``x`` (N, 3, F, H, W) in [-1, 1]: ``1 + weight`` on the shape's saturated
    pixels (:func:`ff_core.testing.moving_shapes.saturated_mask`), 1 elsewhere. The shape covers ~10 % of a frame:
    unweighted, a decoder that draws only the background is already at a low error and learns the shape slowly."""
    from ff_core.testing.moving_shapes import saturated_mask

    mask = saturated_mask(((x + 1) / 2).movedim(1, -1))  # (N, F, H, W)
    return (1 + weight * mask.float()).unsqueeze(1)


def train_vae(vae, clips: Tensor, *, steps: int, batch_size: int, lr: float, kl_weight: float, seed: int,
              shape_weight: float = 9.0, log_every: int = 0) -> float:
    """Train ``vae`` in place: pixel MSE of the (unclamped) decoded posterior sample, weighted by
    :func:`shape_weights`, + ``kl_weight`` * KL per latent element, Adam with a one-cycle schedule; returns the last
    loss (printed every ``log_every`` steps when > 0)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the posterior samples with the global generator
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    vae.train()
    loss = torch.tensor(float("nan"))
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = clips[torch.randint(len(clips), (min(batch_size, len(clips)),), generator=g)]
        posterior = vae.encode(x).latent_dist
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        error = (decode_unclamped(vae, posterior.sample()) - x).square() * shape_weights(x, shape_weight)
        loss = error.mean() + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if log_every and step % log_every == 0:
            print(f"vae step {step}/{steps}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    vae.eval()
    return float(loss.detach())


@torch.no_grad()
def reconstruction_accuracy(vae, clips: Tensor, prompts: list[str]):
    """:func:`ff_core.testing.moving_shapes.motion_accuracy` of the VAE's reconstructions (posterior mode, decoded
    with the pipeline's clamp) of ``clips``: the ceiling of what the demo can measure through this VAE."""
    from ff_core.testing.moving_shapes import motion_accuracy

    out = []
    for i in range(0, len(clips), 32):
        rec = vae.decode(vae.encode(clips[i : i + 32]).latent_dist.mode()).sample
        out += list(((rec + 1) * 127.5).round().to(torch.uint8).transpose(1, 2))  # (T, 3, H, W) each
    return motion_accuracy(out, prompts)


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
    spatial_downsamples: int = 2,
    temporal_downsamples: int = 2,
    vae_steps: int = 800,
    vae_batch_size: int = 4,
    vae_train_frames: int = 9,
    vae_lr: float = 5e-3,
    vae_kl_weight: float = 1e-5,
    vae_logvar_init: float | None = -6.0,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    attention_head_dim: int = 16,
    patch_size: int = 2,
    log_every: int = 0,
) -> Path:
    """Write the demo's tiny Wan T2V checkpoint (diffusers ``WanPipeline`` layout) to ``path`` and return it.

    Args:
        path: output folder (created; existing component folders are overwritten).
        clips: the moving-shapes dataset folder whose training clips the VAE trains on.
        seed: seed of every random initialisation and of VAE training.
        frames: frames per clip the VAE trains on ((F - 1) % 4 == 0).
        text_max_length: the tokenizer's ``model_max_length`` (the pipeline's ``max_sequence_length`` for it).
        z_dim: latent channels.
        vae_base_dim: VAE channels at every level.
        spatial_downsamples: the VAE's 2x spatial downsampling stages (the released Wan VAEs: 3, i.e. 8x).
        temporal_downsamples: how many of those also halve time (released: 2, i.e. 4x; at most
            ``spatial_downsamples``).
        vae_steps: Adam steps of VAE training.
        vae_batch_size: clips per VAE training step.
        vae_train_frames: the first frames of each clip the VAE trains on. The Wan VAE is causal and runs chunk by
            chunk (the first frame, then 4 frames at a time, with a feature cache), but 5 frames do not suffice for
            9: trained on 5, the third latent frame (a chunk after a chunk) decoded as a magenta haze (measured).
        vae_lr: peak Adam learning rate of VAE training (one-cycle schedule).
        vae_kl_weight: weight of the KL term (per latent element) against the pixel MSE.
        vae_logvar_init: initial bias of the posterior's log-variance channels (``None``: diffusers' init, a
            posterior std near 1). -6 starts the posterior narrow (std e^-3 = 0.05), as tensor-parquet training assumes
            of the released VAEs (docs/datasets.md, "Which latents"): from diffusers' init, 800 steps left the std
            at 0.83 against latent means of 1.5, so the decoder learned blurred shapes and the transformer a target
            mostly made of that noise (benchmarks/RESULTS.md, video demo).
        num_layers: transformer blocks.
        num_attention_heads: transformer attention heads.
        attention_head_dim: channels per head (split into the 3D rotary embedding's t/h/w parts).
        patch_size: the transformer's spatial patch (latent pixels per token side).
        log_every: print the VAE loss every this many steps (0: never).
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from ff_core.testing.tiny import VIDEO_WORDS, build_t5_tokenizer  # every caption word is one token

    if (frames - 1) % 4 or (vae_train_frames - 1) % 4 or vae_train_frames > frames:
        raise ValueError(f"frames={frames}, vae_train_frames={vae_train_frames}: Wan VAEs need (F - 1) % 4 == 0, "
                         "and the VAE trains on at most the clips' frames")
    if not 0 <= temporal_downsamples <= spatial_downsamples:
        raise ValueError(f"temporal_downsamples={temporal_downsamples}: 0 to spatial_downsamples "
                         f"({spatial_downsamples}); the Wan VAE halves time only inside a spatial downsampling")
    tokenizer = build_t5_tokenizer(text_max_length, VIDEO_WORDS)
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))  # fmt: skip
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(
        base_dim=vae_base_dim, z_dim=z_dim, dim_mult=[1] * (spatial_downsamples + 1), num_res_blocks=1,
        temperal_downsample=[i < temporal_downsamples for i in range(spatial_downsamples)],
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim, scale_factor_spatial=2**spatial_downsamples,
        scale_factor_temporal=2**temporal_downsamples,
    )  # fmt: skip
    if vae_logvar_init is not None:  # the posterior is (mean, logvar) = quant_conv's output channels split in two
        with torch.no_grad():
            vae.quant_conv.bias[z_dim:] = vae_logvar_init
    torch.manual_seed(seed + 3)
    transformer = WanTransformer3DModel(
        patch_size=(1, patch_size, patch_size), num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=z_dim, out_channels=z_dim, text_dim=text_encoder.config.d_model, freq_dim=32,
        ffn_dim=2 * num_attention_heads * attention_head_dim, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    data, prompts = load_clips(clips, frames)
    train_vae(vae, data[:, :, :vae_train_frames], steps=vae_steps, batch_size=vae_batch_size, lr=vae_lr,
              kl_weight=vae_kl_weight, seed=seed, log_every=log_every)
    recon = reconstruction_accuracy(vae, data, prompts)
    print(f"VAE reconstructions of the {recon.n} clips: direction {recon.direction:.1%}, colour {recon.colour:.1%}")
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
    p.add_argument("--clips", required=True, help="moving-shapes dataset folder (train.jsonl) to train the VAE on")
    p.add_argument("--vae-steps", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = build_demo_base(a.out, a.clips, seed=a.seed, vae_steps=a.vae_steps, log_every=a.log_every)
    print(f"wrote the video demo's tiny Wan T2V checkpoint to {out} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
