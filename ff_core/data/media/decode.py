"""Media decoders: files to CPU tensors (spec: dataset-guide, "Offline V2 records", Ref2VA "Supported entries").

* image -> RGB ``uint8`` tensor (3, H, W), Pillow.
* video -> ``uint8`` frames (F, H, W, 3) with the file's fps and per-frame timestamps, PyAV with threaded
  decoding; ``start`` / ``end`` decode only a time window (seek to the keyframe before ``start``).
  :func:`decode_clip` decodes a fixed clip (frame count, rate, start) for a video target: only its window, its
  frames put on the target's frame grid; a clip too short for it is rejected, never stretched.
* audio -> ``float32`` waveform (channels, samples) at the file's own rate, never resampled here: a manifest
  ``sample_rate`` is a logical source-clock override carried alongside (``declared_sample_rate``); the one
  conversion to the model rate is adapter-owned. A video's soundtrack is its embedded audio stream or a
  separate ``audio_path``.

A missing, truncated or undecodable file raises :class:`~ff_core.errors.DatasetError` naming the record
(``source:line``) and field that referenced it, and the file.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import av
import numpy as np
from PIL import Image, UnidentifiedImageError

from ff_core.contracts import FRAME_RULES, FrameRule, MediaType
from ff_core.data.records.base import MediaItem, Record
from ff_core.errors import DatasetError, raise_collected

if TYPE_CHECKING:  # torch is imported where tensors are built, so `ff data validate` starts without it
    import torch

#: The oldest PyAV that decodes video targets (spec dataset-guide, "Offline V2 records": "Video targets require PyAV 17
#: or newer"); checked where a video is decoded (:func:`require_pyav`), so an image- or audio-only run is unaffected.
MIN_PYAV_FOR_VIDEO = (17, 0)

Where = tuple[Path, int] | None
"""``(source, line)`` of the record that referenced a file (``Record.where``), or ``None``."""
_DECODE_ERRORS = (av.FFmpegError, OSError, ValueError, EOFError)
# Full-scale value of each PCM sample format (PyAV names; a trailing "p" marks the planar variant).
_PCM_SCALE = {"u8": 128.0, "s16": 32768.0, "s32": 2147483648.0, "s64": 9223372036854775808.0, "flt": 1.0, "dbl": 1.0}


# Not frozen: Lightning moves a batch to the device with apply_to_collection, which rebuilds dataclasses field by field
# and refuses frozen ones ("A frozen dataclass was passed to `apply_to_collection`"), so a video or audio training
# target could not reach training_step.
@dataclass
class DecodedAudio:
    """A decoded waveform.

    Attributes:
        waveform: ``float32`` (channels, samples) in [-1, 1], detached CPU tensor.
        sample_rate: the file's own rate (samples per second of ``waveform``).
        declared_sample_rate: the manifest's ``sample_rate`` (logical clock override), or ``None``.
        start: time of the first sample, seconds from the start of the stream.
    """

    waveform: torch.Tensor
    sample_rate: int
    declared_sample_rate: float | None = None
    start: float = 0.0

    @property
    def clock_rate(self) -> float:
        """The rate the samples are meant to be played at: the declared rate when given."""
        return self.declared_sample_rate or float(self.sample_rate)

    @property
    def duration(self) -> float:
        return self.waveform.shape[-1] / self.clock_rate


@dataclass  # not frozen: see DecodedAudio
class DecodedVideo:
    """Decoded video frames.

    Attributes:
        frames: ``uint8`` (F, H, W, 3) RGB frames.
        fps: the file's average frame rate; for a clip (:func:`decode_clip`), the rate of its frame grid.
        timestamps: ``float64`` (F,) presentation time of each frame, seconds from the start of the stream; for a
            clip, the grid times ``start + k / fps`` on the clip's clock.
        declared_fps: the manifest's ``fps`` (logical clock override), or ``None``.
        audio: the soundtrack (embedded stream or separate ``audio_path``), or ``None``.
        source_frames: for a clip, the ``int64`` (F,) index of the source frame each frame was taken from.
        frames_decoded: for a clip, how many frames the decoder produced to build it (the window, from the
            keyframe before it): what seeking saved.
        window: for a clip, the file's seconds ``[start, end)`` it covers (one grid step past its last frame), on the
            file's own time base: where its soundtrack is cut.
    """

    frames: torch.Tensor
    fps: float
    timestamps: torch.Tensor
    declared_fps: float | None = None
    audio: DecodedAudio | None = None
    source_frames: torch.Tensor | None = None
    frames_decoded: int | None = None
    window: tuple[float, float] | None = None

    @property
    def clock_fps(self) -> float:
        return self.declared_fps or self.fps

    @property
    def duration(self) -> float:
        return self.frames.shape[0] / self.clock_fps


def media_error(path: str | Path, referenced_by: Where, field: str | None, reason: str) -> DatasetError:
    """A DatasetError at the referencing record (``source:line: field: file: reason``), else at the file."""
    if referenced_by is not None:
        src, line = referenced_by
        return DatasetError(src, line, field, f"{path}: {reason}")
    return DatasetError(path, None, field, reason)


def _check_file(path: Path, referenced_by: Where, field: str | None) -> None:
    if not path.exists():
        raise media_error(path, referenced_by, field, "file not found")
    if not path.is_file():
        raise media_error(path, referenced_by, field, "not a regular file")


def decode_image(path: str | Path, *, referenced_by: Where = None, field: str | None = None) -> torch.Tensor:
    """Decode an image file to an RGB ``uint8`` tensor (3, H, W).

    Args:
        path: the image file.
        referenced_by: ``(source, line)`` of the record that referenced it, for the error message.
        field: the record field that held the path.
    """
    path = Path(path)
    _check_file(path, referenced_by, field)
    try:
        with Image.open(path) as im:
            im.load()  # decode now, so a truncated file fails here
            array = np.asarray(im.convert("RGB"))
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        raise media_error(path, referenced_by, field, f"cannot decode image: {exc}") from None
    import torch

    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def pyav_version() -> str:
    """The installed PyAV's version string (``av.__version__``), read at call time."""
    return str(getattr(av, "__version__", "0"))


def require_pyav() -> None:
    """Raise one :class:`RuntimeError` naming the installed PyAV when it is older than :data:`MIN_PYAV_FOR_VIDEO`
    (spec dataset-guide: "Video targets require PyAV 17 or newer")."""
    installed = pyav_version()
    if _version_tuple(installed) < MIN_PYAV_FOR_VIDEO:
        need = ".".join(map(str, MIN_PYAV_FOR_VIDEO))
        raise RuntimeError(f"decoding video needs PyAV >= {need}, but PyAV {installed} is installed; "
                           f"upgrade it: pip install 'av>={need}'")  # fmt: skip


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"17.0.1"`` -> ``(17, 0, 1)``; a non-numeric tail (``"17.0.0rc1"``) is cut at its first non-digit."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _stream_offset(stream: av.stream.Stream) -> float:
    return float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0


def _seek(container: av.container.InputContainer, stream: av.stream.Stream, start: float | None) -> None:
    if start:
        # Seek to the keyframe at or before `start`; frames before it are dropped while decoding.
        container.seek(int((start + _stream_offset(stream)) / stream.time_base), stream=stream, backward=True)


def _video_frames(
    path: Path, start: float | None, end: float | None, convert: bool
) -> tuple[list[np.ndarray], list[float], float, int]:
    """Decode video frames in [start, end); returns (rgb arrays, timestamps, file fps, frame count)."""
    arrays, times, count = [], [], 0
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame + slice threading
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 0.0
        offset = _stream_offset(stream)
        _seek(container, stream, start)
        for frame in container.decode(stream):
            t = frame.time - offset if frame.time is not None else count / (fps or 1.0)
            if start is not None and t < start - 1e-6:
                continue
            if end is not None and t >= end - 1e-6:
                break
            count += 1
            times.append(t)
            if convert:
                arrays.append(frame.to_ndarray(format="rgb24"))
        if start is None and end is None and stream.frames and count < stream.frames:
            _check_not_truncated(path, stream.frames, count)
    if not fps and len(times) > 1:
        fps = (len(times) - 1) / (times[-1] - times[0])
    return arrays, times, fps, count


def _check_not_truncated(path: Path, listed: int, decoded: int) -> None:
    """A whole-file decode gave fewer frames than the file's index lists: tell a cut file from a trimmed one.

    A faststart MP4 (index first) cut short keeps an index of every frame; with frame threading the decoder drops
    the frames whose data is missing without an error, so the file would train as a shorter clip. A single-threaded
    decode reports the broken packet (``InvalidDataError``); a file whose edit list legitimately hides frames
    decodes cleanly and is accepted.
    """
    with av.open(str(path)) as container:
        try:
            for _ in container.decode(container.streams.video[0]):
                pass
        except av.FFmpegError as exc:
            raise ValueError(f"truncated or damaged: its index lists {listed} frames but {decoded} decode ({exc})"
                             ) from None


def decode_video(
    path: str | Path,
    *,
    start: float | None = None,
    end: float | None = None,
    declared_fps: float | None = None,
    referenced_by: Where = None,
    field: str | None = None,
) -> DecodedVideo:
    """Decode a video's frames (F, H, W, 3) ``uint8`` with fps and timestamps; no soundtrack.

    Args:
        path: the video file.
        start: first second to decode (``None``: the beginning).
        end: decode frames before this second only (``None``: to the end).
        declared_fps: the manifest's ``fps``, carried alongside.
        referenced_by: ``(source, line)`` of the record that referenced it, for the error message.
        field: the record field that held the path.
    """
    path = Path(path)
    require_pyav()
    _check_file(path, referenced_by, field)
    try:
        arrays, times, fps, count = _video_frames(path, start, end, convert=True)
    except _DECODE_ERRORS as exc:
        raise media_error(path, referenced_by, field, f"cannot decode video: {exc}") from None
    if not count:
        window = "" if start is None and end is None else f" in the window [{start}, {end}) s"
        raise media_error(path, referenced_by, field, f"no video frames decoded{window} (empty or truncated file?)")
    import torch

    frames = torch.from_numpy(np.stack(arrays))
    return DecodedVideo(frames, fps, torch.tensor(times, dtype=torch.float64), declared_fps)


#: How a clip's frame grid picks source frames (:func:`clip_source_frames`).
# Grid arithmetic is in floats (24.0 fps, a 30000/1001 clock): a value within this many frames of a whole or half
# frame counts as on it, so exact ties are decided by the rule, never by rounding noise.
_EPS = 1e-6


def clip_source_frames(
    num_frames: int, fps: float | None, start: float, clock_fps: float, rule: FrameRule = "nearest"
) -> list[int]:
    """The source frame index at each grid time ``t_k = start + k / fps`` (``k < num_frames``) of a clip whose frame
    ``i`` is shown at ``i / clock_fps``. ``fps=None``: the clip's own rate (consecutive frames).

    Rules (``x = t_k * clock_fps``, the grid time in source frames):

    * ``nearest`` (default): the source frame nearest to ``t_k``, ``np.rint(x)``: an exact half-frame tie goes to the
      even frame, as Flow-Factory's LTX-2 codec (``prepare_ltx2_target_video``: ``np.rint(arange(n) * src_fps /
      frame_rate)``) takes it. Ties are found on the exact grid position (within 1e-6 of a frame), so float noise in
      ``start + k / fps`` never decides them.
    * ``fps_filter``: ffmpeg's ``fps`` filter (libavfilter/vf_fps.c, default ``round=near``; MiniMax H3's official
      decode, and diffusers' ``MiniMaxH3Ref2VASetupStep._normalize_video_condition``): every source frame goes to the
      grid slot nearest its own time (half away from zero) and slot ``k`` shows the last frame that went to it or
      before, ``ceil(x + clock_fps / (2 fps)) - 1``. Equal to ``nearest`` at 30 -> 24 fps but at the ties whose
      earlier frame is the even one (grid frames 2, 10, 18, ...: ffmpeg rounds half away from zero); at 60 -> 24
      fps it takes the last of the frames a slot collects (1, 3, 6, 8, ... where ``nearest`` takes 0, 2, 5, 8, ...),
      and other rates can part by a frame too (24 -> 30 fps: grid frame 2 holds source frame 1, the nearest is 2).
    * ``floor``: the frame at or before ``t_k``, ``floor(x)`` (ff before issue 23; torchvision's
      ``_resample_video_idx`` and Flow-Factory's ``load_video_frames``: ``int(i * step)``).

    The mapping depends on these five values only, so every epoch and every worker takes the same frames.

    Args:
        num_frames: frames of the grid.
        fps: the grid's rate, or ``None`` for the clip's own.
        start: seconds on the clip's clock where the grid starts.
        clock_fps: the clip's clock (frame ``i`` at ``i / clock_fps``).
        rule: ``nearest``, ``fps_filter`` or ``floor``.
    """
    if rule not in FRAME_RULES:
        raise ValueError(f"frame rule must be one of {FRAME_RULES}, got {rule!r}")
    rate = clock_fps if fps is None else fps
    out = []
    for k in range(num_frames):
        x = (start + k / rate) * clock_fps
        if rule == "nearest":
            below = int(np.floor(x + _EPS))
            tie = abs(x - below - 0.5) <= _EPS
            out.append(below + (below % 2) if tie else int(np.floor(x + 0.5)))
        elif rule == "fps_filter":
            out.append(int(np.ceil(x + clock_fps / (2 * rate) - _EPS)) - 1)
        else:
            out.append(int(np.floor(x + _EPS)))
    return out


def _clip_frames(
    path: Path, num_frames: int, fps: float | None, start: float, declared_fps: float | None, rule: FrameRule
) -> tuple[dict[int, np.ndarray], list[int], float, float, int, int]:
    """Decode the source frames a clip needs, seeking to the window; returns (frames by source index, the grid's
    source indices, file fps, clock fps, frames decoded, source frames seen (the clip's length when it ended early)).
    """
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate:
            raise ValueError("the stream states no frame rate: a clip cannot be put on a frame grid")
        file_fps = float(rate)
        clock = declared_fps or file_fps
        indices = clip_source_frames(num_frames, fps, start, clock, rule)
        wanted, first, last = set(indices), indices[0], indices[-1]
        if stream.frames and stream.frames <= last:  # the header's frame count already says it is too short
            return {}, indices, file_fps, clock, 0, stream.frames
        offset = _stream_offset(stream)
        # Source frame i sits at i / file_fps in the file whatever the declared clock (frames are counted, not timed).
        _seek(container, stream, first / file_fps)
        frames: dict[int, np.ndarray] = {}
        decoded, seen = 0, 0
        for frame in container.decode(stream):
            decoded += 1
            index = round((frame.time - offset) * file_fps) if frame.time is not None else decoded - 1
            seen = max(seen, index + 1)
            if index in wanted:
                frames[index] = frame.to_ndarray(format="rgb24")
            if index >= last:
                break
    return frames, indices, file_fps, clock, decoded, seen


def decode_clip(
    path: str | Path,
    *,
    num_frames: int,
    fps: float | None = None,
    start: float = 0.0,
    declared_fps: float | None = None,
    rule: FrameRule = "nearest",
    referenced_by: Where = None,
    field: str | None = None,
) -> DecodedVideo:
    """Decode the clip a video target is trained on: ``num_frames`` frames on the grid ``t_k = start + k / fps`` of
    the clip's clock (the manifest's ``fps`` when declared, else the file's; frame ``i`` at ``i / clock``), each picked
    by ``rule`` (:func:`clip_source_frames`; default: the nearest source frame). Only the window is decoded: PyAV
    seeks to the keyframe before its first frame and stops after its last. A clip too short for the grid is an error
    naming the file, its duration and what the grid needs; it is never stretched. No soundtrack
    (:func:`decode_media`).

    Args:
        path: the video file.
        num_frames: frames of the clip.
        fps: the grid's rate (``None``: consecutive source frames, the clip's own rate).
        start: seconds on the clip's clock where the grid starts.
        declared_fps: the manifest's ``fps``: the clip's clock when it differs from the file's rate.
        rule: how grid times pick source frames: ``nearest``, ``fps_filter`` or ``floor`` (:func:`clip_source_frames`).
        referenced_by: ``(source, line)`` of the record that referenced it, for the error message.
        field: the record field that held the path.
    """
    path = Path(path)
    require_pyav()
    _check_file(path, referenced_by, field)
    try:
        frames, indices, file_fps, clock, decoded, seen = _clip_frames(path, num_frames, fps, start, declared_fps, rule)
    except _DECODE_ERRORS as exc:
        raise media_error(path, referenced_by, field, f"cannot decode video: {exc}") from None
    if indices[-1] not in frames:
        rate = f"{fps:g} fps" if fps is not None else "the clip's rate"
        need = indices[-1] / clock
        raise media_error(
            path, referenced_by, field,
            f"video too short: {num_frames} frames at {rate} from {start:g} s need the source frame at {need:.3f} s "
            f"(frame {indices[-1]} at {clock:g} fps), but it has {seen} frames ({seen / clock:.3f} s); "
            "clips are never stretched: drop the record, or lower num_frames / fps",
        )
    import torch

    grid_fps = fps if fps is not None else clock
    # Clock seconds -> file seconds: source frame i is at i / clock on the clock and i / file_fps in the file.
    to_file = clock / file_fps
    return DecodedVideo(
        frames=torch.from_numpy(np.stack([frames[i] for i in indices])),
        fps=grid_fps,
        timestamps=start + torch.arange(num_frames, dtype=torch.float64) / grid_fps,
        source_frames=torch.tensor(indices, dtype=torch.int64),
        frames_decoded=decoded,
        window=(start * to_file, (start + num_frames / grid_fps) * to_file),
    )


def _pcm(frame: av.AudioFrame) -> np.ndarray:
    """One audio frame as float32 (channels, samples), whatever its sample format."""
    array = frame.to_ndarray()
    channels = frame.layout.nb_channels
    if not frame.format.is_planar:  # packed: (1, samples * channels), interleaved
        array = array.reshape(-1, channels).T
    name = frame.format.name.rstrip("p")
    out = array.astype(np.float32)
    if name == "u8":
        out -= 128.0
    return out / _PCM_SCALE[name] if _PCM_SCALE.get(name, 1.0) != 1.0 else out


def _audio_samples(
    path: Path, start: float | None, end: float | None, convert: bool
) -> tuple[list[np.ndarray], int, int, float] | None:
    """Decode the first audio stream in [start, end); ``None`` when the file has no audio stream."""
    chunks, total, first = [], 0, None
    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        stream.thread_type = "AUTO"
        rate = stream.rate
        offset = _stream_offset(stream)
        _seek(container, stream, start)
        decoded = 0
        for frame in container.decode(stream):
            t0 = frame.time - offset if frame.time is not None else decoded / rate
            decoded += frame.samples
            lo = 0 if start is None else max(0, round((start - t0) * rate))
            hi = frame.samples if end is None else min(frame.samples, round((end - t0) * rate))
            if hi <= 0 and end is not None:
                break
            if lo >= hi:
                continue
            first = t0 + lo / rate if first is None else first
            total += hi - lo
            if convert:
                chunks.append(_pcm(frame)[:, lo:hi])
    return chunks, total, rate, first or 0.0


def decode_audio(
    path: str | Path,
    *,
    start: float | None = None,
    end: float | None = None,
    declared_sample_rate: float | None = None,
    referenced_by: Where = None,
    field: str | None = None,
    required: bool = True,
) -> DecodedAudio | None:
    """Decode the first audio stream of a file (a WAV, or a video's embedded soundtrack), never resampled.

    Args:
        path: an audio file, or a video file with an audio stream.
        start: first second to decode (``None``: the beginning).
        end: decode samples before this second only (``None``: to the end).
        declared_sample_rate: the manifest's ``sample_rate``, carried alongside (a logical clock).
        referenced_by: ``(source, line)`` of the record that referenced it, for the error message.
        field: the record field that held the path.
        required: raise when the file has no audio stream (``False``: return ``None``).
    """
    path = Path(path)
    _check_file(path, referenced_by, field)
    try:
        result = _audio_samples(path, start, end, convert=True)
    except _DECODE_ERRORS as exc:
        raise media_error(path, referenced_by, field, f"cannot decode audio: {exc}") from None
    if result is None:
        if required:
            raise media_error(path, referenced_by, field, "no audio stream")
        return None
    chunks, total, rate, first = result
    if not total:
        raise media_error(path, referenced_by, field, "no audio samples decoded (empty or truncated file?)")
    import torch

    waveform = torch.from_numpy(np.ascontiguousarray(np.concatenate(chunks, axis=1)))
    return DecodedAudio(waveform, rate, declared_sample_rate, first)


def decode_media(
    item: MediaItem,
    *,
    referenced_by: Where = None,
    field: str | None = None,
    start: float | None = None,
    end: float | None = None,
) -> torch.Tensor | DecodedVideo | DecodedAudio:
    """Decode one media item by its ``type``; a video comes with its soundtrack when it has one.

    A video's soundtrack is its separate ``audio_path`` (required to decode, with the item's ``sample_rate``
    as declared clock) or else its embedded audio stream, if any (spec: Ref2VA "Supported entries").
    """
    field = field if field is not None else item.field_of("path")
    if item.type is MediaType.IMAGE:
        return decode_image(item.path, referenced_by=referenced_by, field=field)
    if item.type is MediaType.AUDIO:
        return decode_audio(item.path, start=start, end=end, declared_sample_rate=item.sample_rate,
                            referenced_by=referenced_by, field=field)
    video = decode_video(item.path, start=start, end=end, declared_fps=item.fps, referenced_by=referenced_by,
                         field=field)
    if item.audio_path is not None:
        audio_field = item.field_of("audio_path") or field
        audio = decode_audio(item.audio_path, start=start, end=end, declared_sample_rate=item.sample_rate,
                             referenced_by=referenced_by, field=audio_field)
    else:
        audio = decode_audio(item.path, start=start, end=end, referenced_by=referenced_by, field=field, required=False)
    return DecodedVideo(video.frames, video.fps, video.timestamps, video.declared_fps, audio)


@dataclass(frozen=True)
class MediaCheck:
    """What decoding one file fully found (``ff data validate --check-media``).

    Attributes:
        type: the item's media type.
        video_seconds: decoded video duration (frames / fps), or 0.
        audio_seconds: decoded audio duration (samples / rate) of the file or soundtrack, or 0.
    """

    type: MediaType
    video_seconds: float = 0.0
    audio_seconds: float = 0.0


def check_media(item: MediaItem, *, referenced_by: Where = None, field: str | None = None) -> MediaCheck:
    """Open and decode every frame / sample of an item's files without keeping them; return durations.

    Every file of the item is checked, so a video and its separate ``audio_path`` that are both missing are
    both reported (raised together as :class:`~ff_core.errors.DatasetErrors`).
    """
    field = field if field is not None else item.field_of("path")
    if item.type is MediaType.IMAGE:
        decode_image(item.path, referenced_by=referenced_by, field=field)
        return MediaCheck(item.type)
    if item.type is MediaType.VIDEO:
        require_pyav()
    video = audio = 0.0
    errors: list[DatasetError] = []
    for path, is_video, fld in _files_to_check(item, field):
        try:
            v, a = _check_stream_file(item, path, is_video, referenced_by, fld)
        except DatasetError as exc:
            errors.append(exc)
            continue
        video, audio = video + v, audio + a
    raise_collected(errors)
    return MediaCheck(item.type, video, audio)


def _check_stream_file(
    item: MediaItem, path: Path, is_video: bool, referenced_by: Where, field: str | None
) -> tuple[float, float]:
    """Decode one file of a video / audio item fully; return its (video, audio) seconds."""
    _check_file(path, referenced_by, field)
    video = audio = 0.0
    try:
        if is_video:
            _, _, fps, count = _video_frames(path, None, None, convert=False)
            if not count:
                raise ValueError("no video frames decoded (empty or truncated file?)")
            video = count / (item.fps or fps or 1.0)
        result = _audio_samples(path, None, None, convert=False)
    except _DECODE_ERRORS as exc:
        what = "video" if is_video else "audio"
        raise media_error(path, referenced_by, field, f"cannot decode {what}: {exc}") from None
    if result is None and not is_video:
        raise media_error(path, referenced_by, field, "no audio stream")
    if result is not None and not result[1] and not is_video:
        raise media_error(path, referenced_by, field, "no audio samples decoded (empty or truncated file?)")
    # A video's embedded soundtrack counts unless a separate audio_path replaces it.
    if result is not None and (not is_video or item.audio_path is None):
        audio = result[1] / (item.sample_rate if not is_video and item.sample_rate else result[2])
    return video, audio


def missing_files(record_or_where: Record | tuple[Path, int], item: MediaItem) -> list[DatasetError]:
    """A cheap existence check (no decoding) of an item's files; one error per missing file, at the field the
    user wrote (``image`` for a bare string column, ``references[0].audio_path`` for an object key)."""
    src, line = record_or_where.where if isinstance(record_or_where, Record) else record_or_where
    return [DatasetError(src, line, fld, f"{p}: file not found") for p, fld in item.file_fields() if not p.is_file()]


def check_files_exist(records: list[Record]) -> None:
    """Raise DatasetErrors naming every referenced media file that does not exist (before weights load)."""
    raise_collected([e for r in records for _, item in r.media() for e in missing_files(r, item)])


def _files_to_check(item: MediaItem, field: str | None) -> Iterator[tuple[Path, bool, str | None]]:
    yield item.path, item.type is MediaType.VIDEO, field
    if item.audio_path is not None:
        yield item.audio_path, False, item.field_of("audio_path") or field


# ---------------------------------------------------------------------------------------------------------
# Headers only (``ff data inspect``): sizes, durations and rates without decoding frames or samples.
@dataclass(frozen=True)
class MediaHeader:
    """What a media file's header says.

    Attributes:
        type: how the file was read: ``image``, ``video`` (first video stream) or ``audio`` (first audio stream).
        width: pixels across an image or a video's frames, else ``None``.
        height: pixels down an image or a video's frames, else ``None``.
        seconds: the stream's duration (the container's when the stream does not say), or ``None``.
        fps: a video's average frame rate, or ``None``.
        sample_rate: an audio stream's rate in samples per second, or ``None``.
        channels: an audio stream's channel count, or ``None``.
    """

    type: MediaType
    width: int | None = None
    height: int | None = None
    seconds: float | None = None
    fps: float | None = None
    sample_rate: int | None = None
    channels: int | None = None


def probe_media(
    path: str | Path, mtype: MediaType, *, referenced_by: Where = None, field: str | None = None
) -> MediaHeader:
    """Read a file's header (Pillow's lazy open, PyAV's container probe); no frame or sample is decoded in full.

    Args:
        path: the file.
        mtype: what the record says it is (a Ref2VA video's separate ``audio_path`` is read as ``audio``).
        referenced_by: ``(source, line)`` of the record that referenced it, for the error message.
        field: the record field that held the path.
    """
    path = Path(path)
    _check_file(path, referenced_by, field)
    try:
        if mtype is MediaType.IMAGE:
            with Image.open(path) as im:  # parses the header; pixels are decoded by load(), never called here
                return MediaHeader(mtype, width=im.width, height=im.height)
        with av.open(str(path)) as container:
            return _stream_header(container, mtype)
    except (*_DECODE_ERRORS, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise media_error(path, referenced_by, field, f"cannot read {mtype.value} header: {exc}") from None


def _stream_header(container: av.container.InputContainer, mtype: MediaType) -> MediaHeader:
    streams = container.streams.video if mtype is MediaType.VIDEO else container.streams.audio
    if not streams:
        raise ValueError(f"no {mtype.value} stream")
    stream = streams[0]
    if stream.duration is not None and stream.time_base is not None:
        seconds: float | None = float(stream.duration * stream.time_base)
    else:
        seconds = container.duration / av.time_base if container.duration is not None else None
    if mtype is MediaType.VIDEO:
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        return MediaHeader(mtype, width=stream.codec_context.width, height=stream.codec_context.height,
                           seconds=seconds, fps=float(rate) if rate else None)
    ctx = stream.codec_context
    return MediaHeader(mtype, seconds=seconds, sample_rate=ctx.sample_rate or None,
                       channels=ctx.layout.nb_channels if ctx.layout is not None else None)
