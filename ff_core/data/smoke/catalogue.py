"""The offline smoke datasets' catalogue: canonical task profiles and their runtime aliases, as data.

Spec dataset-guide, "Public offline smoke datasets": one builder writes two self-contained mini datasets (SFT
demonstrations, offline-DPO preferences) whose runtime aliases cover every implemented output kind, "expressed with
the general PipelineIOContract output sequence", so "a future audio-only or other ordered output can therefore use the
same V2 schema and preparation path". The names are Flow-Factory's (``dataset/offline_smoke/profiles.py``): a
canonical *profile* is a task (its output sequence and the condition inputs its rows carry); an *alias* is one model's
runtime of it (the ff adapter, the checkpoint variant whose contract realises it, a small geometry). A user's
``--profile ltx2-t2av`` therefore carries over from Flow-Factory unchanged.

Nothing here is code per media type: a profile lists :class:`~ff_core.contracts.OutputSpec` s and input items, the
builder (:mod:`ff_core.data.smoke.build`) writes whatever they name. Which aliases an installation can serve is
decided against the installed adapters' own contracts (:mod:`ff_core.data.smoke.support`), never assumed.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

from ff_core.contracts import AUDIO_OUT, IMAGE_OUT, VIDEO_OUT, MediaType, OutputSpec

SFT_REPO_ID = "Jayce-Ping/Flow-Factory-SFT-Smoke"
OFFLINE_DPO_REPO_ID = "Jayce-Ping/Flow-Factory-Offline-DPO-Smoke"
REPO_IDS: dict[str, str] = {"sft": SFT_REPO_ID, "offline-dpo": OFFLINE_DPO_REPO_ID}
"""The Hub dataset of each algorithm (spec: the two public mini datasets)."""
SUPERVISION: dict[str, str] = {"sft": "demonstration", "offline-dpo": "preference"}
ALGORITHMS: tuple[str, ...] = tuple(SUPERVISION)
ROWS_PER_ALIAS = 32
"""Rows of every alias in each dataset: two local batches on up to 16 ranks at batch size 1."""
CATALOGUE_VERSION = 1
"""Bumped whenever the catalogue or the generated media change: it names the default cache build."""


class SmokeError(ValueError):
    """A mistake the user can fix (unknown profile, missing adapter, too few rows, uncached revision): one line."""


@dataclass(frozen=True)
class Geometry:
    """The small geometry of an alias's media.

    Attributes:
        height: pixel rows of every image and video.
        width: pixel columns.
        num_frames: frames of a video output (``None``: no video).
        fps: its frame rate (written in the file and in each record's ``fps``).
        sample_rate: the rate of audio files (and each record's ``sample_rate``); the adapter converts it to its model
            rate once (spec: "the single model-rate conversion" is adapter-owned), so a low rate keeps files small.
        seconds: the audio duration when there is no video clock (``None``: ``num_frames / fps``).
    """

    height: int
    width: int
    num_frames: int | None = None
    fps: float | None = None
    sample_rate: int | None = None
    seconds: float | None = None

    @property
    def duration(self) -> float | None:
        """Seconds of every video and audio output: ``seconds``, else the video clock ``num_frames / fps``."""
        if self.seconds is not None:
            return self.seconds
        return None if self.num_frames is None or self.fps is None else self.num_frames / self.fps

    def to_json(self) -> dict[str, float | int]:
        return {k: v for k, v in vars(self).items() if v is not None} | (
            {"duration": round(self.duration, 6)} if self.duration is not None else {})  # fmt: skip


@dataclass(frozen=True)
class InputItem:
    """One condition input of a profile's rows.

    Attributes:
        type: its media type.
        slot: the adapter slot it binds (``first_frame``), or ``None`` (ordered references, grouped inputs).
        frame: ``first`` / ``last``: the decoded first / last frame of the row's target video (keyframes, so the
            condition and both preference candidates agree); ``None``: a still, tone or clip of the row's scene.
    """

    type: MediaType
    slot: str | None = None
    frame: Literal["first", "last"] | None = None

    def to_json(self) -> dict[str, str]:
        return {"type": self.type.value, **({"slot": self.slot} if self.slot else {}),
                **({"frame": self.frame} if self.frame else {})}  # fmt: skip


@dataclass(frozen=True)
class Profile:
    """A canonical task profile, shared by every alias of it and by both algorithms.

    Attributes:
        name: Flow-Factory's canonical name (``text_to_audio_video``).
        outputs: the contract's exact output sequence (video first, audio second for audio+video).
        forms: the condition inputs rows cycle through (row ``i`` takes ``forms[i % len(forms)]``); ``((),)``: prompt
            only.
    """

    name: str
    outputs: tuple[OutputSpec, ...]
    forms: tuple[tuple[InputItem, ...], ...] = ((),)


@dataclass(frozen=True)
class Alias:
    """One model's runtime of a profile.

    Attributes:
        name: the alias (``wan-flf2v``).
        profile: its canonical profile's name.
        adapter: the ff adapter that trains it (a registry name, see ``ff plugins``).
        geometry: the small geometry of its media.
        checkpoint: the released checkpoint Flow-Factory's GPU smoke run uses (documentation; nothing downloads it).
        variant: the checkpoint variant whose contract realises the profile (``Adapter.io_contract_variants``), or
            ``None``: the adapter's default contract.
    """

    name: str
    profile: str
    adapter: str
    geometry: Geometry
    checkpoint: str
    variant: str | None = None


IMAGE, VIDEO, AUDIO = MediaType.IMAGE, MediaType.VIDEO, MediaType.AUDIO
_FIRST = InputItem(IMAGE, "first_frame", "first")
_LAST = InputItem(IMAGE, "last_frame", "last")

PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("text_to_image", (IMAGE_OUT,)),
    Profile("image_to_image", (IMAGE_OUT,), ((InputItem(IMAGE),),)),
    Profile("multi_image_to_image", (IMAGE_OUT,), ((InputItem(IMAGE), InputItem(IMAGE)),)),
    Profile("text_to_video", (VIDEO_OUT,)),
    Profile("first_frame_to_video", (VIDEO_OUT,), ((_FIRST,),)),
    Profile("first_last_frame_to_video", (VIDEO_OUT,), ((_FIRST, _LAST),)),
    Profile("text_to_audio_video", (VIDEO_OUT, AUDIO_OUT)),
    Profile("first_frame_to_audio_video", (VIDEO_OUT, AUDIO_OUT), ((_FIRST,),)),
    # First-plus-last, first-only and last-only (spec: FL2VA "supports first-only, last-only, and first-plus-last").
    Profile("first_last_frame_to_audio_video", (VIDEO_OUT, AUDIO_OUT), ((_FIRST, _LAST), (_FIRST,), (_LAST,))),
    # Globally ordered references, never audio alone. Images and audio only: an H3 Ref2VA install without torchvision
    # cannot present video references (ff_minimax.ref2va.contract_here), and the rows must be valid everywhere.
    Profile("ordered_references_to_audio_video", (VIDEO_OUT, AUDIO_OUT), (
        (InputItem(IMAGE),), (InputItem(IMAGE), InputItem(AUDIO)),
        (InputItem(AUDIO), InputItem(IMAGE), InputItem(IMAGE)),
        (InputItem(IMAGE), InputItem(AUDIO), InputItem(IMAGE)))),
)}  # fmt: skip

# Every clip covers its family's default training clip, so `ff data validate --model` (the adapter's defaults), the
# real checkpoints at their default geometry and the tiny recipes all accept it: Wan2.1 81 frames at 16 fps (5.06 s,
# also Wan2.2's 121 at 24), LTX-2 121 frames at 24 fps, MiniMax H3 124 at 24 (5-15 s, 17 n + 5). 32x32 canvases: every
# adapter fits targets and conditions to its own canvas.
_IMAGE = Geometry(32, 32)
_WAN = Geometry(32, 32, num_frames=81, fps=16.0)
_LTX = Geometry(32, 32, num_frames=121, fps=24.0, sample_rate=8000)
_H3 = Geometry(32, 32, num_frames=124, fps=24.0, sample_rate=8000)

ALIASES: dict[str, Alias] = {a.name: a for a in (
    Alias("sd35-t2i", "text_to_image", "sd3-5", _IMAGE, "stabilityai/stable-diffusion-3.5-medium"),
    Alias("image-i2i", "image_to_image", "flux1-kontext", _IMAGE, "black-forest-labs/FLUX.1-Kontext-dev"),
    Alias("bagel-mri2i", "multi_image_to_image", "bagel", _IMAGE, "ByteDance-Seed/BAGEL-7B-MoT"),
    Alias("wan-t2v", "text_to_video", "wan2_t2v", _WAN, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    Alias("wan-i2v-first", "first_frame_to_video", "wan2_i2v", _WAN, "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "ti2v"),
    Alias("wan-flf2v", "first_last_frame_to_video", "wan2_i2v", _WAN, "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers",
          "flf2v"),
    Alias("ltx2-t2av", "text_to_audio_video", "ltx2_t2av", _LTX, "Lightricks/LTX-2"),
    Alias("ltx2-i2av", "first_frame_to_audio_video", "ltx2_i2av", _LTX, "Lightricks/LTX-2"),
    Alias("h3-t2va", "text_to_audio_video", "minimax-h3-t2va", _H3, "MiniMaxAI/MiniMax-H3"),
    Alias("h3-fl2va", "first_last_frame_to_audio_video", "minimax-h3-fl2va", _H3, "MiniMaxAI/MiniMax-H3"),
    Alias("h3-ref2va", "ordered_references_to_audio_video", "minimax-h3-ref2va", _H3, "MiniMaxAI/MiniMax-H3"),
)}  # fmt: skip
"""Every alias, in catalogue order (a canonical profile name given to ``prepare`` means its first served alias)."""


def lookup(name: str) -> tuple[Profile, list[Alias]]:
    """A canonical profile name or an alias: its profile and the aliases it may mean (one for an alias, every alias
    of the profile, in catalogue order, for a profile name).

    Raises:
        SmokeError: an unknown name, naming the closest one and every valid name.
    """
    if name in ALIASES:
        alias = ALIASES[name]
        return PROFILES[alias.profile], [alias]
    if name in PROFILES:
        return PROFILES[name], [a for a in ALIASES.values() if a.profile == name]
    close = difflib.get_close_matches(name, [*ALIASES, *PROFILES], n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    raise SmokeError(f"unknown profile {name!r}{guess} (aliases: {', '.join(ALIASES)}; profiles: "
                     f"{', '.join(PROFILES)})")  # fmt: skip
