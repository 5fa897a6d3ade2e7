"""Procedural scenes of the smoke datasets: a coloured shape moving across a plain background, with a steady tone.

Every scene is drawn from ``numpy.random.default_rng([seed, alias key, row])`` alone, so one seed gives the same pixels
and samples everywhere; the caption names what the media show. A preference pair's rejected candidate is a corrupted
copy of the chosen one (:meth:`Scene.corrupt_frames` & co.) that keeps a video's first and last frames, so conditioned
workflows (first / last frame slots) stay valid for both arms.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 190, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
    "magenta": (210, 50, 200), "cyan": (40, 200, 210), "orange": (240, 140, 30), "white": (245, 245, 245),
}  # fmt: skip
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (16, 16, 16), "grey": (110, 110, 110), "navy": (20, 30, 80), "olive": (90, 90, 30),
}  # fmt: skip
SHAPES = ("square", "disc")
MOTIONS: dict[str, tuple[float, float]] = {  # the direction of travel (x right, y down)
    "left to right": (1.0, 0.0), "right to left": (-1.0, 0.0), "upwards": (0.0, -1.0), "downwards": (0.0, 1.0),
}  # fmt: skip
PITCHES: dict[str, float] = {"low": 220.0, "middle": 440.0, "high": 880.0}


def scene_rng(seed: int, key: str, row: int) -> np.random.Generator:
    """The generator of one row: ``[seed, crc32(key), row]`` (stable across processes, unlike ``hash``)."""
    return np.random.default_rng([seed, zlib.crc32(key.encode()), row])


@dataclass(frozen=True)
class Scene:
    """What one row shows and sounds like.

    Attributes:
        colour: the shape's colour name (:data:`COLOURS`).
        background: the background's name (:data:`BACKGROUNDS`).
        shape: ``square`` or ``disc``.
        motion: the direction the shape moves (:data:`MOTIONS`).
        pitch: the tone's name (:data:`PITCHES`).
    """

    colour: str
    background: str
    shape: str
    motion: str
    pitch: str

    @classmethod
    def draw(cls, rng: np.random.Generator) -> Scene:
        def pick(options) -> str:
            return list(options)[int(rng.integers(len(options)))]

        return cls(pick(COLOURS), pick(BACKGROUNDS), pick(SHAPES), pick(MOTIONS), pick(PITCHES))

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    def caption(self, moving: bool, sound: bool) -> str:
        """The prompt: what the outputs show (the motion for a video, the tone for audio)."""
        article = "an" if self.background[0] in "aeiou" else "a"
        text = f"A {self.colour} {self.shape} " + (f"moves {self.motion} " if moving else "") + \
            f"on {article} {self.background} background"  # fmt: skip
        return text + (f", with a steady {self.pitch} tone." if sound else ".")

    # -- pictures ------------------------------------------------------------------------------
    def frame(self, height: int, width: int, t: float | None = None) -> np.ndarray:
        """uint8 (H, W, 3): the shape at time ``t`` in [0, 1] of its motion (``None``: centred, a still)."""
        image = np.empty((height, width, 3), np.uint8)
        image[:] = BACKGROUNDS[self.background]
        side = max(2, min(height, width) // 3)
        dx, dy = MOTIONS[self.motion]
        travel = 0.0 if t is None else t - 0.5  # -1/2 .. +1/2 of the free space, centred at t = 1/2
        cx = (width - 1) / 2 + dx * travel * (width - side)
        cy = (height - 1) / 2 + dy * travel * (height - side)
        yy, xx = np.mgrid[0:height, 0:width]
        if self.shape == "square":
            mask = (np.abs(xx - cx) <= side / 2) & (np.abs(yy - cy) <= side / 2)
        else:
            mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= (side / 2) ** 2
        image[mask] = COLOURS[self.colour]
        return image

    def frames(self, num_frames: int, height: int, width: int) -> np.ndarray:
        """uint8 (F, H, W, 3): the motion from its start to its end."""
        times = np.linspace(0.0, 1.0, num_frames) if num_frames > 1 else np.zeros(1)
        return np.stack([self.frame(height, width, float(t)) for t in times])

    # -- sound ---------------------------------------------------------------------------------
    def tone(self, seconds: float, rate: int) -> np.ndarray:
        """float32 (N,) in [-1, 1]: the pitch's sine, ``round(seconds * rate)`` samples, 10 ms fades at both ends."""
        n = int(round(seconds * rate))
        wave = 0.3 * np.sin(2 * np.pi * PITCHES[self.pitch] * np.arange(n) / rate)
        fade = min(n // 2, max(1, rate // 100))
        ramp = np.linspace(0.0, 1.0, fade)
        wave[:fade] *= ramp
        wave[n - fade :] *= ramp[::-1]
        return wave.astype(np.float32)

    # -- corruptions (the rejected candidate of a preference pair) -----------------------------
    @staticmethod
    def corrupt_image(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The image with its colour channels rotated and strong Gaussian noise (sigma 48)."""
        noisy = np.roll(image, 1, axis=-1).astype(np.float64) + rng.normal(0.0, 48.0, image.shape)
        return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)

    @staticmethod
    def corrupt_frames(frames: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Every frame but the first and the last corrupted: colour channels rotated and one fixed Gaussian noise
        field (sigma 48) over all of them (fixed, so the clip still compresses: fresh noise per frame made each clip
        ~30x larger). The first and last frames are kept bit for bit (and encoded as intra frames,
        :func:`ff_core.data.smoke.media.encode_mp4`), so their decoded pixels match the chosen clip's and the condition
        images of both arms."""
        out = frames.copy()
        if len(frames) > 2:
            noise = rng.normal(0.0, 48.0, frames.shape[1:])
            noisy = np.roll(frames[1:-1], 1, axis=-1).astype(np.float64) + noise
            out[1:-1] = np.clip(np.rint(noisy), 0, 255).astype(np.uint8)
        return out

    @staticmethod
    def corrupt_tone(wave: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The tone hard-clipped at a third of its peak, plus white noise (sigma 0.1)."""
        peak = float(np.abs(wave).max()) or 1.0
        noisy = np.clip(wave, -peak / 3, peak / 3) * 3 + rng.normal(0.0, 0.1, wave.shape)
        return np.clip(noisy, -1.0, 1.0).astype(np.float32)
