"""Tiny, random-initialised LTX-2 checkpoints in the diffusers layout, built offline in seconds.

:func:`build_tiny_ltx2` writes every component of diffusers' ``LTX2Pipeline`` (``variant="t2av"``) or
``LTX2ImageToVideoPipeline`` (``"i2av"``): ``transformer/`` (``LTX2VideoTransformer3DModel``), ``vae/``
(``AutoencoderKLLTX2Video``), ``audio_vae/`` (``AutoencoderKLLTX2Audio``), ``vocoder/`` (``LTX2Vocoder``),
``connectors/`` (``LTX2TextConnectors``), ``text_encoder/`` (a tiny ``Gemma3ForConditionalGeneration``),
``tokenizer/`` (:func:`ff_core.testing.tiny.build_gemma_tokenizer`), ``scheduler/`` and ``model_index.json``, with
``save_pretrained``, so the folder loads both through the ff adapters and through diffusers.

Sizes (every number is the real model's structure scaled down):

* video VAE: patch 2 and two down blocks (``spatial``, ``spatiotemporal``): 8x spatial, 2x temporal compression,
  4 latent channels, non-trivial ``latents_mean`` / ``latents_std`` (and, for ``t2av``, ``scaling_factor`` 0.8) so
  normalisation is exercised. ``AutoencoderKLLTX2Video`` derives its ratios as ``patch * 2 ** (scaled blocks)`` for
  both axes, which is wrong here (it would say 4x temporal): :func:`video_vae_compression` derives them from the block
  types and the factory passes them explicitly (``spatial_compression_ratio`` / ``temporal_compression_ratio``,
  stored in ``vae/config.json``), so diffusers' pipeline and ff agree on the latent grid.
* audio VAE: stereo 16 kHz, mel hop 160, 16 mel bins, two down levels (4x on time and mel, as the real one),
  2 latent channels: a packed audio token has ``2 * 16 / 4 = 8`` features, equal to ``base_channels`` (the length
  of its ``latents_mean`` / ``latents_std``, which normalise packed tokens).
* vocoder: upsampling ``4 * 4 * 10 = 160`` = the mel hop, so it writes 16 kHz audio (the real one upsamples to 24 kHz).
* text: a 2-layer Gemma-3 with a 32-wide hidden state (and a 1-layer SigLIP vision tower, never used), the
  connectors 4 heads x 8 with 8 learnable registers (the tokenizer's ``model_max_length`` 16 is a multiple);
  the transformer 1 block, video 2 heads x 8, audio 2 heads x 4.

9 frames at 32x32 are 5 latent frames of 4x4 (80 video tokens); at 8 fps that is 1.125 s, 28 audio tokens.

:func:`write_av_clips` writes a tiny V2 dataset of MP4 + WAV pairs (a coloured square on grey, a sine tone) whose
caption names the colour and the pitch.

CLI: ``python -m ff_ltx2.testing --out DIR [--variant t2av]``; ``--dataset [--i2av] [--preference] [--n 8]``
writes the dataset instead (``--dataset --i2av --prompts``: :func:`write_av_prompts`, prompt + first-frame rows).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ff_core.testing import clips
from ff_core.testing.tiny import VIDEO_WORDS, build_gemma_tokenizer, seeded
from ff_ltx2.adapter import video_vae_compression

VARIANTS: tuple[str, ...] = ("t2av", "i2av")

AV_WORDS: tuple[str, ...] = (*VIDEO_WORDS, "low", "high", "tone", "pitch", "sound", "square", "humming", "beep")
"""The audio+video datasets' vocabulary: the video words plus pitches (:func:`write_av_clips`)."""

PITCHES: dict[str, float] = {"low": 220.0, "high": 880.0}
COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}


def build_tiny_ltx2(
    path: str | Path,
    *,
    variant: str = "t2av",
    seed: int = 0,
    text_max_length: int = 16,
    num_layers: int = 1,
    scheduler_kwargs: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random-initialised LTX-2 checkpoint of ``variant`` to ``path`` and return it.

    Args:
        path: output folder (created; existing component folders are overwritten).
        variant: ``t2av`` (``LTX2Pipeline``) or ``i2av`` (``LTX2ImageToVideoPipeline``); the weights are the same.
        seed: seed of every random initialisation (components get ``seed + k``).
        text_max_length: ``model_max_length`` of the tokenizer (a multiple of the connectors' 8 registers).
        num_layers: transformer blocks.
        scheduler_kwargs: ``FlowMatchEulerDiscreteScheduler`` arguments over the released LTX-2 scheduler's
            (dynamic shifting, ``base_shift`` 0.95, ``max_shift`` 2.05, ``base_image_seq_len`` 1024,
            ``max_image_seq_len`` 4096, exponential time shift).
    """
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2ImageToVideoPipeline,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if text_max_length % 8:
        raise ValueError(f"text_max_length must be a multiple of the connectors' 8 registers, got {text_max_length}")
    path = Path(path)
    tokenizer = build_gemma_tokenizer(text_max_length, AV_WORDS)
    hidden, gemma_layers = 32, 2
    text_cfg = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=64,
                         num_hidden_layers=gemma_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         query_pre_attn_scalar=16, sliding_window=16, max_position_embeddings=64),
        vision_config=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=len(tokenizer), eoi_token_index=len(tokenizer) + 1,
        image_token_index=len(tokenizer) + 2,
    )  # fmt: skip
    text_encoder = seeded(seed + 1, lambda: Gemma3ForConditionalGeneration(text_cfg).eval())
    connectors = seeded(seed + 2, lambda: LTX2TextConnectors(
        caption_channels=hidden, text_proj_in_factor=gemma_layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=8, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1, audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False, rope_type="split",
    ))  # fmt: skip
    vae_cfg = dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False, False, False),
        downsample_type=("spatial", "spatiotemporal"), upsample_type=("spatiotemporal", "spatial"),
        upsample_residual=(False, False), upsample_factor=(1, 1), timestep_conditioning=False, patch_size=2,
        patch_size_t=1, encoder_causal=True, decoder_causal=False,
        # diffusers' LTX2ImageToVideoPipeline normalises its condition latent without scaling_factor (its T2V path and
        # decoding use it); the released VAE has 1.0, where both agree. t2av exercises a non-trivial one.
        scaling_factor=0.8 if variant == "t2av" else 1.0,
    )  # fmt: skip
    spatial, temporal = video_vae_compression(vae_cfg)
    vae = seeded(seed + 3, lambda: AutoencoderKLLTX2Video(
        **vae_cfg, spatial_compression_ratio=spatial, temporal_compression_ratio=temporal))
    g = torch.Generator().manual_seed(seed + 4)
    vae.latents_mean.copy_(torch.randn(4, generator=g) * 0.2)
    vae.latents_std.copy_(0.5 + torch.rand(4, generator=g))
    mel_bins, audio_latent_channels = 16, 2
    packed_audio = audio_latent_channels * mel_bins // 4
    audio_vae = seeded(seed + 5, lambda: AutoencoderKLLTX2Audio(
        base_channels=packed_audio, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None,
        in_channels=2, resolution=32, latent_channels=audio_latent_channels, norm_type="pixel",
        causality_axis="height", dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
        is_causal=True, mel_bins=mel_bins,
    ))  # fmt: skip
    audio_vae.latents_mean.copy_(torch.randn(packed_audio, generator=g) * 0.2)
    audio_vae.latents_std.copy_(0.5 + torch.rand(packed_audio, generator=g))
    vocoder = seeded(seed + 6, lambda: LTX2Vocoder(
        in_channels=2 * mel_bins, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[8, 8, 20],
        upsample_factors=[4, 4, 10], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    ))  # fmt: skip
    transformer = seeded(seed + 7, lambda: LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, vae_scale_factors=(temporal, spatial, spatial), audio_in_channels=packed_audio,
        audio_out_channels=packed_audio, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=num_layers, qk_norm="rms_norm_across_heads", caption_channels=hidden,
        rope_double_precision=False, rope_type="split", audio_sampling_rate=16000, audio_hop_length=160,
    ))  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(**{
        "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.95,
        "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096, "time_shift_type": "exponential",
        **(scheduler_kwargs or {})})  # fmt: skip
    pipeline_cls = LTX2Pipeline if variant == "t2av" else LTX2ImageToVideoPipeline
    pipe = pipeline_cls(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)
    pipe.save_pretrained(path)
    return path


def av_clip(colour: str, pitch: str, frames: int, fps: float, rate: int, size: int = 32,
            channels: int = 1) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """:func:`ff_core.testing.clips.av_clip` of a :data:`COLOURS` square and a :data:`PITCHES` tone."""
    return clips.av_clip(COLOURS[colour], PITCHES[pitch], frames, fps, rate, size=size, channels=channels)


def write_av_clips(
    root: str | Path,
    n: int = 4,
    *,
    i2av: bool = False,
    preference: bool = False,
    frames: int = 12,
    fps: float = 8.0,
    rate: int = 22050,
    channels: int = 1,
    height: int = 32,
    width: int = 32,
    audio_seconds: float | None = None,
) -> Path:
    """A V2 dataset folder of ``n`` (>= 2) audio+video clips: ``train.jsonl``, MP4 targets with ``fps`` under
    ``videos/``, WAV targets with ``sample_rate`` under ``audios/`` (each target an ordered (video, audio) pair),
    ``test.txt`` prompts. Clip ``i`` is a red / blue / green square with a low / high tone, as its caption says;
    12 frames at 8 fps (1.5 s, longer than a 9-frame training clip), audio at 22.05 kHz mono (so the codec resamples
    and converts channels).

    Args:
        root: the dataset folder (created).
        n: training records.
        i2av: each record binds its clip's first frame (``images/``) to the ``first_frame`` slot; evaluation prompts
            are ``test.jsonl`` rows with an ``image``.
        preference: records are preference pairs (offline DPO): chosen sounds as the caption says, rejected the
            other pitch (same colour and first frame).
        frames: frames per clip.
        fps: the clips' frame rate (written in the file and in each record's ``fps``).
        rate: the WAV files' sample rate (and each record's ``sample_rate``).
        channels: the WAV files' channel count.
        height: frame rows (the square is drawn on a ``max(height, width)`` canvas, centre-cropped to this).
        width: frame columns.
        audio_seconds: each WAV's length (default: the clip's ``frames / fps``).
    """
    from PIL import Image

    if n < 2:
        raise ValueError(f"write_av_clips needs n >= 2, got {n}")
    root = Path(root)
    lines, prompts = [], []
    pitches = list(PITCHES)

    def pair(stem: str, colour: str, pitch: str) -> list[dict[str, Any]]:
        side = max(height, width)
        clip, tone = av_clip(colour, pitch, frames, fps, rate, size=side, channels=channels)
        top, left = (side - height) // 2, (side - width) // 2
        clip = np.ascontiguousarray(clip[:, top : top + height, left : left + width])
        if audio_seconds is not None:
            tone = av_clip(colour, pitch, 1, 1 / audio_seconds, rate, channels=channels)[1]
        return clips.write_av_pair(root, stem, clip, tone, fps, rate)

    for i in range(n):
        colour, pitch = list(COLOURS)[i % len(COLOURS)], pitches[i % len(pitches)]
        prompts.append(f"a {colour} square with a {pitch} tone")
        target = pair(f"{i:03d}", colour, pitch)
        media = []
        if i2av:
            (root / "images").mkdir(parents=True, exist_ok=True)
            Image.fromarray(av_clip(colour, pitch, 1, fps, rate)[0][0]).save(root / "images" / f"{i:03d}.png")
            media = [{"type": "image", "path": f"images/{i:03d}.png", "slot": "first_frame"}]
        if preference:
            other = pitches[(i + 1) % len(pitches)]
            rejected = pair(f"{i:03d}_rejected", colour, other)
            supervision = {"type": "preference", "chosen": {"media": target}, "rejected": {"media": rejected}}
        else:
            supervision = {"type": "demonstration", "target": {"media": target}}
        record = {"schema_version": 2, "input": {"prompt": prompts[-1], "media": media}, "supervision": supervision,
                  "metadata": {"colour": colour, "pitch": pitch}}  # fmt: skip
        lines.append(json.dumps(record))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    if i2av:  # evaluation binds a first frame too: legacy prompt + image rows (the first two clips')
        rows = [{"prompt": p, "image": f"{k:03d}.png"} for k, p in enumerate(prompts[:2])]
        (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        (root / "test.txt").write_text("\n".join(prompts[:2]) + "\n")
    return root


def write_av_prompts(root: str | Path, n: int = 4) -> Path:
    """A prompt dataset for ``ltx2_i2av`` rollouts (GRPO) and evaluation: ``train.jsonl`` / ``test.jsonl`` rows
    ``{"prompt", "image"}`` (the legacy image column binds the ``first_frame`` slot), first frames under ``images/``.

    Args:
        root: the dataset folder (created).
        n: training rows (evaluation: the first two).
    """
    from PIL import Image

    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour, pitch = list(COLOURS)[i % len(COLOURS)], list(PITCHES)[i % len(PITCHES)]
        Image.fromarray(av_clip(colour, pitch, 1, 8.0, 16000)[0][0]).save(root / "images" / f"{i:03d}.png")
        rows.append({"prompt": f"a {colour} square with a {pitch} tone", "image": f"{i:03d}.png"})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    return root


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_ltx2.testing", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--variant", default="t2av", choices=VARIANTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", action="store_true", help="write an audio+video clip dataset to --out instead")
    p.add_argument("--i2av", action="store_true", help="with --dataset: bind each clip's first frame (first_frame)")
    p.add_argument("--preference", action="store_true", help="with --dataset: preference pairs (the other pitch)")
    p.add_argument("--n", type=int, default=8, help="with --dataset: number of clips")
    p.add_argument("--prompts", action="store_true", help="with --dataset --i2av: prompt + first-frame rows only")
    a = p.parse_args(argv)
    if a.dataset and a.prompts:
        out = write_av_prompts(a.out, a.n)
        print(f"wrote {a.n} prompt + first-frame rows to {out}")
        return
    if a.dataset:
        out = write_av_clips(a.out, a.n, i2av=a.i2av, preference=a.preference)
        print(f"wrote {a.n} audio+video clips to {out}")
        return
    out = build_tiny_ltx2(a.out, variant=a.variant, seed=a.seed)
    print(f"wrote tiny LTX-2 {a.variant} checkpoint to {out}")


if __name__ == "__main__":
    main()
