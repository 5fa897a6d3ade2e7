"""What ``ff fit`` and ``ff data validate --model`` refuse before any LTX-2 weight loads: bad ``adapter_kwargs``
(geometry against the checkpoint's configs), ``frozen_components`` / ``component_weights`` naming no latent component,
and training targets too short for the clip, found from their headers (PyAV container metadata)."""

from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from ff_ltx2 import LTX2I2AVAdapter, LTX2T2AVAdapter
from ff_ltx2.testing import write_av_clips
from ltx2_geometry import ADAPTER_KWARGS

from ff_core.callbacks.media_log import audio_to_wav
from ff_core.cli import main
from ff_core.errors import ConfigError
from ff_core.module import FlowModule
from ff_core.objectives import SFTObjective
from ff_core.testing.moving_shapes import write_mp4
from ff_core.testing.recipes import fit_tiny

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
NOWHERE = "/nonexistent/ltx2-checkpoint"


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight load (every component comes through ``_components``) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the configuration was checked")

    for cls in (LTX2T2AVAdapter, LTX2I2AVAdapter):
        monkeypatch.setattr(cls, "_components", classmethod(refuse))


@pytest.mark.parametrize(("adapter", "kwargs", "message"), [
    ("ltx2_t2av", {"num_frame": 9}, r"model\.adapter_kwargs\.num_frame: ltx2_t2av takes no such argument; it takes "
                                    r"image_crf, height, width, num_frames, frame_rate"),
    ("ltx2_t2av", {"frame_rate": 0}, r"model\.adapter_kwargs\.frame_rate: must be a number > 0, got 0"),
    ("ltx2_t2av", {"height": 0}, r"model\.adapter_kwargs\.height: must be an integer >= 1, got 0"),
    ("ltx2_t2av", {"num_frames": 9.5}, r"model\.adapter_kwargs\.num_frames: must be an integer >= 1, got 9\.5"),
    ("ltx2_t2av", {"audio_tolerance": -1}, r"model\.adapter_kwargs\.audio_tolerance: must be a number >= 0"),
    ("ltx2_t2av", {"target_posterior": "mean"}, r"model\.adapter_kwargs\.target_posterior: must be one of mode, "
                                                r"sample, got 'mean'"),
    ("ltx2_t2av", {"dtype": "float8"}, r"model\.adapter_kwargs\.dtype: unknown dtype 'float8'; expected one of"),
    ("ltx2_t2av", {"image_crf": 20}, r"model\.adapter_kwargs\.image_crf: ltx2_t2av takes no condition image"),
    ("ltx2_i2av", {"image_crf": -3}, r"model\.adapter_kwargs\.image_crf: must be an integer >= 0"),
])  # fmt: skip
def test_adapter_kwargs_needing_no_checkpoint_fail_as_the_module_is_built(adapter, kwargs, message, no_weights):
    """The checkpoint does not exist: the error is still the key's (checked first), not the path's."""
    with pytest.raises(ConfigError, match=message):
        FlowModule(adapter, NOWHERE, adapter_kwargs={**ADAPTER_KWARGS, **kwargs})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_frames": 10}, r"model\.adapter_kwargs\.num_frames: \(num_frames - 1\) must be divisible by 2 .*valid: "
                         r"3, 5, 7"),
    ({"height": 36}, r"model\.adapter_kwargs\.height: must be a multiple of 8"),
    ({"width": 20}, r"model\.adapter_kwargs\.width: must be a multiple of 8"),
])  # fmt: skip
def test_geometry_the_checkpoint_cannot_encode_fails_before_weights_load(tiny_ltx2, tmp_path, kwargs, message,
                                                                         no_weights, capsys):  # fmt: skip
    """Against the tiny checkpoint's vae/ and transformer/ configs (8x spatial, 2x temporal compression, patch 1):
    ``ff fit`` (its data module's set-up), ``ff data validate --model --pretrained --adapter-kwargs`` and
    ``from_pretrained`` itself, none loading a weight."""
    clips = write_av_clips(tmp_path / "clips", 2)
    bad = {**ADAPTER_KWARGS, **kwargs}
    with pytest.raises(ConfigError, match=message):
        fit_tiny(CONFIGS / "sft_tiny.yaml", tiny_ltx2("t2av"), [{"name": "clips", "dataset_dir": str(clips)}],
                 tmp_path / "run", "--model.adapter_kwargs", json.dumps(bad))  # fmt: skip
    assert main(["data", "validate", str(clips), "--model", "ltx2_t2av", "--pretrained", str(tiny_ltx2("t2av")),
                 "--adapter-kwargs", json.dumps(bad)]) == 2  # fmt: skip
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and out.startswith("ff data validate: model.adapter_kwargs.")
    with pytest.raises(ConfigError, match=message):
        LTX2T2AVAdapter.from_pretrained(tiny_ltx2("t2av"), **bad)


@pytest.mark.parametrize(("frozen", "weights", "message"), [
    (["speech"], None, r"model\.frozen_components: 'speech' is not a latent component of ltx2_t2av; they are "
                       r"\['video', 'audio'\]"),
    ([], "guidance_scale", r"model\.sampling\.guidance_scale: names \['speech', 'video'\]; ltx2_t2av's latent "
                           r"components are \['video', 'audio'\]"),
    ([], "guidance_rescale", r"model\.sampling\.guidance_rescale: names \['video'\]"),
    ([], {"video": 1.0, "speech": 1.0}, r"model\.objective\.init_args\.component_weights: names \['speech', "
                                        r"'video'\]; ltx2_t2av's latent components are \['video', 'audio'\]"),
    (["audio"], {"video": 1.0}, r"component_weights: names \['video'\]; ltx2_t2av's latent components are"),
])  # fmt: skip
def test_component_names_fail_as_the_module_is_built(frozen, weights, message, no_weights):
    """``Adapter.latent_components`` (a class attribute) names them: no checkpoint needed (this one does not exist)."""
    from ff_core.module import SamplingConfig

    sampling = {"guidance_scale": SamplingConfig(guidance_scale={"video": 3.0, "speech": 7.0}),
                "guidance_rescale": SamplingConfig(guidance_rescale={"video": 0.7})}.get(str(weights))
    weights = weights if isinstance(weights, dict) else None
    with pytest.raises(ConfigError, match=message):
        FlowModule("ltx2_t2av", NOWHERE, adapter_kwargs=ADAPTER_KWARGS, frozen_components=frozen,
                   objective=SFTObjective(component_weights=weights), sampling=sampling)  # fmt: skip


# -- targets too short for the clip, from their headers -----------------------------------------------------
def _shorten(clips: Path, root: Path, how: str) -> Path:
    """A copy of ``clips`` whose second record's target is too short for a 9-frame 8 fps (1.125 s) clip."""
    shutil.copytree(clips, root)
    lines = (root / "train.jsonl").read_text().splitlines()
    record = json.loads(lines[1])
    video, audio = record["supervision"]["target"]["media"]
    if how == "audio":  # 0.75 s of the file's 22.05 kHz
        tone = torch.zeros(1, int(0.75 * 22050))
        (root / audio["path"]).write_bytes(audio_to_wav(tone, 22050))
    elif how == "declared_rate":  # 1.5 s at 22.05 kHz played at a declared 44.1 kHz: 0.75 s on its clock
        audio["sample_rate"] = 44100
    elif how == "video":  # 6 frames at 8 fps
        write_mp4(root / video["path"], np.full((6, 32, 32, 3), 96, np.uint8), 8.0)
    lines[1] = json.dumps(record)
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize(("how", "message"), [
    ("video", r"train\.jsonl:2: supervision\.target\.media\[0\]\.path: .*videos/001\.mp4: video too short: 9 frames "
              r"at 8 fps from 0 s, but the file holds 0\.750 s"),
])  # fmt: skip
def test_too_short_targets_fail_at_setup_naming_file_line_and_field(tiny_ltx2, tmp_path, how, message, no_weights,
                                                                    capsys):  # fmt: skip
    clips = write_av_clips(tmp_path / "clips", 2)
    kwargs = json.dumps(ADAPTER_KWARGS)
    assert main(["data", "validate", str(clips), "--model", "ltx2_t2av", "--adapter-kwargs", kwargs]) == 0
    capsys.readouterr()
    bad = _shorten(clips, tmp_path / how, how)
    assert main(["data", "validate", str(bad), "--model", "ltx2_t2av", "--adapter-kwargs", kwargs]) == 2
    out = capsys.readouterr()
    assert any(__import__("re").search(message, line) for line in (out.out + out.err).splitlines()), out
    with pytest.raises(Exception, match=message):
        fit_tiny(CONFIGS / "sft_tiny.yaml", tiny_ltx2("t2av"), [{"name": "bad", "dataset_dir": str(bad)}],
                 tmp_path / "run")


@pytest.mark.parametrize(("how", "message"), [
    ("audio", r"train\.jsonl:2: note: supervision\.target\.media\[1\]\.path: .*audios/001\.wav: audio shorter than "
              r"the clip: it holds 0\.750 s from 0 s, the clip needs 1\.125 s; the adapter right-pads it with 0\.375 s "
              r"of silence"),
    ("declared_rate", r"train\.jsonl:2: note: supervision\.target\.media\[1\]\.path: .*audio shorter than the clip: "
                      r"it holds 0\.750 s played at its declared 44100 Hz"),
])  # fmt: skip
def test_audio_shorter_than_the_clip_is_a_note_and_padded_not_an_error(tmp_path, how, message, no_weights, capsys):
    """Flow-Factory trims or right-pads LTX-2's target audio onto the clip's clock, never rejects it: ``ff data
    validate`` passes and notes each short soundtrack (``ff fit``'s set-up, the same header check, passes too).
    ``audio_tolerance`` brings back the old rejection (``0.05`` s, the former default)."""
    from ff_core.data.media.target_spans import target_span_errors
    from ff_core.data.records.sources import DatasetConfig, load_split

    bad = _shorten(write_av_clips(tmp_path / "clips", 2), tmp_path / how, how)
    kwargs = json.dumps(ADAPTER_KWARGS)
    assert main(["data", "validate", str(bad), "--model", "ltx2_t2av", "--adapter-kwargs", kwargs]) == 0
    out = capsys.readouterr().out
    assert any(__import__("re").search(message, line) for line in out.splitlines()), out
    assert "OK against 'ltx2_t2av'" in out
    records = load_split(DatasetConfig(name="bad", dataset_dir=str(bad)), "train", None)
    assert target_span_errors(records, LTX2T2AVAdapter.resolve_output_geometry(None, ADAPTER_KWARGS)) == []
    strict = json.dumps({**ADAPTER_KWARGS, "audio_tolerance": 0.05})
    assert main(["data", "validate", str(bad), "--model", "ltx2_t2av", "--adapter-kwargs", strict]) == 2
    assert "audio too short: it holds 0.750 s" in capsys.readouterr().out


def test_validate_checks_against_the_adapters_default_clip(tmp_path, capsys):
    """Without ``--adapter-kwargs``, LTX-2's own clip (121 frames at 24 fps, 5.04 s): the 1.5 s clips are too short
    (the videos an error, the soundtracks a note: padded with silence)."""
    clips = write_av_clips(tmp_path / "clips", 2)
    assert main(["data", "validate", str(clips), "--model", "ltx2_t2av"]) == 2
    out = capsys.readouterr().out
    assert "video too short: 121 frames at 24 fps" in out and "note: " in out and "audio shorter than the clip" in out
    with wave.open(str(clips / "audios" / "000.wav")) as w:  # the check read the header, the file is whole
        assert w.getnframes() == int(1.5 * 22050)
