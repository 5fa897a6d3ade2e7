"""Peak memory of the VAE encoding one long clip, untiled against tiled and sliced (``model.vae_tiling``,
``model.vae_slicing``: ff_core/vae_memory.py), side by side, each in a fresh process (peak RSS is per process).

The tiny Wan checkpoint's VAE (``scripts/build_inputs.sh wan``: build/tiny-wan-t2v) encodes ``--batch`` clips of
``--frames`` frames at ``--size`` x ``--size`` (posterior mode, fp32, no gradient), as ``encode_output`` does for
training targets. Prints one Markdown row per mode: peak RSS over the process's baseline after loading, seconds, and
the latents' largest difference from the untiled encode.

    python benchmarks/bench_vae_tiling.py [--frames 33 --size 512 --batch 2]

Full size (``--architecture wan2.1``): the Wan2.1 VAE's own architecture (``AutoencoderKLWan()``'s default config,
the 127 M-parameter VAE of every Wan2.1 checkpoint, random weights: memory does not depend on them) measured at two
small canvases (``--sizes``) and extrapolated, per mode, linearly in pixels per frame to ``--target`` (a clip encodes
causally in chunks of 4 frames, so the activations grow with the canvas, not the clip; the clip's own input tensor is
added for its frames). A computation from CPU measurements, not a GPU measurement.

    python benchmarks/bench_vae_tiling.py --architecture wan2.1 --sizes 256 384 --frames 5 --batch 1 \
        --target 720x1280x81
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"untiled": {}, "tiled (256 px tiles, stride 192)": {"tiling": {"tile_sample_min_height": 256,
         "tile_sample_min_width": 256, "tile_sample_stride_height": 192, "tile_sample_stride_width": 192}},
         "tiled + sliced": {"tiling": {"tile_sample_min_height": 256, "tile_sample_min_width": 256,
                                       "tile_sample_stride_height": 192, "tile_sample_stride_width": 192},
                            "slicing": True}}  # fmt: skip


def child(mode: dict, frames: int, size: int, batch: int, out: str, architecture: str = "tiny") -> None:
    import torch
    from diffusers import AutoencoderKLWan

    if architecture == "wan2.1":  # the real VAE's architecture (diffusers' defaults), random weights
        torch.manual_seed(0)
        vae = AutoencoderKLWan().eval()
    else:
        vae = AutoencoderKLWan.from_pretrained(REPO / "build" / "tiny-wan-t2v", subfolder="vae").eval()
    if mode.get("tiling"):
        vae.enable_tiling(**mode["tiling"])
    if mode.get("slicing"):
        vae.enable_slicing()
    t, y, x = torch.meshgrid(torch.arange(float(frames)), torch.linspace(0, 1, size), torch.linspace(0, 1, size),
                             indexing="ij")  # fmt: skip
    clip = torch.stack([torch.sin(3 * x + 0.3 * t), torch.cos(2 * y - 0.2 * t), torch.sin(2 * (x + y))])
    clip = clip.expand(batch, -1, -1, -1, -1).contiguous()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    begin = time.perf_counter()
    with torch.no_grad():
        latents = vae.encode(clip).latent_dist.mode()
    seconds = time.perf_counter() - begin
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save(latents, out)
    print(json.dumps({"peak_mib": (peak - base) / 1024, "seconds": seconds}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=33)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--architecture", choices=("tiny", "wan2.1"), default="tiny")
    p.add_argument("--sizes", type=int, nargs=2, default=None, help="two canvases to extrapolate from")
    p.add_argument("--target", default="720x1280x81", help="HxWxF of the extrapolated clip")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        return child(json.loads(a.child), a.frames, a.size, a.batch, a.out, a.architecture)
    if a.sizes:
        return extrapolate(a)
    import tempfile

    import torch

    print(f"| {a.batch} clips of {a.frames} frames at {a.size}x{a.size}, tiny Wan VAE | peak RSS over baseline | "
          "seconds | max latent difference from untiled |\n|---|---|---|---|")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        reference = None
        for name, mode in MODES.items():
            out = f"{tmp}/{len(name)}.pt"
            run = subprocess.run([sys.executable, __file__, "--child", json.dumps(mode), "--out", out, "--frames",
                                  str(a.frames), "--size", str(a.size), "--batch", str(a.batch)], cwd=REPO,
                                 capture_output=True, text=True, check=True)  # fmt: skip
            r = json.loads(run.stdout.strip().splitlines()[-1])
            latents = torch.load(out)
            reference = latents if reference is None else reference
            diff = float((latents - reference).abs().max())
            print(f"| {name} | {r['peak_mib']:.0f} MiB | {r['seconds']:.1f} | {diff:.3f} |", flush=True)


def measure(mode: dict, frames: int, size: int, batch: int, architecture: str, out: str) -> dict:
    run = subprocess.run([sys.executable, __file__, "--child", json.dumps(mode), "--out", out, "--frames", str(frames),
                          "--size", str(size), "--batch", str(batch), "--architecture", architecture], cwd=REPO,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(run.stdout.strip().splitlines()[-1])


def extrapolate(a: argparse.Namespace) -> None:
    """Per mode, peak RSS at the two ``--sizes``, the fitted MiB per pixel per frame-chunk, and the ``--target``
    clip's predicted peak (plus its input tensor beyond the measured clips')."""
    import tempfile

    h, w, f = (int(v) for v in a.target.split("x"))
    small, large = a.sizes
    print(f"| {a.architecture} VAE, {a.batch} clip(s) of {a.frames} frames | peak at {small}x{small} | peak at "
          f"{large}x{large} | computed for {h}x{w}, {f} frames |\n|---|---|---|---|")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode in list(MODES.items())[:2]:
            peaks = [measure(mode, a.frames, s, a.batch, a.architecture, f"{tmp}/x.pt")["peak_mib"] for s in a.sizes]
            tiled = bool(mode.get("tiling"))
            # Untiled: activations scale with the canvas. Tiled: with the tile (256 px), whatever the canvas, so the
            # larger measurement stands for any canvas beyond it, plus what holds the whole clip (input and output).
            per_pixel = (peaks[1] - peaks[0]) / (large * large - small * small)
            clip = a.batch * 3 * 4 * (f - a.frames) * h * w / 2**20  # the target's own fp32 input beyond the measured
            if tiled:
                predicted = peaks[1] + clip + a.batch * 3 * 4 * a.frames * (h * w - large * large) / 2**20
            else:
                predicted = peaks[1] + per_pixel * (h * w - large * large) + clip
            print(f"| {name} | {peaks[0]:.0f} MiB | {peaks[1]:.0f} MiB | {predicted / 1024:.1f} GiB |", flush=True)


if __name__ == "__main__":
    main()
