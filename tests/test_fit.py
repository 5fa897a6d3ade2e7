"""`ff fit` end to end on the CPU: train, checkpoint (+ LoRA export), resume with optimiser state."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage
from safetensors.torch import load_file

from ff_core.adapter import ConditionInput
from ff_core.cli import main
from ff_core.cli.flow_cli import FlowCLI
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.media.decode import decode_media
from ff_core.module import FlowModule

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "sd3" / "sft_tiny.yaml"


def recipe_args(tiny_sd3, shapes_dir, root, *extra):
    datasets = json.dumps([{"name": "shapes", "dataset_dir": str(shapes_dir), "eval": {}}])
    return [
        "--config", str(RECIPE),
        "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", datasets,
        "--data.eval_batch_size", "6",
        "--model.sampling.num_steps", "2",
        "--trainer.default_root_dir", str(root),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(root), "name": "logs", "version": 0}}),
        *extra,
    ]


class ResumeProbe(L.Callback):
    """Records where training (re)starts and the optimiser state it starts from."""

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step
        self.optimizer_state = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
                                for k, v in trainer.optimizers[0].state_dict()["state"].items()}


@pytest.fixture(scope="module")
def first_run(tiny_sd3, shapes_dir, tmp_path_factory):
    """The real console script, in a subprocess: 20 steps with LoRA, checkpoint every 10."""
    root = tmp_path_factory.mktemp("run")
    cmd = [sys.executable, "-m", "ff_core.cli", "fit",
           *recipe_args(tiny_sd3, shapes_dir, root, "--trainer.max_steps", "20", "--trainer.val_check_interval", "20")]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_fit_writes_checkpoint_lora_samples_and_loss_curve(first_run):
    ckpts = first_run / "logs" / "version_0" / "checkpoints"
    last = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 20
    # Only trainable tensors (the LoRA layers) are in the checkpoint; frozen ones come from the base folder.
    assert last["state_dict"] and all("lora_" in k for k in last["state_dict"])
    lora = load_file(ckpts / "last.lora" / "pytorch_lora_weights.safetensors")
    assert len(lora) == len(last["state_dict"])
    for key, value in last["state_dict"].items():
        peft_key = key.removeprefix("adapter.").replace(".default.weight", ".weight")
        torch.testing.assert_close(lora[peft_key], value)
    [step10] = ckpts.glob("epoch=*-step=10.ckpt")
    assert step10.with_suffix(".lora").is_dir()
    assert (first_run / "logs" / "version_0" / "samples" / "step_000020.png").stat().st_size > 0
    assert (first_run / "logs" / "version_0" / "loss.png").exists()
    steps = (first_run / "logs" / "version_0" / "loss.csv").read_text().splitlines()[1:]
    assert len(steps) == 20
    # The recipe's eval rewards were scored on the validation samples (the colour accuracy is a share of 6 prompts).
    import csv

    [val] = [r for r in csv.DictReader(open(first_run / "logs" / "version_0" / "metrics.csv")) if r.get("val/reward")]
    accuracy = float(val["val/reward/prompt_colour"])
    assert accuracy * 6 == pytest.approx(round(accuracy * 6))
    assert float(val["val/reward"]) == pytest.approx(accuracy)


def test_resume_continues_step_count_and_optimiser_state(first_run, tiny_sd3, shapes_dir, tmp_path):
    ckpt = first_run / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    cli = FlowCLI(FlowModule, FlowDataModule, run=False,
                  args=recipe_args(tiny_sd3, shapes_dir, tmp_path, "--trainer.max_steps", "24"))
    probe = ResumeProbe()
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(ckpt))
    assert probe.start_step == 20 and cli.trainer.global_step == 24
    saved_state = saved["optimizer_states"][0]["state"]
    assert probe.optimizer_state.keys() == saved_state.keys() and saved_state
    for index, state in saved_state.items():
        assert state["step"] == probe.optimizer_state[index]["step"] == 20
        torch.testing.assert_close(probe.optimizer_state[index]["exp_avg"], state["exp_avg"])
        torch.testing.assert_close(probe.optimizer_state[index]["exp_avg_sq"], state["exp_avg_sq"])


def test_predict_writes_one_image_per_evaluation_prompt(first_run, tiny_sd3, shapes_dir, tmp_path):
    """`ff predict --ckpt_path`: the recipe's MediaWriter writes each generated image with its prompt."""
    ckpt = first_run / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    main(["predict", *recipe_args(tiny_sd3, shapes_dir, tmp_path), "--ckpt_path", str(ckpt)])
    out = tmp_path / "logs" / "version_0" / "predictions"
    rows = [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()]
    prompts = (shapes_dir / "test.txt").read_text().splitlines()
    assert [r["index"] for r in rows] == list(range(len(prompts))) and [r["prompt"] for r in rows] == prompts
    from PIL import Image

    for row in rows:
        [name] = row["files"]
        with Image.open(out / name) as image:
            assert image.size == (32, 32) and image.mode == "RGB"


class ModeProbe(L.Callback):
    """At every denoiser forward, records the stage and the modes: is every module of the trained network (the
    denoiser) in train mode, is every other module of the adapter (VAE, text encoders, ...) in eval mode?"""

    def on_fit_start(self, trainer, pl_module):
        adapter, self.records = pl_module.adapter, []
        trained = {id(m) for m in adapter.denoiser.modules()}
        # The frozen components are outside the module tree (Adapter.detach_frozen): their modules are probed too.
        detached = [m for component in adapter.detached_modules().values() for m in component.modules()]
        others = [m for m in [*adapter.modules(), *detached] if id(m) not in trained and m is not adapter]
        assert others and len(trained) > 10

        def record(*_):
            self.records.append((trainer.state.stage, trainer.global_step,
                                 all(m.training for m in adapter.denoiser.modules()),
                                 not any(m.training for m in adapter.denoiser.modules()),
                                 not any(m.training for m in others)))  # fmt: skip

        self.handle = adapter.denoiser.register_forward_pre_hook(record)

    def on_fit_end(self, trainer, pl_module):
        self.handle.remove()


LORA = {"rank": 4, "alpha": 16, "dropout": 0.1,
        "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "ff.net.2", "proj_out"]}  # fmt: skip


@pytest.fixture(scope="module")
def probed_run(tiny_sd3, shapes_dir, tmp_path_factory):
    """4 LoRA steps (alpha 4x the rank) with a sanity check and a validation every 2 steps, modes probed."""
    root = tmp_path_factory.mktemp("probed")
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=recipe_args(
        tiny_sd3, shapes_dir, root, "--model.lora", json.dumps(LORA), "--trainer.max_steps", "4",
        "--trainer.val_check_interval", "2", "--trainer.num_sanity_val_steps", "1"))  # fmt: skip
    probe = ModeProbe()
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)
    return root, probe.records


def test_denoiser_trains_in_train_mode_and_generates_in_eval_mode(probed_run):
    """Lightning keeps modules' modes, and from_pretrained returns them in eval mode: without FlowModule setting
    them, the denoiser would train without its dropout. Frozen components stay in eval mode throughout."""
    _, records = probed_run
    stages = [stage for stage, *_ in records]
    assert stages[0] == RunningStage.SANITY_CHECKING
    train = [r for r in records if r[0] == RunningStage.TRAINING]
    generate = [r for r in records if r[0] != RunningStage.TRAINING]
    assert len(train) == 4 and generate
    assert all(denoiser_train and others_eval for _, _, denoiser_train, _, others_eval in train), train
    assert all(denoiser_eval and others_eval for _, _, _, denoiser_eval, others_eval in generate), generate
    # A validation in the middle of training, then training again (in train mode, checked above).
    first_val = stages.index(RunningStage.VALIDATING)
    assert RunningStage.TRAINING in stages[first_val:] and records[first_val][1] == 2


def test_fit_exports_the_lora_at_its_trained_scale(probed_run, tiny_sd3):
    """FlowCheckpoint's export, fused by the diffusers pipeline, gives the checkpoint's W + alpha / rank * B @ A."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    root, _ = probed_run
    ckpts = root / "logs" / "version_0" / "checkpoints"
    state = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer").state_dict()
    expected, scale, layers = dict(base), LORA["alpha"] / LORA["rank"], set()
    for key, a in state.items():
        if ".lora_A." in key:
            b = state[key.replace(".lora_A.", ".lora_B.")]
            assert b.abs().sum() > 0  # trained
            layers.add(layer := key.removeprefix("adapter.transformer.").split(".lora_A.")[0])
            expected[f"{layer}.weight"] = base[f"{layer}.weight"] + scale * b @ a
    assert all(any(n == t or n.endswith(f".{t}") for n in layers) for t in LORA["target_modules"]), layers
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.load_lora_weights(ckpts / "last.lora")
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # keeps the fused weights under the plain state-dict keys
    fused = pipe.transformer.state_dict()
    assert fused.keys() == base.keys()
    for key, value in fused.items():
        torch.testing.assert_close(value, expected[key], msg=lambda m: f"{key}: {m}")


def test_full_finetune_checkpoint_holds_the_transformer_only(tiny_sd3, shapes_dir, tmp_path):
    main(["fit", *recipe_args(tiny_sd3, shapes_dir, tmp_path, "--model.lora", "null", "--trainer.max_steps", "2",
                              "--trainer.limit_val_batches", "0")])
    state = torch.load(tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    from diffusers import SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer")
    assert set(state) == {f"adapter.transformer.{k}" for k in transformer.state_dict()}  # buffers included
    assert not (tmp_path / "logs" / "version_0" / "checkpoints" / "last.lora").exists()


def test_frozen_components_need_declared_branches_and_an_objective_that_drops_them(tiny_sd3):
    """``model.frozen_components`` (docs/config.md): an objective that cannot drop a component's term
    (``supports_frozen_components`` false) refuses it before any weights load; an adapter that declares no branches
    (SD3) refuses it as the module is built, naming the key. SFT, DPO and GRPO drop it (unless the objective's
    component_weights keep it: freezing is about parameters)."""
    from ff_core.errors import ConfigError
    from ff_core.objectives import DPOObjective, GRPOObjective, SFTObjective

    class KeepsEveryTerm(SFTObjective):
        supports_frozen_components = False

    with pytest.raises(ConfigError, match="model.frozen_components.*KeepsEveryTerm"):
        FlowModule("sd3-5", str(tiny_sd3), objective=KeepsEveryTerm(), frozen_components=["audio"])
    for objective in (SFTObjective(), DPOObjective(), GRPOObjective(rewards=[{"name": "colour", "args": {
            "target": [255, 0, 0]}}])):  # fmt: skip
        objective.freeze_components(["audio"])
        assert objective.frozen_components == {"audio"}
    with pytest.raises(ConfigError, match="model.frozen_components.*'sd3-5' does not declare"):  # no weights yet
        FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32}, frozen_components=["audio"])


def test_gradient_checkpointing_gives_the_same_gradients(tiny_sd3, shapes_dir):
    """Recomputing activations in the backward pass changes memory, not the maths. (Also: ``train()`` leaves the
    frozen components in eval mode, so T5's dropout never randomises the conditions.)"""
    from torch.utils.data import default_collate

    from ff_core.data.records.sources import DatasetConfig, load_split

    records = load_split(DatasetConfig(name="shapes", dataset_dir=str(shapes_dir)), "train", "sft")[:4]
    grads = []
    for checkpointing in (False, True):
        module = FlowModule("sd3-5", str(tiny_sd3), adapter_kwargs={"resolution": 32},
                            gradient_checkpointing=checkpointing)
        module.configure_model()
        module.train()
        adapter = module.adapter
        assert adapter.denoiser.is_gradient_checkpointing is checkpointing and adapter.denoiser.training
        assert not adapter.text_encoder_3.training and not adapter.vae.training
        conditions = adapter.preprocess([ConditionInput(r.prompt) for r in records])
        batch = {"condition": default_collate(conditions),
                 "target": [[decode_media(m) for m in r.candidates[0]] for r in records]}
        torch.manual_seed(0)
        module.objective.training_loss(adapter, batch).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in adapter.denoiser.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_a_broken_dataset_fails_before_any_weight_loads(shapes_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    good = (shapes_dir / "train.jsonl").read_text().splitlines()
    bad = good[1].replace('"schema_version":2', '"schema_version":"2"')
    (broken / "train.jsonl").write_text("\n".join([good[0], bad]))
    # The checkpoint does not exist either: the data are checked first, and `ff fit` prints the diagnostic alone.
    args = recipe_args(tmp_path / "no-such-checkpoint", broken, tmp_path, "--trainer.max_steps", "1")
    assert main(["fit", *args]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f'{broken}/train.jsonl:2: schema_version: must be the integer 2, found "2"')


DPO_RECIPE = REPO / "configs" / "sd3" / "offline_dpo_tiny.yaml"


def dpo_fit(tiny_sd3, shapes_dpo_dir, root, *extra) -> FlowCLI:
    """The offline-DPO recipe, 4 steps of 4 pairs, every step logged to ``root/logs/version_0/metrics.csv``."""
    datasets = json.dumps([{"name": "pairs", "dataset_dir": str(shapes_dpo_dir)}])
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(DPO_RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", datasets, "--data.per_device_batch_size", "4", "--trainer.max_steps", "4",
        "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(root),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(root), "name": "logs", "version": 0}}),
        *extra])  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli


def reference_velocity(cli, base_dir, prompt="a red circle on a white background"):
    """The trained module's reference velocity and a freshly loaded base's, on one noisy latent."""
    module, base = cli.model, FlowModule("sd3-5", str(base_dir), adapter_kwargs={"resolution": 32})
    base.configure_model()
    condition = torch.utils.data.default_collate(base.adapter.preprocess([ConditionInput(prompt)]))
    state = base.adapter.initial_noise(base.adapter.prepare_condition(condition), torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7])
    with torch.no_grad():
        expected = base.adapter.velocity(state, sigma, base.adapter.prepare_condition(condition))
        policy = module.adapter.velocity(state, sigma, module.adapter.prepare_condition(condition))
        with module.objective.reference.active(module.adapter):
            got = module.adapter.velocity(state, sigma, module.adapter.prepare_condition(condition))
    return got.components["latent"], expected.components["latent"], policy.components["latent"]


def test_offline_dpo_recipe_trains_through_ff_fit(tiny_sd3, shapes_dpo_dir, tmp_path):
    """LoRA offline DPO: the first step's loss is log 2 (the LoRA starts at zero: policy = reference); every step logs
    the implicit accuracy, both implicit rewards and the four errors; after training the reference (LoRA disabled) is
    still exactly the base checkpoint, the policy is not, and the checkpoint holds the LoRA alone."""
    import csv

    cli = dpo_fit(tiny_sd3, shapes_dpo_dir, tmp_path)
    rows = [r for r in csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")) if r.get("train/loss")]
    assert len(rows) == 4
    assert float(rows[0]["train/loss"]) == pytest.approx(math.log(2), abs=1e-6)
    names = ["implicit_accuracy", "reward_chosen", "reward_rejected", "reward_margin", "error_policy_chosen",
             "error_policy_rejected", "error_reference_chosen", "error_reference_rejected"]  # fmt: skip
    assert all(math.isfinite(float(r[f"train/{n}"])) for r in rows for n in names)
    assert float(rows[-1]["train/reward_margin"]) != 0 and float(rows[0]["train/reward_margin"]) == 0
    got, base, policy = reference_velocity(cli, tiny_sd3)
    torch.testing.assert_close(got, base, rtol=0, atol=0)
    assert not torch.allclose(policy, base)
    last = torch.load(tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["state_dict"] and all("lora_" in k for k in last["state_dict"])


def test_full_finetune_dpo_keeps_a_frozen_base_copy_out_of_the_checkpoint(tiny_sd3, shapes_dpo_dir, tmp_path):
    """model.lora null: the reference is a copy of the base transformer made before the first step, in eval mode,
    unchanged by training; the checkpoint holds the trained transformer only."""
    from diffusers import SD3Transformer2DModel

    cli = dpo_fit(tiny_sd3, shapes_dpo_dir, tmp_path, "--model.lora", "null", "--trainer.limit_val_batches", "0")
    (copy,) = cli.model.objective_modules.copies()
    assert copy is not cli.model.adapter.transformer and not copy.training
    base = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer").state_dict()
    assert all(torch.equal(v, base[k]) for k, v in copy.state_dict().items())
    assert not all(torch.equal(v, base[k]) for k, v in cli.model.adapter.transformer.state_dict().items())
    got, expected, policy = reference_velocity(cli, tiny_sd3)
    # Bit-equal weights, yet a deep copy and a fresh load of them differ by float rounding (3.6e-7 here, already
    # before any training: the CPU kernels follow the storage), hence a tolerance where the LoRA test has none.
    torch.testing.assert_close(got, expected)
    assert (policy - expected).abs().max() > 1e3 * (got - expected).abs().max()
    state = torch.load(tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert set(state) == {f"adapter.transformer.{k}" for k in base}


def recipe_trainer_type(recipe: Path) -> str:
    """The trainer type of a recipe's objective (what its dataset must supervise), read before the CLI builds it."""
    import importlib

    import yaml

    objective = yaml.safe_load(recipe.read_text())["model"].get("objective") or {}
    module, _, name = objective.get("class_path", "ff_core.objectives.SFTObjective").rpartition(".")
    return getattr(importlib.import_module(module), name).trainer_type


def sd3_recipes() -> list[Path]:
    """The shipped recipes of the SD3 family (every other family's plugin tests its own: plugins/*/tests)."""
    import yaml

    recipes = sorted((REPO / "configs").rglob("*.yaml"))
    return [r for r in recipes if yaml.safe_load(r.read_text())["model"]["adapter"] == "sd3-5"]


@pytest.mark.parametrize("recipe", sd3_recipes(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_recipe_builds(recipe, tiny_sd3, request, tmp_path):
    """STYLE 4: each SD3 recipe starts with its command and instantiates against a tiny saved model, and its first loss
    on a dataset of the supervision its objective consumes (demonstrations or preference pairs) is finite."""
    assert recipe.read_text().startswith(f"# ff fit --config configs/{recipe.relative_to(REPO / 'configs')}")
    trainer_type = recipe_trainer_type(recipe)
    online = trainer_type in ("grpo", "nft")
    if online:  # prompt rows; the recipes run end to end in tests/test_grpo_fit.py and tests/test_nft_fit.py
        from ff_core.testing.shapes import write_prompt_dataset

        data_dir = write_prompt_dataset(tmp_path / "prompts")
    else:
        data_dir = request.getfixturevalue({"sft": "shapes_dir", "offline-dpo": "shapes_dpo_dir"}[trainer_type])
    datasets = [{"name": "shapes", "dataset_dir": str(data_dir), "eval": {}}]
    if "tensor_parquet_dir" in recipe.read_text():  # trains from shards; evaluates on the folder's prompts
        shards = request.getfixturevalue("shapes_latents_dir")
        datasets = [{"name": "latents", "tensor_parquet_dir": str(shards)}, {**datasets[0], "train": None}]
    datasets = json.dumps(datasets)
    # Multi-process strategy recipes (FSDP2, FSDP1, DeepSpeed) build here on one CPU process; their strategies run in
    # tests/test_fsdp2.py (FSDP2) and benchmarks/gpu_check.sh (all), and parse in tests/test_sharding.py.
    single = ["--trainer.strategy", "auto", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
              "--trainer.precision", "32-true"] if "strategy:" in recipe.read_text() else []
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(recipe), "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--data.datasets", datasets, "--trainer.default_root_dir", str(tmp_path), *single])
    assert cli.datamodule.trainer_type == cli.model.objective.trainer_type == trainer_type
    assert cli.datamodule.adapter_name == cli.model.hparams.adapter
    cli.datamodule.setup("fit")
    cli.model.setup("fit")  # builds the recipe's eval rewards and checks the records carry what they read
    if cli.model.eval_rewards:
        assert cli.model.eval_reward_set.keys == [s.key for s in cli.model.eval_rewards]
    cli.model.configure_model()
    if online:
        assert cli.datamodule.grouping == cli.model.objective.grouping
        return
    # Training noise levels follow the schedule the recipe samples with (the checkpoint scheduler's shift).
    assert cli.model.objective.timesteps.resolve_shift(cli.model.adapter) == cli.model.adapter.timestep_shift()
    batch = next(iter(_loader(cli)))
    loss = cli.model.objective.training_loss(cli.model.adapter, batch).loss
    assert torch.isfinite(loss)
    if trainer_type == "offline-dpo" and cli.model.lora is not None:
        # peft starts the LoRA at zero (B = 0): the policy is its reference, every implicit reward 0, the loss log 2.
        torch.testing.assert_close(loss, torch.tensor(math.log(2)))


def _loader(cli):
    cli.datamodule.trainer = cli.trainer
    cli.trainer.strategy.connect(cli.model)
    return cli.datamodule.train_dataloader()
