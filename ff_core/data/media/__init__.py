"""How media become tensors: decoding files, the target geometry an adapter encodes, and what headers tell early.

- :mod:`~ff_core.data.media.decode` — image, video, clip and audio decoders (PyAV, Pillow) and media checks;
- :mod:`~ff_core.data.media.geometry` — decoded targets brought to the adapter's canvas, frame count and rate;
- :mod:`~ff_core.data.media.conditions` — a record's condition side decoded for ``adapter.preprocess``;
- :mod:`~ff_core.data.media.header_cache` — media headers kept across runs;
- :mod:`~ff_core.data.media.target_spans` — targets too short for what the adapter cuts, found from headers;
- :mod:`~ff_core.data.media.buckets` — geometry buckets for mixed resolutions and durations.

The decoders are importable from here (``from ff_core.data.media import decode_media``), as before this package.
"""

from ff_core.data.media.decode import (
    FRAME_RULES,
    MIN_PYAV_FOR_VIDEO,
    DecodedAudio,
    DecodedVideo,
    FrameRule,
    MediaCheck,
    MediaHeader,
    Where,
    check_files_exist,
    check_media,
    clip_source_frames,
    decode_audio,
    decode_clip,
    decode_image,
    decode_media,
    decode_video,
    media_error,
    missing_files,
    probe_media,
    pyav_version,
    require_pyav,
)

__all__ = [
    "FRAME_RULES",
    "MIN_PYAV_FOR_VIDEO",
    "DecodedAudio",
    "DecodedVideo",
    "FrameRule",
    "MediaCheck",
    "MediaHeader",
    "Where",
    "check_files_exist",
    "check_media",
    "clip_source_frames",
    "decode_audio",
    "decode_clip",
    "decode_image",
    "decode_media",
    "decode_video",
    "media_error",
    "missing_files",
    "probe_media",
    "pyav_version",
    "require_pyav",
]
