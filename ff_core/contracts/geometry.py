"""Target geometry an adapter declares: the canvas, frame count, rate and frame rule its targets are decoded to, and
the audio span it cuts. Plain data, readable before weights load; :mod:`ff_core.data.media.geometry` fits decoded media
to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FRAME_RULES = ("nearest", "fps_filter", "floor")
FrameRule = Literal["nearest", "fps_filter", "floor"]


@dataclass(frozen=True)
class MediaGeometry:
    """The frame (and, for a video, the clip) one output is encoded at (picklable: it travels to the loader workers).

    A video output with ``num_frames`` is a *decode specification*: the workers decode only the clip's time window
    (PyAV seeking, :func:`~ff_core.data.media.decode.decode_clip`) and put its frames on the grid ``t_k = start + k /
    fps`` (``k < num_frames``) of the clip's clock, taking at each ``t_k`` the source frame ``frame_rule`` picks
    (default: the nearest one). A clip too short for the grid is rejected, never stretched. Images ignore the temporal
    fields.

    Attributes:
        height: pixel rows of an image, or of each video frame.
        width: pixel columns.
        num_frames: frames of a video clip (``None``: every frame the file has, as decoded).
        fps: the frame rate of the grid (``None``: the clip's own clock, i.e. ``num_frames`` consecutive frames).
        start: seconds into the clip (on its clock) where the grid starts.
        frame_rule: how grid times pick source frames (:func:`~ff_core.data.media.decode.clip_source_frames`):
            ``nearest`` (the nearest source frame, ``np.rint``: ties to the even one), ``fps_filter`` (ffmpeg's
            ``fps`` filter, MiniMax H3's official decode) or ``floor`` (the frame at or before, ff's rule before
            issue 23).
    """

    height: int
    width: int
    num_frames: int | None = None
    fps: float | None = None
    start: float = 0.0
    frame_rule: FrameRule = "nearest"

    def __post_init__(self) -> None:
        for key in ("height", "width"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MediaGeometry.{key} must be an integer >= 1, got {value!r}")
        n = self.num_frames
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"MediaGeometry.num_frames must be an integer >= 1 or None, got {n!r}")
        if self.fps is not None and (isinstance(self.fps, bool) or not self.fps > 0):
            raise ValueError(f"MediaGeometry.fps must be > 0 or None, got {self.fps!r}")
        if self.fps is not None and n is None:
            raise ValueError("MediaGeometry.fps needs num_frames (the grid's length)")
        if isinstance(self.start, bool) or not self.start >= 0:
            raise ValueError(f"MediaGeometry.start must be >= 0 seconds, got {self.start!r}")
        if self.frame_rule not in FRAME_RULES:
            raise ValueError(f"MediaGeometry.frame_rule must be one of {FRAME_RULES}, got {self.frame_rule!r}")

    @property
    def is_clip(self) -> bool:
        """Whether a video output is decoded as a fixed clip (``num_frames`` set) rather than whole."""
        return self.num_frames is not None


@dataclass(frozen=True)
class AudioSpan:
    """How much sound an audio output's training target must hold (:meth:`~ff_core.adapter.Adapter.
    resolve_output_geometry`): checked from the file's header before weights load, on the target's clock (its manifest
    ``sample_rate`` when declared: the samples are played at that rate).

    Attributes:
        seconds: the length the adapter cuts (LTX-2: the video clip's ``num_frames / frame_rate``).
        start: where the cut starts, seconds on the clock.
        tolerance: how many seconds short of ``seconds`` the adapter still accepts (and pads with silence).
    """

    seconds: float
    start: float = 0.0
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        for key in ("seconds", "start", "tolerance"):
            value = getattr(self, key)
            if isinstance(value, bool) or not value >= 0:
                raise ValueError(f"AudioSpan.{key} must be >= 0 seconds, got {value!r}")


@dataclass(frozen=True)
class ClipDefaults:
    """A video family's default clip, declared once as its adapter's class attribute
    (:attr:`ff_core.adapter.Adapter.clip_defaults`): the canvas, frame count and rate ``from_pretrained`` takes when
    ``model.adapter_kwargs`` leaves them out (its signature's defaults are written from it), and what the checks
    before weights load fall back on (:meth:`~ff_core.adapter.Adapter.resolve_clip`, the base's
    ``check_adapter_kwargs`` and ``resolve_output_geometry``), so the three never disagree.

    Attributes:
        height: pixel rows (``from_pretrained``'s ``height``).
        width: pixel columns (``width``).
        num_frames: frames of the clip (``num_frames``).
        fps: the frame rate targets are sampled onto and videos written at (the argument :attr:`fps_key`).
        fps_key: the ``from_pretrained`` argument that sets the rate: ``"fps"`` (default; Wan), another name (LTX-2:
            ``"frame_rate"``), or ``None`` when the family's rate is fixed at :attr:`fps` (MiniMax H3: 24).
    """

    height: int
    width: int
    num_frames: int
    fps: float
    fps_key: str | None = "fps"

    def __post_init__(self) -> None:
        for key in ("height", "width", "num_frames"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClipDefaults.{key} must be an integer >= 1, got {value!r}")
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or not self.fps > 0:
            raise ValueError(f"ClipDefaults.fps must be a number > 0, got {self.fps!r}")

    def arguments(self) -> dict[str, int | float]:
        """The defaults by ``from_pretrained`` argument name (``{"height": 480, "width": 832, "num_frames": 81,
        "fps": 16.0}``); without the rate when it is fixed (:attr:`fps_key` ``None``)."""
        found: dict[str, int | float] = {"height": self.height, "width": self.width, "num_frames": self.num_frames}
        if self.fps_key is not None:
            found[self.fps_key] = self.fps
        return found
