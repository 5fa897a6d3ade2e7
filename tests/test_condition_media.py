"""Condition media reach ``adapter.preprocess`` decoded, in record order, with the slots contract validation binds,
for training (V2 ``input.media``) and evaluation (legacy ``image`` / ``images`` columns)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from image_conditioned_adapter import ImageConditionedSD3
from PIL import Image

from ff_core.cli.flow_cli import FlowCLI
from ff_core.contracts import IMAGE_OUT, MediaType, PipelineIOContract, ReferenceSpec
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.media.conditions import condition_input
from ff_core.data.media.decode import decode_image
from ff_core.data.records.sources import DatasetConfig, load_split
from ff_core.errors import DatasetErrors
from ff_core.module import FlowModule

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "sd3" / "sft_tiny.yaml"
ADAPTER = "image_conditioned_adapter:ImageConditionedSD3"  # tests/ is on sys.path (rootdir conftest)
CONTRACT = ImageConditionedSD3.io_contract  # slots `reference` (required), `style` (optional)

# Training records: input.media as written (path, explicit slot or None) and the binding each item must arrive with.
TRAIN = [
    [("cond/t0_style.png", "style"), ("cond/t0_ref.png", None)],      # unslotted fills the free `reference`
    [("cond/t1_ref.png", None)],                                       # unslotted, first slot
    [("cond/t2_ref.png", "reference"), ("cond/t2_style.png", None)],  # unslotted fills the free `style`
    [("cond/t3_ref.png", "reference")],
]
BOUND = [["style", "reference"], ["reference"], ["reference", "style"], ["reference"]]
# Evaluation rows (legacy): images fill the slots positionally.
EVAL = [{"prompt": "e0", "images": ["e0_ref.png", "e0_style.png"]}, {"prompt": "e1", "image": "e1_ref.png"}]


def colour(name: str) -> tuple[int, int, int]:
    """A distinct solid colour per file name (the hand reference for its mean colour)."""
    h = sum(ord(c) * (i + 1) for i, c in enumerate(name))
    return (h % 251, (h * 7) % 241, (h * 13) % 239)


def solid_png(path: Path, width: int, height: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), colour(path.name)).save(path)


@pytest.fixture
def conditioned_dir(tmp_path) -> Path:
    """V2 training records with condition images (each its own size) and a legacy evaluation split with images."""
    rows = []
    for i, media in enumerate(TRAIN):
        for j, (path, _) in enumerate(media):
            solid_png(tmp_path / path, 6 + i, 8 + j)  # condition media arrive as decoded, at their own size
        Image.new("RGB", (32, 32), (i * 40, 0, 0)).save(tmp_path / "cond" / f"target{i}.png")
        items = [{"type": "image", "path": p, **({"slot": s} if s else {})} for p, s in media]
        rows.append({"schema_version": 2, "input": {"prompt": f"picture {i}", "media": items}, "supervision": {
            "type": "demonstration", "target": {"media": [{"type": "image", "path": f"cond/target{i}.png"}]}}})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for row in EVAL:
        for name in row.get("images", [row.get("image")]):
            solid_png(tmp_path / "images" / name, 5, 7)
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVAL))
    return tmp_path


def expected(paths_by_slot: dict[str, str]) -> dict[str, torch.Tensor]:
    """Hand reference of the toy adapter's condition tensors: each slot's solid colour, -1 for an empty slot."""
    return {f"{slot}_colour": torch.tensor(colour(Path(paths_by_slot[slot]).name), dtype=torch.float32)
            if slot in paths_by_slot else torch.full((3,), -1.0) for slot in ("reference", "style")}


def test_condition_input_carries_decoded_media_in_record_order_with_bound_slots(conditioned_dir):
    config = DatasetConfig(name="c", dataset_dir=str(conditioned_dir), eval={})
    for record, media, slots in zip(load_split(config, "train", "sft"), TRAIN, BOUND):
        found = condition_input(record, CONTRACT)
        assert found.prompt == record.prompt and [m["slot"] for m in found.media] == slots
        assert [m["path"] for m in found.media] == [conditioned_dir / p for p, _ in media]
        for m, (path, _) in zip(found.media, media):
            assert m["type"] == "image" and torch.equal(m["data"], decode_image(conditioned_dir / path))
    e0, e1 = (condition_input(r, CONTRACT) for r in load_split(config, "test", None))
    assert [(m["path"].name, m["slot"]) for m in e0.media] == [("e0_ref.png", "reference"), ("e0_style.png", "style")]
    assert [(m["path"].name, m["slot"]) for m in e1.media] == [("e1_ref.png", "reference")]
    # Ordered references bind by list order: no slot key.
    refs = PipelineIOContract(outputs=(IMAGE_OUT,), references=ReferenceSpec(types=frozenset({MediaType.IMAGE})))
    assert all("slot" not in m for m in condition_input(load_split(config, "test", None)[0], refs).media)


def test_condition_input_passes_the_declared_overrides(tmp_path):
    """A record's declared fps / sample_rate / audio_path reach preprocess beside the decoded media, only where written
    (what an adapter keeps for identity, e.g. MiniMax H3 Ref2VA's reference_manifest)."""
    from ff_core.callbacks.media_log import audio_to_wav
    from ff_core.testing.clips import write_grey_mp4

    write_grey_mp4(tmp_path / "m.mp4", 4, 12)
    (tmp_path / "s.wav").write_bytes(audio_to_wav(torch.zeros(1, 800), 8000))
    solid_png(tmp_path / "a.png", 4, 4)
    refs = [{"type": "video", "path": "m.mp4", "fps": 12, "audio_path": "s.wav", "sample_rate": 16000},
            {"type": "audio", "path": "s.wav"}, {"type": "image", "path": "a.png"}]
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "p", "references": refs}) + "\n")
    (record,) = load_split(DatasetConfig(name="r", dataset_dir=str(tmp_path), eval={}), "test", None)
    contract = PipelineIOContract(outputs=(IMAGE_OUT,), references=ReferenceSpec())
    video, audio, image = condition_input(record, contract).media
    assert (video["fps"], video["sample_rate"], video["audio_path"]) == (12.0, 16000.0, tmp_path / "s.wav")
    assert video["data"].declared_fps == 12.0 and video["data"].audio.declared_sample_rate == 16000.0
    assert not {"fps", "sample_rate", "audio_path"} & (set(audio) | set(image))


def test_condition_input_refuses_a_binding_that_fails_validation(conditioned_dir):
    """Reached without the data module's validation (no adapter name): the slot problem names file, line, field."""
    (record,) = load_split(DatasetConfig(name="c", dataset_dir=str(conditioned_dir)), "train", "sft")[:1]
    one_slot = PipelineIOContract(outputs=(IMAGE_OUT,), slots=CONTRACT.slots[:1])
    with pytest.raises(DatasetErrors, match=r"train\.jsonl:1: input\.media\[0\]\.slot: unknown slot 'style'"):
        condition_input(record, one_slot)


class Conditions(L.Callback):
    """Keeps (record index, condition tensors) of every sample the training loop ran."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, torch.Tensor]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for j, index in enumerate(batch["index"].tolist()):
            self.seen.append((index, {k: batch["condition"][k][j].cpu() for k in ("reference_colour", "style_colour")}))


def test_condition_media_reach_preprocess_in_training_and_evaluation(tiny_sd3, conditioned_dir, tmp_path):
    """`ff fit` with an image-conditioned adapter (dotted path): each record's condition tensors come from its own
    condition files, in the slot each item binds to; the evaluation loader's conditions likewise."""
    datasets = json.dumps([{"name": "c", "dataset_dir": str(conditioned_dir), "eval": {}}])
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(RECIPE), "--model.adapter", ADAPTER, "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", datasets, "--data.per_device_batch_size", "2", "--data.eval_batch_size", "2",
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.default_root_dir", str(tmp_path)])
    seen = Conditions()
    cli.trainer.callbacks.append(seen)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert sorted(i for i, _ in seen.seen) == [0, 1, 2, 3]  # one epoch, every record once
    for index, tensors in seen.seen:
        by_slot = {slot: path for slot, (path, _) in zip(BOUND[index], TRAIN[index])}
        for key, value in expected(by_slot).items():
            torch.testing.assert_close(tensors[key], value, rtol=0, atol=1e-4, msg=f"record {index}: {key}")

    (batch,) = list(cli.datamodule.val_dataloader())
    assert batch["prompt"] == ["e0", "e1"]
    for j, by_slot in enumerate([{"reference": "e0_ref.png", "style": "e0_style.png"}, {"reference": "e1_ref.png"}]):
        for key, value in expected(by_slot).items():
            torch.testing.assert_close(batch["condition"][key][j], value, rtol=0, atol=1e-4, msg=f"eval {j}: {key}")
