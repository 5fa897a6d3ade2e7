"""The condition cache with the tiny SD3: what its conditions are, which model settings key it, the recipe's second
run reusing it (text encoders never loaded onto the accelerator), evaluation prompts from the same cache, and
``ff data preprocess``."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import ClassVar

import lightning as L
import pytest
import torch
from ff_sd3.adapter import SD3Adapter

from ff_core.cli import main
from ff_core.contracts import PipelineIOContract
from ff_core.data import commands
from ff_core.data.cache.store import MANIFEST, ConditionSource, open_or_build
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.records.sources import DatasetConfig, load_split, split_file
from ff_core.lora import LoRAConfig
from ff_core.module import FlowModule

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"


class PreprocessSpy:
    """Counts ``SD3Adapter.preprocess`` calls (any instance, any subclass) and the inputs of each call."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[int] = []
        real = SD3Adapter.preprocess

        def spy(adapter, inputs):
            self.calls.append(len(inputs))
            return real(adapter, inputs)

        monkeypatch.setattr(SD3Adapter, "preprocess", spy)


def shapes_source(shapes_dir: Path, split: str = "train") -> ConditionSource:
    cfg = DatasetConfig(name="shapes", dataset_dir=str(shapes_dir), eval={})
    return ConditionSource("shapes", split, cfg.root, split_file(cfg, split), load_split(cfg, split, "sft"))


def test_cached_conditions_are_the_text_embeddings(tiny_sd3, shapes_dir, tmp_path):
    """Every row equals diffusers-style ``encode_prompt`` of its record's prompt (and of "" for the negative
    branch), computed independently of the cache, in batches of any size."""
    adapter = SD3Adapter.from_pretrained(tiny_sd3, resolution=32)
    source = shapes_source(shapes_dir)
    result = open_or_build(source, adapter, cache_dir=tmp_path, batch_size=5)
    prompts = [r.prompt for r in source.records]
    embeds, pooled = adapter.encode_prompt(prompts)
    negative, negative_pooled = adapter.encode_prompt([""])
    for i in range(len(prompts)):
        row = result.conditions[i]
        torch.testing.assert_close(row["prompt_embeds"], embeds[i])
        torch.testing.assert_close(row["pooled_prompt_embeds"], pooled[i])
        torch.testing.assert_close(row["negative_prompt_embeds"], negative[0])
        torch.testing.assert_close(row["negative_pooled_prompt_embeds"], negative_pooled[0])


@pytest.mark.parametrize(("kwargs", "reused"), [
    ({"resolution": 64}, True),  # shapes targets and samples only
    ({"resolution": 32, "max_sequence_length": 8}, False),  # a semantic preprocessing field
    ({"resolution": 32, "dtype": "bfloat16"}, False),  # the dtype policy
])  # fmt: skip
def test_model_settings_in_and_out_of_the_key(tiny_sd3, shapes_dir, tmp_path, kwargs, reused):
    source = shapes_source(shapes_dir)
    first = open_or_build(source, SD3Adapter.from_pretrained(tiny_sd3, resolution=32), cache_dir=tmp_path, batch_size=8)
    second = open_or_build(source, SD3Adapter.from_pretrained(tiny_sd3, **kwargs), cache_dir=tmp_path, batch_size=8)
    assert second.reused is reused and (second.path == first.path) is reused


def test_checkpoint_identity_is_its_resolved_folder(tiny_sd3, shapes_dir, tmp_path, monkeypatch):
    """Another spelling of the same folder reuses; a copy of the checkpoint elsewhere is another model."""
    source = shapes_source(shapes_dir)
    first = open_or_build(source, SD3Adapter.from_pretrained(tiny_sd3, resolution=32), cache_dir=tmp_path / "c",
                          batch_size=8)  # fmt: skip
    monkeypatch.chdir(Path(tiny_sd3).parent)
    relative = SD3Adapter.from_pretrained(Path(tiny_sd3).name, resolution=32)
    assert open_or_build(source, relative, cache_dir=tmp_path / "c", batch_size=8).path == first.path
    copy = shutil.copytree(tiny_sd3, tmp_path / "copy")
    moved = open_or_build(source, SD3Adapter.from_pretrained(copy, resolution=32), cache_dir=tmp_path / "c",
                          batch_size=8)  # fmt: skip
    assert not moved.reused and moved.path != first.path


class OneAtATime(SD3Adapter):
    name: ClassVar[str] = "test-sd3-one-at-a-time"
    io_contract: ClassVar[PipelineIOContract] = PipelineIOContract(outputs=SD3Adapter.io_contract.outputs,
                                                                    max_batch_size=1)


def test_preprocessing_batch_is_capped_at_the_batch_capability(tiny_sd3, shapes_dir, tmp_path, monkeypatch):
    """preprocessing_batch_size 32 with an adapter that takes one sample at a time: 24 calls of one input."""
    spy = PreprocessSpy(monkeypatch)
    data = FlowDataModule([DatasetConfig(name="shapes", dataset_dir=str(shapes_dir))], per_device_batch_size=1,
                          eval_batch_size=1, preprocessing_batch_size=32, cache_dir=str(tmp_path),
                          adapter=f"{__name__}:OneAtATime")  # fmt: skip
    data.setup("fit")
    assert data.prepare_conditions(OneAtATime.from_pretrained(tiny_sd3, resolution=32))
    assert spy.calls == [1] * 24


def trainer(root: Path, **kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, default_root_dir=root, **kw)  # fmt: skip


def module(tiny_sd3) -> FlowModule:
    return FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                      lora=LoRAConfig(rank=2, target_modules=["to_q"]))


def datamodule(shapes_dir, cache: Path, **kw) -> FlowDataModule:
    return FlowDataModule([DatasetConfig(name="shapes", dataset_dir=str(shapes_dir), eval={})], adapter="sd3-5",
                          per_device_batch_size=4, eval_batch_size=6, cache_dir=str(cache), **kw)  # fmt: skip


def test_text_encoders_are_released_once_conditions_are_cached(tiny_sd3, shapes_dir, tmp_path, monkeypatch):
    """configure_model opens the caches before the strategy places the model: the first run builds them (train
    and evaluation splits) and then drops the text encoders; the second builds nothing and never holds them past
    configure_model. Validation generates from the cached evaluation conditions."""
    spy = PreprocessSpy(monkeypatch)
    for run, expected_calls in ((0, 4), (1, 0)):  # 24 training rows in batches of 8, 6 evaluation prompts
        model, data = module(tiny_sd3), datamodule(shapes_dir, tmp_path / "cache")
        fit = trainer(tmp_path, max_steps=2, limit_val_batches=1, val_check_interval=2)
        fit.fit(model, datamodule=data)
        assert len(spy.calls) == expected_calls, run
        spy.calls.clear()
        assert [r.reused for r in data.cache_results] == [bool(run)] * 2
        adapter = model.adapter
        assert adapter.preprocessing_released and adapter.text_encoder is None and adapter.text_encoder_3 is None
        assert not any("text_encoder" in n for n, _ in model.named_parameters())
        assert fit.global_step == 2 and type(fit.val_dataloaders.dataset.conditions).__name__ == "ConcatConditions"


def test_enable_preprocess_false_keeps_conditions_in_memory(tiny_sd3, shapes_dir, tmp_path, monkeypatch):
    spy = PreprocessSpy(monkeypatch)
    model, data = module(tiny_sd3), datamodule(shapes_dir, tmp_path / "cache", enable_preprocess=False)
    trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(model, datamodule=data)
    assert spy.calls and not model.adapter.preprocessing_released and model.adapter.text_encoder is not None
    assert not (tmp_path / "cache").exists()


def recipe_args(tiny_sd3, shapes_dir, root, cache, *extra):
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir), "eval": {}}])
    return ["--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
            "--data.datasets", datasets, "--data.cache_dir", str(cache), *extra]  # fmt: skip


def test_recipe_second_run_reuses_the_cache(tiny_sd3, shapes_dir, tmp_path, monkeypatch):
    """configs/sd3/sft_tiny.yaml on the CPU twice: the second run (another learning rate, accumulation and batch
    size) calls no preprocess and keeps the published caches as they were."""
    spy = PreprocessSpy(monkeypatch)
    cache = tmp_path / "cache"
    common = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
              "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    main(["fit", *recipe_args(tiny_sd3, shapes_dir, tmp_path, cache, "--trainer.max_steps", "2", *common)])
    assert spy.calls
    manifests = {p: p.read_text() for p in cache.glob(f"*/{MANIFEST}")}
    assert len(manifests) == 2  # train and test splits
    spy.calls.clear()
    main(["fit", *recipe_args(tiny_sd3, shapes_dir, tmp_path, cache, "--trainer.max_steps", "2", *common,
                              "--model.optimizer.init_args.lr", "3e-4", "--trainer.accumulate_grad_batches", "2",
                              "--data.per_device_batch_size", "4")])  # fmt: skip
    assert spy.calls == []
    assert {p: p.read_text() for p in cache.glob(f"*/{MANIFEST}")} == manifests
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.parent.name for p in manifests)


def test_ff_data_preprocess_builds_then_reports_reuse(tiny_sd3, shapes_dir, tmp_path):
    args = ["preprocess", *recipe_args(tiny_sd3, shapes_dir, tmp_path, tmp_path / "cache")]
    outputs = []
    for _ in range(2):
        out = io.StringIO()
        assert commands.main(args, out) == 0
        outputs.append(out.getvalue().splitlines())
    built, reused = outputs
    assert [line.split()[:2] for line in built] == [["shapes/train:", "built"], ["shapes/test:", "built"]]
    assert [line.split()[:2] for line in reused] == [["shapes/train:", "reused"], ["shapes/test:", "reused"]]
    assert "(24 rows," in built[0] and "(6 rows," in built[1] and "KiB)" in built[0]
    assert [line.split()[2] for line in built] == [line.split()[2] for line in reused]
    assert all(Path(line.split()[2]).is_dir() for line in built)
