"""Tiny, random-initialised MiniMax H3 checkpoints in the diffusers modular layout, built offline in seconds.

:func:`build_tiny_minimax` writes every component ``MiniMaxH3ModularPipeline`` loads, each with ``save_pretrained``:
``transformer/`` (``MiniMaxH3Transformer3DModel``; the Ref2VA partition is ``transformer_ref/``), ``vae/``
(``AutoencoderKLMiniMaxH3``), ``audio_vae/`` (``AutoencoderKLMiniMaxH3Audio``), ``scheduler/`` and
``audio_scheduler/`` (``MiniMaxH3Scheduler``, shift 12 and 3 as released), ``text_encoder/`` (a tiny
``Qwen3VLForConditionalGeneration``), ``tokenizer/`` (:func:`ff_core.testing.tiny.build_qwen2_tokenizer`),
``processor/`` (``Qwen3VLProcessor``) and ``model_index.json``, so the folder loads both through the ff adapters and
through ``ModularPipeline.from_pretrained``.

Sizes (every number is the real model's structure scaled down; what the pipeline hard-codes is kept):

* video VAE: two down blocks, 4x spatial and 4x temporal compression, ``clip_length`` 17 and ``token_drop`` 3 as the
  released one, so ``17 n + 5`` frames are ``5 n + 2`` latent frames (the pipeline's ``video_latent_num_frames``
  assumes it; with ``token_drop`` 0 a single 17-frame clip round-trips instead, but 124 frames would not give 37
  latent frames). 4 latent channels with non-trivial ``latents_mean`` / ``latents_std``.
* audio VAE: mono codec at 8 kHz (the lowest rate an MP4's AAC stream takes) with hop 200 (encoder strides
  10 x 5 x 4): 40 latents per second, the rate the pipeline hard-codes (``MINIMAX_H3_AUDIO_LATENTS_PER_SECOND``; the
  released one is 32 kHz with hop 800). 4 latent channels. Each decoder kernel exceeds its upsampling rate by an even
  number (as the released 9 / 5 and 4 / 2), so ``L`` latents decode to exactly ``L * hop`` samples.
* text: Qwen3-VL with 51 decoder layers 16 wide (the pipeline reads ``hidden_states[50]``, so the stack must be
  deeper than 50) and a one-block vision tower; the transformer 1 block of 2 heads x 16, one refiner block.

The smallest clip the pipeline accepts is 124 frames (5 s at 24 fps rounded up to ``17 n + 5``): at 16x16 pixels it is
37 latent frames of 4x4 (148 video rows with the 2x2 patch) and 207 audio latents per stereo channel (414 rows).

:func:`write_av_clips` writes a tiny V2 dataset of MP4 + WAV pairs (a coloured square on grey, a sine tone) whose
caption names the colour and the pitch; :func:`write_prompts` a prompt-only one.

CLI: ``python -m ff_minimax.testing --out DIR [--variant t2va|fl2va|ref2va]``; ``--dataset [--preference]
[--prompts] [--n 8]`` writes a dataset instead.
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
from ff_core.testing.tiny import VIDEO_WORDS, build_qwen2_tokenizer, seeded
from ff_minimax.text import assemble_processor

VARIANTS: tuple[str, ...] = ("t2va", "fl2va", "ref2va")

AV_WORDS: tuple[str, ...] = (*VIDEO_WORDS, "low", "high", "tone", "pitch", "sound", "square", "humming", "beep")
"""The audio+video datasets' vocabulary: the video words plus pitches (:func:`write_av_clips`)."""

PITCHES: dict[str, float] = {"low": 110.0, "high": 440.0}
COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}

TINY_FRAMES, TINY_SIZE, TINY_FPS = 124, 16, 24.0
"""The tiny recipes' clip: the pipeline's smallest (124 frames, 5.17 s at 24 fps) on a 16x16 canvas."""


def build_tiny_minimax(path: str | Path, *, variant: str = "t2va", seed: int = 0, num_layers: int = 1) -> Path:
    """Write a tiny random-initialised MiniMax H3 checkpoint of ``variant`` to ``path`` and return it.

    Args:
        path: output folder (created; existing component folders are overwritten).
        variant: ``t2va`` / ``fl2va`` (the ``transformer/`` partition) or ``ref2va`` (``transformer_ref/``); the
            weights are the same.
        seed: seed of every random initialisation (components get ``seed + k``).
        num_layers: transformer blocks.
    """
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import (
        Qwen2VLImageProcessorPil,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    path = Path(path)
    tokenizer = build_qwen2_tokenizer(64, AV_WORDS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                             "<|vision_end|>")}  # fmt: skip
    hidden = 16
    text_cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32, num_hidden_layers=51,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                           num_position_embeddings=16, deepstack_visual_indexes=[]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    text_encoder = seeded(seed + 1, lambda: Qwen3VLForConditionalGeneration(text_cfg).eval())
    image_processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                                               max_pixels=32 * 32)  # fmt: skip
    processor = assemble_processor(image_processor, tokenizer)  # without torchvision: no video processor
    g = torch.Generator().manual_seed(seed + 2)
    latent_channels, audio_channels = 4, 4
    vae = seeded(seed + 3, lambda: AutoencoderKLMiniMaxH3(
        latent_channels=latent_channels, block_out_channels=(4, 4), layers_per_block=1,
        spatial_downsample_factors=(2, 2), temporal_downsample_factors=(2, 2), norm_num_groups=2,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=1, clip_length=17, token_drop=3,
        latents_mean=tuple((torch.randn(latent_channels, generator=g) * 0.2).tolist()),
        latents_std=tuple((0.5 + torch.rand(latent_channels, generator=g)).tolist()),
    ))  # fmt: skip
    audio_vae = seeded(seed + 4, lambda: AutoencoderKLMiniMaxH3Audio(
        encoder_dim=2, encoder_rates=(10, 5, 4), latent_dim=16, latent_channels=audio_channels,
        num_attention_heads=2, decoder_dim=8, decoder_rates=(5, 5, 8), decoder_kernel_sizes=(9, 9, 16),
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), sampling_rate=8000,
        latents_mean=(torch.randn(audio_channels, generator=g) * 0.2).tolist(),
        latents_std=(0.5 + torch.rand(audio_channels, generator=g)).tolist(),
    ))  # fmt: skip
    transformer = seeded(seed + 5, lambda: MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=num_layers, num_refiner_layers=1,
        ffn_dim=64, in_channels=latent_channels, audio_in_channels=audio_channels, patch_size=(1, 2, 2),
        text_dim=hidden, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2,
    ))  # fmt: skip
    transformer_name = "transformer_ref" if variant == "ref2va" else "transformer"
    components: dict[str, Any] = {
        transformer_name: transformer, "vae": vae, "audio_vae": audio_vae,
        "scheduler": MiniMaxH3Scheduler(shift=12.0), "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
        "text_encoder": text_encoder, "tokenizer": tokenizer, "processor": processor,
    }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": _diffusers_version()}
    modular: dict[str, Any] = {**index, "_blocks_class_name": "MiniMaxH3Blocks"}
    for name, component in components.items():
        if name == "processor":  # its parts: a processor without a video processor cannot save itself whole
            tokenizer.save_pretrained(path / name)
            image_processor.save_pretrained(path / name)
        else:
            component.save_pretrained(path / name)
        library = "transformers" if type(component).__module__.startswith("transformers") else "diffusers"
        index[name] = [library, type(component).__name__]
        # ModularPipeline.from_pretrained reads its loading specs from modular_model_index.json; a component whose
        # folder is present next to the index loads from there (diffusers' _is_local_component).
        spec = {"type_hint": index[name], "pretrained_model_name_or_path": str(path.resolve()), "subfolder": name,
                "variant": None, "revision": None}  # fmt: skip
        modular[name] = [*index[name], spec]
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (path / "modular_model_index.json").write_text(json.dumps(modular, indent=2) + "\n")
    return path


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def av_clip(colour: str, pitch: str, frames: int, fps: float, rate: int, size: int = TINY_SIZE,
            channels: int = 1) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """:func:`ff_core.testing.clips.av_clip` of a :data:`COLOURS` square and a :data:`PITCHES` tone."""
    return clips.av_clip(COLOURS[colour], PITCHES[pitch], frames, fps, rate, size=size, channels=channels)


def write_av_clips(
    root: str | Path,
    n: int = 4,
    *,
    preference: bool = False,
    frames: int = 132,
    fps: float = 24.0,
    rate: int = 11025,
    channels: int = 1,
) -> Path:
    """A V2 dataset folder of ``n`` (>= 2) audio+video clips: ``train.jsonl``, MP4 targets with ``fps`` under
    ``videos/``, WAV targets with ``sample_rate`` under ``audios/`` (each target an ordered (video, audio) pair),
    ``test.txt`` prompts. Clip ``i`` is a red / blue / green square with a low / high tone, as its caption says;
    132 frames at 24 fps (5.5 s, longer than the 124-frame training clip), mono audio at 11.025 kHz (so the codec
    converts it to stereo at the audio VAE's 8 kHz).

    Args:
        root: the dataset folder (created).
        n: training records.
        preference: records are preference pairs (offline DPO): chosen sounds as the caption says, rejected the
            other pitch (same colour).
        frames: frames per clip.
        fps: the clips' frame rate (written in the file and in each record's ``fps``).
        rate: the WAV files' sample rate (and each record's ``sample_rate``).
        channels: the WAV files' channel count.
    """
    if n < 2:
        raise ValueError(f"write_av_clips needs n >= 2, got {n}")
    root = Path(root)
    lines, prompts = [], []
    pitches = list(PITCHES)

    def pair(stem: str, colour: str, pitch: str) -> list[dict[str, Any]]:
        clip, tone = av_clip(colour, pitch, frames, fps, rate, channels=channels)
        return clips.write_av_pair(root, stem, clip, tone, fps, rate)

    for i in range(n):
        colour, pitch = list(COLOURS)[i % len(COLOURS)], pitches[i % len(pitches)]
        prompts.append(f"a {colour} square with a {pitch} tone")
        target = pair(f"{i:03d}", colour, pitch)
        if preference:
            rejected = pair(f"{i:03d}_rejected", colour, pitches[(i + 1) % len(pitches)])
            supervision = {"type": "preference", "chosen": {"media": target}, "rejected": {"media": rejected}}
        else:
            supervision = {"type": "demonstration", "target": {"media": target}}
        record = {"schema_version": 2, "input": {"prompt": prompts[-1], "media": []}, "supervision": supervision,
                  "metadata": {"colour": colour, "pitch": pitch}}  # fmt: skip
        lines.append(json.dumps(record))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "test.txt").write_text("\n".join(prompts[:2]) + "\n")
    return root


def write_prompts(root: str | Path, n: int = 4) -> Path:
    """A prompt-only T2VA dataset (GRPO rollouts, evaluation): ``train.jsonl`` / ``test.jsonl`` rows ``{"prompt"}``.

    Args:
        root: the dataset folder (created).
        n: training rows (evaluation: the first two).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"a {list(COLOURS)[i % len(COLOURS)]} square with a {list(PITCHES)[i % len(PITCHES)]} tone"}
            for i in range(n)]  # fmt: skip
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    return root


KEYFRAME_FORMS: tuple[tuple[str, ...], ...] = (("first_frame",), ("last_frame",), ("first_frame", "last_frame"))
"""The FL2VA record forms the keyframe datasets cycle through: first-only, last-only, first-plus-last."""


def _keyframe(root: Path, rel: str, colour: str, size: int = TINY_SIZE) -> str:
    """A PNG of a ``colour`` square on grey (the clips' look) at ``rel`` under ``root``; returns ``rel``."""
    from PIL import Image

    clip, _ = av_clip(colour, "low", 1, TINY_FPS, 8000, size=size)
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(clip[0]).save(root / rel)
    return rel


def _rewrite(root: Path, edit: Any) -> None:
    """``train.jsonl``'s records passed through ``edit(index, record)``."""
    records = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    (root / "train.jsonl").write_text("".join(json.dumps(edit(i, r)) + "\n" for i, r in enumerate(records)))


def write_keyframe_clips(root: str | Path, n: int = 3, *, preference: bool = False) -> Path:
    """An FL2VA V2 dataset: :func:`write_av_clips`' clips, each record's ``input.media`` a slotted keyframe set cycling
    through :data:`KEYFRAME_FORMS` (first-only, last-only, first-plus-last; PNGs of the clip's square under
    ``conditions/``), and a legacy ``test.jsonl`` evaluation split of ``images`` rows (one image: the first frame; two:
    first then last), paths under the default ``images/`` folder.

    Args:
        root: the dataset folder (created).
        n: training records.
        preference: preference pairs (offline DPO) instead of demonstrations.
    """
    root = write_av_clips(root, n, preference=preference)
    (root / "test.txt").unlink()

    def edit(i: int, record: dict[str, Any]) -> dict[str, Any]:
        colour = record["metadata"]["colour"]
        record["input"]["media"] = [
            {"type": "image", "path": _keyframe(root, f"conditions/{i:03d}_{slot}.png", colour), "slot": slot}
            for slot in KEYFRAME_FORMS[i % len(KEYFRAME_FORMS)]]  # fmt: skip
        return record

    _rewrite(root, edit)
    (root / "test.jsonl").write_text(json.dumps(keyframe_prompt(root, 0)) + "\n")
    return root


def keyframe_prompt(root: Path, i: int) -> dict[str, Any]:
    """A legacy FL2VA generation row (``prompt`` + ordered ``images``, resolved against ``images/``); row ``i`` has one
    keyframe (the first frame) when ``i`` is even, two (first then last) when odd."""
    colour, pitch = list(COLOURS)[i % len(COLOURS)], list(PITCHES)[i % len(PITCHES)]
    names = [_keyframe(root / "images", f"{i:03d}_first.png", colour)]
    if i % 2:
        names.append(_keyframe(root / "images", f"{i:03d}_last.png", colour))
    return {"prompt": f"a {colour} square with a {pitch} tone", "images": names}


def write_keyframe_prompts(root: str | Path, n: int = 2) -> Path:
    """An FL2VA generation dataset (GRPO rollouts, evaluation): legacy ``train.jsonl`` / ``test.jsonl`` rows with one
    or two ordered keyframes (:func:`keyframe_prompt`)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = [keyframe_prompt(root, i) for i in range(n)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return root


REFERENCE_FORMS: tuple[tuple[str, ...], ...] = (("image",), ("image", "audio"), ("audio", "image", "image"))
"""The Ref2VA reference lists the reference datasets cycle through, in order (types; audio never alone)."""


def _references(root: Path, i: int, colour: str, pitch: str, form: tuple[str, ...]) -> list[dict[str, Any]]:
    """Reference files of row ``i`` under ``root/references`` (a ``colour`` square PNG, a 1 s mono ``pitch`` tone WAV
    at 8 kHz) as ordered media objects, paths relative to the dataset folder."""
    out = []
    for k, kind in enumerate(form):
        if kind == "image":
            out.append({"type": "image", "path": _keyframe(root, f"references/{i:03d}_{k}.png", colour)})
        else:
            _, tone = av_clip(colour, pitch, TINY_FRAMES, TINY_FPS, 8000)
            rel = f"references/{i:03d}_{k}.wav"
            clips.write_wav(root / rel, tone[:8000], 8000)
            out.append({"type": "audio", "path": rel, "sample_rate": 8000})
    return out


def write_reference_clips(root: str | Path, n: int = 3, *, preference: bool = False) -> Path:
    """A Ref2VA V2 dataset: :func:`write_av_clips`' clips, each record's ``input.media`` an ordered reference list
    cycling through :data:`REFERENCE_FORMS`, and a legacy ``test.jsonl`` evaluation split of ``references`` rows.

    Args:
        root: the dataset folder (created).
        n: training records.
        preference: preference pairs (offline DPO) instead of demonstrations.
    """
    root = write_av_clips(root, n, preference=preference)
    (root / "test.txt").unlink()

    def edit(i: int, record: dict[str, Any]) -> dict[str, Any]:
        meta = record["metadata"]
        record["input"]["media"] = _references(root, i, meta["colour"], meta["pitch"],
                                               REFERENCE_FORMS[i % len(REFERENCE_FORMS)])  # fmt: skip
        return record

    _rewrite(root, edit)
    (root / "test.jsonl").write_text(json.dumps(reference_prompt(root, 1)) + "\n")
    return root


def reference_prompt(root: Path, i: int) -> dict[str, Any]:
    """A legacy Ref2VA generation row: ``prompt`` + the ordered ``references`` of :data:`REFERENCE_FORMS` ``[i % 3]``
    (paths relative to the dataset folder, as the spec resolves them)."""
    colour, pitch = list(COLOURS)[i % len(COLOURS)], list(PITCHES)[i % len(PITCHES)]
    refs = _references(root, i, colour, pitch, REFERENCE_FORMS[i % len(REFERENCE_FORMS)])
    return {"prompt": f"a {colour} square with a {pitch} tone", "references": refs}


def write_reference_prompts(root: str | Path, n: int = 2) -> Path:
    """A Ref2VA generation dataset (GRPO rollouts, evaluation): legacy ``train.jsonl`` / ``test.jsonl`` rows with
    ordered references (:func:`reference_prompt`)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = [reference_prompt(root, i) for i in range(n)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return root


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_minimax.testing", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--variant", default="t2va", choices=VARIANTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", action="store_true", help="write an audio+video clip dataset to --out instead")
    p.add_argument("--preference", action="store_true", help="with --dataset: preference pairs (the other pitch)")
    p.add_argument("--prompts", action="store_true", help="with --dataset: prompt-only rows")
    p.add_argument("--n", type=int, default=8, help="with --dataset: number of clips")
    p.add_argument("--condition", choices=("keyframes", "references"), default=None,
                   help="with --dataset: FL2VA keyframes or Ref2VA references with every record")
    a = p.parse_args(argv)
    if a.dataset and a.condition:
        writers = {("keyframes", True): write_keyframe_prompts, ("references", True): write_reference_prompts}
        if a.prompts:
            out = writers[(a.condition, True)](a.out, a.n)
        elif a.condition == "keyframes":
            out = write_keyframe_clips(a.out, a.n, preference=a.preference)
        else:
            out = write_reference_clips(a.out, a.n, preference=a.preference)
        print(f"wrote {a.n} {a.condition} records to {out}")
        return
    if a.dataset and a.prompts:
        print(f"wrote {a.n} prompt rows to {write_prompts(a.out, a.n)}")
        return
    if a.dataset:
        print(f"wrote {a.n} audio+video clips to {write_av_clips(a.out, a.n, preference=a.preference)}")
        return
    out = build_tiny_minimax(a.out, variant=a.variant, seed=a.seed)
    print(f"wrote tiny MiniMax H3 {a.variant} checkpoint to {out}")


if __name__ == "__main__":
    main()
