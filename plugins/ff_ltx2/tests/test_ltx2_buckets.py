"""LTX-2 on ``data.buckets`` (docs/ltx2.md, "Buckets"): ltx-trainer's resolution buckets ``WxHxF``, any canvas of
multiples of the video VAE's spatial compression x patch and any ``k * temporal + 1`` frames (the tiny checkpoint: 8
and 2), at the adapter's frame rate. Each clip's audio is cut to that clip's own clock; a batch never mixes
geometries; ``ltx2_i2av`` keeps its canvas (its condition latent is encoded once, at it).

* ``ff fit`` on clips of three lengths and two canvases with ``data.buckets`` + ``data.max_tokens``: every batch is one
  bucket's, and the transformer sees each bucket's video and audio token counts;
* ``encode_output`` of a shorter clip equals the VAEs' own encoding of that clip and of its audio cut to its own
  duration, written out here (diffusers' pipeline helpers for packing and normalising, not the adapter's);
* the audio spans are checked per bucket before weights load (a bucket's clip, not the adapter's);
* refusals naming ``data.buckets[i]``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from diffusers import LTX2Pipeline
from ff_ltx2 import LTX2I2AVAdapter, LTX2T2AVAdapter
from ff_ltx2.audio import log_mel
from ff_ltx2.testing import write_av_clips
from ltx2_geometry import ADAPTER_KWARGS, FPS, FRAMES, SIZE
from torch.utils.data import default_collate

from ff_core.adapter import ConditionInput
from ff_core.cli.flow_cli import FlowCLI
from ff_core.contracts import AudioSpan, MediaGeometry
from ff_core.data.datamodule import FlowDataModule
from ff_core.errors import ConfigError, DatasetErrors
from ff_core.module import FlowModule
from ff_core.testing.recipes import fit_tiny

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
# The adapter's 9-frame 32x32 clip, a 5-frame one, and a 5-frame 16x32 (wide) one, at the adapter's 8 fps.
BUCKETS = [{"height": SIZE, "width": SIZE, "num_frames": FRAMES, "fps": FPS},
           {"height": SIZE, "width": SIZE, "num_frames": 5, "fps": FPS},
           {"height": 16, "width": SIZE, "num_frames": 5, "fps": FPS}]  # fmt: skip
# Video tokens (latent frames x 4 x 4, or x 2 x 4) and audio tokens (round(seconds * 25)) per bucket.
TOKENS = {(80, 28), (48, 16), (24, 16)}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """12 records: 4 long square clips (12 frames: the 9-frame bucket), 3 short square ones and 5 short wide ones
    (6 frames, 0.75 s: too short for 9 frames)."""
    root = tmp_path_factory.mktemp("ltx2-buckets")
    long = write_av_clips(root / "long", 4, frames=12)
    short = write_av_clips(root / "short", 3, frames=6)
    wide = write_av_clips(root / "wide", 5, frames=6, height=16)
    return [{"name": name, "dataset_dir": str(path)} for name, path in
            (("long", long), ("short", short), ("wide", wide))]  # fmt: skip


class Recorder:
    """Per training forward, the transformer's (video tokens, audio tokens), and per batch its target clips' shapes."""

    def __init__(self) -> None:
        self.tokens: list[tuple[int, int]] = []
        self.clips: list[set[tuple[int, ...]]] = []

    def hook(self, module, args, kwargs) -> None:
        self.tokens.append((kwargs["hidden_states"].shape[1], kwargs["audio_hidden_states"].shape[1]))


def test_fit_trains_mixed_lengths_and_canvases_through_buckets(tiny_ltx2, datasets, tmp_path):
    """``data.max_tokens: 216`` sizes the buckets' batches ``216 // (108, 64, 40)`` = 2, 3, 5, so the 4 / 3 / 5
    records make 2 + 1 + 1 batches: 4 steps, each one bucket's clips, each forward at that bucket's token counts. The
    short clips' 0.75 s of audio cover their 5-frame (0.625 s) clip: with ``audio_tolerance: 0.05`` they pass the
    set-up's span check, which measured them against the adapter's 1.125 s before."""
    import lightning as L

    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(CONFIGS / "sft_tiny.yaml"), "--model.pretrained_model_name_or_path", str(tiny_ltx2("t2av")),
        "--data.datasets", json.dumps(datasets), "--data.buckets", json.dumps(BUCKETS), "--data.max_tokens", "216",
        "--model.adapter_kwargs", json.dumps({**ADAPTER_KWARGS, "max_sequence_length": 16, "audio_tolerance": 0.05}),
        "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "1", "--data.num_workers", "0",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks", "[]"])  # fmt: skip
    seen = Recorder()

    class Record(L.Callback):
        def on_train_start(self, trainer, module):
            module.adapter.transformer.register_forward_pre_hook(seen.hook, with_kwargs=True)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.clips.append({tuple(target[0].frames.shape) for target in batch["target"]})

    cli.trainer.callbacks.append(Record())
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.datamodule.bucket_batch_sizes(cli.model.adapter) == [2, 3, 5]
    assert cli.trainer.global_step == 4 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert all(len(shapes) == 1 for shapes in seen.clips)  # (F, H, W, 3) of each batch's targets: one geometry
    assert {next(iter(s)) for s in seen.clips} == {(9, 32, 32, 3), (5, 32, 32, 3), (5, 16, 32, 3)}
    assert set(seen.tokens) == TOKENS


@pytest.fixture(scope="module")
def adapter(tiny_ltx2):
    return LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **ADAPTER_KWARGS)


def tone(seconds: float, hz: float = 330.0) -> torch.Tensor:
    """A 16 kHz stereo tone (the audio VAE's rate and channels: no conversion)."""
    t = torch.arange(round(seconds * 16000)) / 16000
    return (0.3 * torch.sin(2 * math.pi * hz * t)).repeat(2, 1)


def test_encode_output_of_a_shorter_clip_is_the_vaes_of_that_clip(adapter):
    """A 5-frame 16x32 clip at 8 fps lasts 0.625 s: L = round(0.625 * 16000 / 160 / 4) = 16 audio latent frames (the
    adapter's own clip has 28), so 4 L = 64 mel hops = 10,240 samples of the 1.5 s source, not 28's. By hand: the
    frames in [-1, 1] through the video VAE (posterior mode), normalised as LTX2Pipeline does
    (``_normalize_latents``); the first 10,240 samples through LTX-2's log-mel, the audio VAE (mode), cut to 16 frames,
    packed and normalised by the pipeline's helpers."""
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (2, 5, 3, 16, 32), dtype=torch.uint8, generator=g)
    sounds = [tone(1.5, 330.0), tone(1.5, 660.0)]
    condition = adapter.prepare_condition(default_collate(adapter.preprocess([ConditionInput("a"),
                                                                              ConditionInput("b")])))
    state = adapter.encode_output([[frames[i], sounds[i]] for i in range(2)], condition)

    vae, audio_vae = adapter.vae, adapter.audio_vae
    with torch.no_grad():
        pixels = (frames.float() / 127.5 - 1).permute(0, 2, 1, 3, 4)  # (B, 3, F, H, W)
        z = vae.encode(pixels).latent_dist.mode()
        video = LTX2Pipeline._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        L = 16
        waves = torch.stack([s[:, : 4 * L * 160] for s in sounds])
        mel = log_mel(waves, sample_rate=16000, n_fft=1024, hop_length=160, n_mels=16)[:, :, : 4 * L]
        za = audio_vae.encode(mel).latent_dist.mode()[:, :, :L]
        packed = LTX2Pipeline._normalize_audio_latents(LTX2Pipeline._pack_audio_latents(za), audio_vae.latents_mean,
                                                       audio_vae.latents_std)  # fmt: skip
        audio = LTX2Pipeline._unpack_audio_latents(packed, L, za.shape[3])
    assert state.components["video"].shape == (2, 4, 3, 2, 4) and state.components["audio"].shape == (2, 2, 16, 4)
    torch.testing.assert_close(state.components["video"], video, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.components["audio"], audio, rtol=1e-5, atol=1e-5)
    # The adapter's own clip still cuts 28 frames, and the two differ: the cut is the clip's, not a fixed one.
    one = {k: v[:1] for k, v in condition.items()}
    own = adapter.encode_output([[torch.zeros(FRAMES, 3, SIZE, SIZE, dtype=torch.uint8), sounds[0]]], one)
    assert own.components["audio"].shape[2] == 28


def test_a_batch_mixing_geometries_is_refused(adapter):
    condition = adapter.prepare_condition(default_collate(adapter.preprocess([ConditionInput("a")] * 2)))
    media = [[torch.zeros(5, 3, SIZE, SIZE, dtype=torch.uint8), tone(1.0)],
             [torch.zeros(9, 3, SIZE, SIZE, dtype=torch.uint8), tone(1.2)]]  # fmt: skip
    with pytest.raises(ValueError, match=r"media\[1\]\[0\]: a clip of \(9, 3, 32, 32\) \(F, 3, H, W\) in a batch whose "
                                         r"first is \(5, 3, 32, 32\): ltx2_t2av trains each batch on one clip"):
        adapter.encode_output(media, condition)
    with pytest.raises(ValueError, match=r"media\[0\]\[0\]: a clip of \(6, 3, 32, 32\) .* cannot encode: num_frames"):
        adapter.encode_output([[torch.zeros(6, 3, SIZE, SIZE, dtype=torch.uint8), tone(1.0)]], condition)


def test_bucket_spans_are_the_buckets_own(tiny_ltx2, datasets, tmp_path):
    """The audio of a record in the 5-frame bucket must cover that clip's 0.625 s (from the bucket's start), not the
    adapter's 1.125 s: 0.5 s of it is refused at set-up, naming the file and line, before any weight loads."""
    clip = MediaGeometry(16, 32, num_frames=5, fps=FPS, start=0.25)
    kwargs = {**ADAPTER_KWARGS, "audio_tolerance": 0.05}
    assert LTX2T2AVAdapter.resolve_bucket_geometry(None, kwargs, clip) == (clip, AudioSpan(0.625, 0.25, 0.05))
    mute = write_av_clips(tmp_path / "mute", 2, frames=6, audio_seconds=0.5)
    with pytest.raises(DatasetErrors, match=r"mute/train\.jsonl:1: .*audio too short: it holds 0\.500 s from 0 s, the "
                                            r"clip needs 0\.625 s"):
        fit_tiny(CONFIGS / "sft_tiny.yaml", tiny_ltx2("t2av"), [{"name": "mute", "dataset_dir": str(mute)}],
                 tmp_path / "run", "--data.buckets", json.dumps(BUCKETS), "--model.adapter_kwargs",
                 json.dumps({**ADAPTER_KWARGS, "max_sequence_length": 16, "audio_tolerance": 0.05}))  # fmt: skip


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight load (every component comes through ``_components``) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the buckets were checked")

    for cls in (LTX2T2AVAdapter, LTX2I2AVAdapter):
        monkeypatch.setattr(cls, "_components", classmethod(refuse))


@pytest.mark.parametrize(("variant", "bucket", "message"), [
    ("t2av", {"height": 36}, r"height: must be a multiple of 8 \(video VAE compression x patch size\), got 36"),
    ("t2av", {"width": 20}, r"width: must be a multiple of 8 .*got 20"),
    ("t2av", {"num_frames": 6}, r"num_frames: \(num_frames - 1\) must be divisible by 2 \(the video VAE's temporal "
                                r"compression x patch\), got 6"),
    ("t2av", {"fps": 16.0}, r"ltx2_t2av trains on clips at model\.adapter_kwargs\.frame_rate 8 fps .*got 9 frames "
                            r"at 16\.0 fps"),
    ("i2av", {"height": 16, "num_frames": 5}, r"ltx2_i2av encodes its condition image once, at model\.adapter_kwargs' "
                                              r"32x32, so it trains on that canvas only, got 16x32"),
])  # fmt: skip
def test_buckets_the_checkpoint_cannot_train_on_fail_before_weights_load(tiny_ltx2, tmp_path, no_weights, variant,
                                                                         bucket, message):  # fmt: skip
    """Against the tiny checkpoint's configs (8x spatial, 2x temporal compression, patch 1): bucket 0 passes, bucket
    1 is refused naming ``data.buckets[1]``. ``ltx2_i2av`` takes other frame counts at its canvas."""
    clips = write_av_clips(tmp_path / "clips", 2, i2av=variant == "i2av")
    recipe = {"t2av": "sft_tiny.yaml", "i2av": "i2av_sft_tiny.yaml"}[variant]
    with pytest.raises(ConfigError, match=r"data\.buckets\[1\]: " + message):
        fit_tiny(CONFIGS / recipe, tiny_ltx2(variant), [{"name": "clips", "dataset_dir": str(clips)}],
                 tmp_path / "run", "--data.buckets", json.dumps([BUCKETS[1], {**BUCKETS[0], **bucket}]))  # fmt: skip
    if variant == "i2av":
        LTX2I2AVAdapter.check_bucket(tiny_ltx2("i2av"), ADAPTER_KWARGS, MediaGeometry(SIZE, SIZE, num_frames=17,
                                                                                      fps=FPS, start=0.5))
