"""ff_core.audio's one clock for a (video, audio) target pair: the clip's start is its grid time (official seconds at
the declared fps), and a decoded waveform's own start is put on the audio's declared clock, by hand."""

from __future__ import annotations

import torch

from ff_core.audio import audio_clock_offset, clip_clock_start, clock_window
from ff_core.data.media.decode import DecodedAudio, DecodedVideo


def test_the_clip_start_is_its_grid_time_not_the_files_seconds():
    # A clip 0.25 s into the clock of a video declared at 16 fps whose file runs at 8 fps: the file's 0.5 s.
    clip = DecodedVideo(torch.zeros(4, 2, 2, 3, dtype=torch.uint8), 16.0, 0.25 + torch.arange(4) / 16.0,
                        window=(0.5, 1.0))  # fmt: skip
    assert clip_clock_start(clip) == 0.25
    whole = DecodedVideo(torch.zeros(4, 2, 2, 3, dtype=torch.uint8), 8.0, 0.5 + torch.arange(4) / 8.0)
    assert clip_clock_start(whole) == 0.0 and clip_clock_start(torch.zeros(4, 3, 2, 2)) == 0.0


def test_a_decoded_start_is_put_on_the_declared_clock():
    # 0.5 file seconds at 8 kHz is sample 4000, which plays at 0.25 s on a declared 16 kHz clock.
    audio = DecodedAudio(torch.arange(16000, dtype=torch.float32)[None], 8000, declared_sample_rate=16000.0, start=0.5)
    assert audio_clock_offset(audio) == 0.25
    assert audio_clock_offset(DecodedAudio(torch.zeros(1, 10), 8000)) == 0.0
    # The clip at 0.75 s of the clock: 0.5 s after the waveform's first sample, i.e. its sample 8000 (value 8000).
    cut = clock_window(audio.waveform, audio.clock_rate, 0.75 - audio_clock_offset(audio), 0.25, tolerance=0.0,
                       what="t")  # fmt: skip
    assert cut.shape == (1, 4000) and cut[0, 0] == 8000
