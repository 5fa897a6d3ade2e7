"""Does a tiny LTX-2 learn both streams? Colour match of the video and pitch match of the audio, trained vs base.

A tiny LTX-2 checkpoint (:func:`ff_ltx2.testing.build_tiny_ltx2`) gets its video VAE trained briefly on the clips'
frames (a red / blue / green square on grey) and its audio VAE on the tones' log-mel spectrograms (220 Hz "low",
880 Hz "high"), with their latent statistics set from the posterior samples; then its transformer is trained from
scratch with ff's SFT objective (adapter ``encode_output`` on the (video, audio) pairs, ``SFTObjective.loss``, AdamW)
on the six captions "a <colour> square with a <pitch> tone". Samples of the trained and of the untrained base
transformer (same VAEs) are scored: the colour of the square region of the decoded frames (nearest of the three),
and the pitch of the decoded mel spectrogram (the audio VAE's output, nearer the low or the high tone's mean
spectrum; the tiny vocoder is untrained, so the waveform is not scored).

    python benchmarks/bench_ltx2_av.py [--steps 1200] [--vae-steps 1200] [--seeds 4] [--out runs/ltx2_av_bench]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ff_ltx2 import LTX2T2AVAdapter  # noqa: E402
from ff_ltx2.testing import COLOURS, PITCHES, av_clip, build_tiny_ltx2  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

from ff_core.adapter import ConditionInput  # noqa: E402
from ff_core.objectives import SFTObjective  # noqa: E402
from ff_core.testing.tiny import train_vae  # noqa: E402

FRAMES, FPS, SIZE = 9, 8.0, 32
KW = {"height": SIZE, "width": SIZE, "num_frames": FRAMES, "frame_rate": FPS}
PROMPTS = [(c, p) for c in COLOURS for p in PITCHES]


def clips() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """uint8 videos (N, F, 3, H, W) and 16 kHz stereo tones, one per (colour, pitch)."""
    videos, tones = [], []
    for colour, pitch in PROMPTS:
        frames, tone = av_clip(colour, pitch, FRAMES, FPS, 16000, size=SIZE, channels=2)
        videos.append(torch.from_numpy(frames).permute(0, 3, 1, 2))
        tones.append(torch.from_numpy(tone.T.copy()).float())
    return torch.stack(videos), tones


def train_vaes(adapter: LTX2T2AVAdapter, videos: torch.Tensor, tones: list[torch.Tensor], steps: int) -> None:
    """Video VAE on the frames, audio VAE on the mels; latent statistics from their posterior samples."""
    x = videos.float().permute(0, 2, 1, 3, 4) / 127.5 - 1  # (N, 3, F, H, W)
    train_vae(adapter.vae, x, steps=steps, batch_size=6, lr=3e-3, kl_weight=1e-6, seed=0)
    # 4 L - 3 mel frames: what the causal audio decoder gives back for L latent frames.
    frames = 4 * adapter.audio_latent_frames - 3
    mels = torch.stack([adapter.target_mel(t, 0.0, "tone") for t in tones])[:, :, :frames]
    train_vae(adapter.audio_vae, mels, steps=steps, batch_size=6, lr=3e-3, kl_weight=1e-6, seed=1)
    with torch.no_grad():
        torch.manual_seed(0)
        z = adapter.vae.encode(x).latent_dist.sample()
        adapter.vae.latents_mean.copy_(z.mean((0, 2, 3, 4)))
        adapter.vae.latents_std.copy_(z.std((0, 2, 3, 4)) / adapter.vae.config.scaling_factor)
        a = adapter.pack_audio(adapter.audio_vae.encode(mels).latent_dist.sample())  # (N, L, C M)
        adapter.audio_vae.latents_mean.copy_(a.mean((0, 1)))
        adapter.audio_vae.latents_std.copy_(a.std((0, 1)))


def score(adapter: LTX2T2AVAdapter, reference_mels: dict[str, torch.Tensor], seeds: int) -> tuple[float, float]:
    """Colour and pitch accuracy of ``seeds`` samples per caption."""
    inputs = [ConditionInput(f"a {c} square with a {p} tone") for c, p in PROMPTS]
    condition = adapter.prepare_condition(default_collate(adapter.preprocess(inputs)))
    palette = torch.tensor(list(COLOURS.values()), dtype=torch.float32)
    colour_hits = pitch_hits = 0
    for seed in range(seeds):
        with torch.no_grad():
            state = adapter.sample(condition, num_steps=20, generator=torch.Generator().manual_seed(seed))
            frames = adapter.decode(state)
            audio = adapter.denormalize_audio(state.components["audio"])
            mels = adapter.audio_vae.decode(audio).sample.mean((1, 2))  # (B, M): mean log-mel per bin
        for (colour, pitch), sample, mel in zip(PROMPTS, frames, mels):
            square = sample[0][:, :, SIZE // 4 + 2 : 3 * SIZE // 4 - 2, SIZE // 4 + 2 : 3 * SIZE // 4 - 2].float()
            rgb = square.mean((0, 2, 3))
            got = list(COLOURS)[int((palette - rgb).norm(dim=1).argmin())]
            colour_hits += got == colour
            nearest = min(reference_mels, key=lambda k: float((reference_mels[k] - mel).norm()))
            pitch_hits += nearest == pitch
    n = seeds * len(PROMPTS)
    return colour_hits / n, pitch_hits / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1200, help="SFT steps of the transformer")
    parser.add_argument("--vae-steps", type=int, default=1200, help="training steps of each VAE")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("runs/ltx2_av_bench"))
    a = parser.parse_args()
    torch.manual_seed(0)
    path = build_tiny_ltx2(a.out / "ckpt")
    adapter = LTX2T2AVAdapter.from_pretrained(path, **KW)
    videos, tones = clips()
    t0 = time.perf_counter()
    adapter.vae.requires_grad_(True), adapter.audio_vae.requires_grad_(True)
    train_vaes(adapter, videos, tones, a.vae_steps)
    adapter.vae.requires_grad_(False).eval(), adapter.audio_vae.requires_grad_(False).eval()
    with torch.no_grad():
        # Each pitch's reference: the mean decoded log-mel per bin of its tones' VAE round trip.
        reference = {}
        for p in PITCHES:
            m = torch.stack([adapter.target_mel(t, 0.0, p) for (_, q), t in zip(PROMPTS, tones) if q == p])
            decoded = adapter.audio_vae.decode(adapter.audio_vae.encode(m).latent_dist.mode()).sample
            reference[p] = decoded.mean((0, 1, 2))
    with torch.no_grad():  # the VAE's own round trip: the ceiling of the colour score
        x = videos.float().permute(0, 2, 1, 3, 4) / 127.5 - 1
        recon = ((adapter.vae.decode(adapter.vae.encode(x).latent_dist.mode()).sample / 2 + 0.5).clamp(0, 1) * 255)
        inner = recon[:, :, :, SIZE // 4 + 2 : 3 * SIZE // 4 - 2, SIZE // 4 + 2 : 3 * SIZE // 4 - 2].mean((2, 3, 4))
        palette = torch.tensor(list(COLOURS.values()), dtype=torch.float32)
        got = [list(COLOURS)[int((palette - rgb).norm(dim=1).argmin())] for rgb in inner]
        print(f"video VAE round trip: {sum(g == c for g, (c, _) in zip(got, PROMPTS))}/6 colours kept", flush=True)
    base_colour, base_pitch = score(adapter, reference, a.seeds)
    inputs = [ConditionInput(f"a {c} square with a {p} tone") for c, p in PROMPTS]
    condition = adapter.prepare_condition(default_collate(adapter.preprocess(inputs)))
    media = [[v, t] for v, t in zip(videos, tones)]
    with torch.no_grad():
        clean = [adapter.encode_output(media, condition, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    adapter.transformer.requires_grad_(True).train()
    objective = SFTObjective()
    opt = torch.optim.AdamW(adapter.transformer.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for step in range(a.steps):
        loss = objective.loss(adapter, clean[step % len(clean)], condition, g).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"step {step}: loss {float(loss.detach()):.4f}", flush=True)
    adapter.transformer.eval()
    colour, pitch = score(adapter, reference, a.seeds)
    print(f"colour match: trained {colour:.1%} vs base {base_colour:.1%}; pitch match: trained {pitch:.1%} vs base "
          f"{base_pitch:.1%} ({a.seeds} samples x 6 captions, {a.steps} SFT steps, {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
