"""Target geometry: decoded targets fitted the way diffusers' training scripts fit them, in the loader's processor.

The reference is a hand computation with Pillow alone: ``Image.resize`` of the shorter side to the resolution
(bilinear; the longer side truncated as torchvision's ``Resize(int)`` does), then the crop box torchvision's
``CenterCrop`` takes, ``top = int(round((h - th) / 2.0))``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from ff_core.cli.flow_cli import FlowCLI
from ff_core.contracts import MediaGeometry
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.media.decode import DecodedAudio, DecodedVideo, decode_image
from ff_core.data.media.geometry import fit_image, fit_media
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.data.samples import ConditionedRecords, RecordProcessor
from ff_core.module import FlowModule

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "sd3" / "sft_tiny.yaml"
G32 = MediaGeometry(32, 32)

# (width, height) of the file -> (resized width, height) and Pillow crop box (left, top, right, bottom), by hand.
HAND = {
    (45, 30): ((48, 32), (8, 0, 40, 32)),      # 32 * 45 / 30 = 48; (48 - 32) / 2 = 8
    (30, 45): ((32, 48), (0, 8, 32, 40)),
    (64, 48): ((42, 32), (5, 0, 37, 32)),      # int(42.67) = 42; round(5.0) = 5
    (33, 70): ((32, 67), (0, 18, 32, 50)),     # int(67.88) = 67; round(17.5) = 18 (half to even)
    (30, 31): ((32, 33), (0, 0, 32, 32)),      # int(33.07) = 33; round(0.5) = 0 (half to even)
    (20, 20): ((32, 32), (0, 0, 32, 32)),      # smaller: upscaled, nothing to crop
    (32, 48): ((32, 48), (0, 8, 32, 40)),      # shorter side already 32: crop only
}


def noise_png(path, width, height, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def reference(path, size, box) -> torch.Tensor:
    with Image.open(path) as im:
        rgb = im.convert("RGB")
        if rgb.size != size:
            rgb = rgb.resize(size, Image.BILINEAR)
        return torch.from_numpy(np.asarray(rgb.crop(box)).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("wh", list(HAND), ids=lambda wh: f"{wh[0]}x{wh[1]}")
def test_fit_image_is_shorter_side_resize_then_centre_crop(tmp_path, wh):
    path = noise_png(tmp_path / "a.png", *wh, seed=sum(wh))
    fitted = fit_image(decode_image(path), G32)
    assert fitted.shape == (3, 32, 32) and fitted.dtype == torch.uint8
    assert torch.equal(fitted, reference(path, *HAND[wh]))


def test_non_square_geometry_covers_then_crops(tmp_path):
    """A 45x30 image into a 16-wide, 24-high frame: the height binds (24 / 30 > 16 / 45), so 36x24, then crop."""
    path = noise_png(tmp_path / "a.png", 45, 30, seed=1)
    fitted = fit_image(decode_image(path), MediaGeometry(height=24, width=16))
    assert torch.equal(fitted, reference(path, (36, 24), (10, 0, 26, 24)))


def test_video_frames_are_fitted_frame_by_frame(tmp_path):
    frames = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 30, 45, 3), dtype=np.uint8))
    video = DecodedVideo(frames, 24.0, torch.arange(3, dtype=torch.float64) / 24)
    fitted = fit_media(video, G32)
    assert fitted.fps == 24.0 and fitted.frames.shape == (3, 32, 32, 3)
    for frame, out in zip(frames, fitted.frames):
        path = tmp_path / "frame.png"
        Image.fromarray(frame.numpy()).save(path)
        assert torch.equal(out.permute(2, 0, 1), reference(path, *HAND[(45, 30)]))


def test_fit_media_keeps_unfitted_outputs_and_refuses_audio():
    image = torch.zeros(3, 5, 7, dtype=torch.uint8)
    assert fit_media(image, None) is image
    with pytest.raises(ValueError, match="audio output takes no MediaGeometry"):
        fit_media(DecodedAudio(torch.zeros(1, 8), 8000), G32)
    with pytest.raises(ValueError, match=r"MediaGeometry.width must be an integer >= 1, got 0"):
        MediaGeometry(32, 0)
    assert pickle.loads(pickle.dumps(G32)) == G32


def write_sft_dataset(root, sizes) -> None:
    """A V2 SFT dataset of random-noise target images, one per ``(width, height)`` in ``sizes``."""
    (root / "images").mkdir(parents=True)
    rows = []
    for i, wh in enumerate(sizes):
        noise_png(root / "images" / f"{i}.png", *wh, seed=i)
        rows.append({"schema_version": 2, "input": {"prompt": f"a picture number {i}"}, "supervision": {
            "type": "demonstration", "target": {"media": [{"type": "image", "path": f"images/{i}.png"}]}}})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_record_processor_fits_mixed_targets_to_the_geometry(tmp_path):
    """Wider, taller, smaller and larger targets all reach the batch at the adapter's size, pixel-exact."""
    write_sft_dataset(tmp_path, list(HAND))
    records = load_split(DatasetConfig(name="mixed", dataset_dir=str(tmp_path)), "train", "sft")
    table = ConditionedRecords(records, [{} for _ in records])
    processor = pickle.loads(pickle.dumps(RecordProcessor((G32,))))  # it runs in the loader workers
    for i, wh in enumerate(HAND):
        (target,) = processor.process(table[i])["target"]
        assert torch.equal(target, reference(tmp_path / "images" / f"{i}.png", *HAND[wh]))
    # Without a geometry the target stays as decoded.
    assert RecordProcessor().process(table[0])["target"][0].shape == (3, 30, 45)


class Targets(L.Callback):
    """Keeps (record index, target) of every sample the training loop ran."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen += [(int(i), t[0].cpu()) for i, t in zip(batch["index"], batch["target"])]


def test_mixed_size_dataset_trains_through_ff_fit(tiny_sd3, tmp_path):
    """`ff fit` (the recipe, 2 loader workers) on targets wider, taller, smaller and larger than the resolution: every
    batch reaches the step at 32x32, equal to the hand reference (the unfitted batch failed in encode_output)."""
    data, sizes = tmp_path / "mixed", [*HAND, (100, 40)]
    write_sft_dataset(data, sizes)
    datasets = json.dumps([{"name": "mixed", "dataset_dir": str(data)}])
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", datasets, "--data.per_device_batch_size", "4", "--data.num_workers", "2",
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.default_root_dir", str(tmp_path / "run")])
    targets = Targets()
    cli.trainer.callbacks.append(targets)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2 and len(targets.seen) == 8
    assert sorted(i for i, _ in targets.seen) == list(range(8))  # one epoch: every record once
    for i, target in targets.seen:
        wh = sizes[i]
        size, box = HAND.get(wh, ((80, 32), (24, 0, 56, 32)))  # 100x40: 32 * 100 / 40 = 80; (80 - 32) / 2 = 24
        assert torch.equal(target, reference(data / "images" / f"{i}.png", size, box)), wh


# -- condition images (issue 23, item 3) -------------------------------------------------------------
@pytest.mark.parametrize("resample", ["lanczos", "bilinear"])
@pytest.mark.parametrize(("h", "w"), [(48, 64), (40, 24), (32, 32)])
def test_condition_stretch_is_the_vae_image_processors_resize(resample, h, w):
    """``stretch`` is diffusers' ``VaeImageProcessor.preprocess(image, height, width)`` (``resize_mode="default"``)
    with the pipeline's ``resample`` (Wan I2V: lanczos, LTX-2 I2V: bilinear), compared in [-1, 1] as the VAE gets it."""
    from diffusers.video_processor import VideoProcessor

    from ff_core.data.media.geometry import fit_condition_image

    image = torch.randint(0, 256, (3, h, w), generator=torch.Generator().manual_seed(h * w), dtype=torch.uint8)
    ours = fit_condition_image(image, G32, "stretch", resample)
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    theirs = VideoProcessor(vae_scale_factor=8, resample=resample).preprocess(pil, height=32, width=32)[0]
    torch.testing.assert_close(ours.float() / 127.5 - 1, theirs, rtol=0, atol=1e-6)


def test_condition_cover_is_the_target_rule_and_bad_names_are_refused():
    from ff_core.data.media.geometry import fit_condition_image

    image = torch.randint(0, 256, (3, 48, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    assert torch.equal(fit_condition_image(image, G32, "cover"), fit_image(image, G32))
    with pytest.raises(ValueError, match="condition_resize must be one of"):
        fit_condition_image(image, G32, "crop")
    with pytest.raises(ValueError, match="resample must be one of"):
        fit_condition_image(image, G32, "stretch", "box")
