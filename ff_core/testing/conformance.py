"""The adapter conformance kit: test mixins a plugin author subclasses to check an adapter against ff's contract.

A plugin's tests are a tiny-model config class plus one line (STYLE 9, after diffusers' model tests)::

    from ff_core.testing.conformance import AdapterConformance

    class TestMyAdapterConformance(AdapterConformance):
        adapter_cls = MyAdapter
        adapter_kwargs = {"resolution": 32}

        def build_checkpoint(self, path):          # a tiny random checkpoint in the family's real layout
            return build_tiny_my_family(path)

Every check goes through ``from_pretrained`` on that saved folder, so the path a user's real checkpoint takes is
the path tested. Override :meth:`AdapterConformance.make_targets` for outputs other than images.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file
from torch.utils.data import default_collate

from ff_core.adapter import Adapter, ConditionInput, LatentState
from ff_core.contracts import MediaType, PipelineIOContract
from ff_core.data.geometry import MediaGeometry
from ff_core.module import LoRAConfig, apply_lora, lora_config, lora_configs, lora_state_dict, lora_state_dicts
from ff_core.objectives import SFTObjective
from ff_core.plugins import get_adapter_class


class AdapterConformance:
    """Checks every adapter must pass. Subclass it as ``Test...`` and set the class attributes below.

    Attributes:
        adapter_cls: the adapter class under test.
        adapter_kwargs: keyword arguments of its ``from_pretrained``.
        prompts: prompts used for conditions (two, so batching is exercised).
    """

    adapter_cls: ClassVar[type[Adapter]]
    adapter_kwargs: ClassVar[dict[str, Any]] = {}
    prompts: ClassVar[tuple[str, ...]] = ("a red circle on a white background", "a blue square")

    # -- to provide ---------------------------------------------------------------------------------------
    def build_checkpoint(self, path: Path) -> Path:
        """Write a tiny random-initialised checkpoint in the family's layout and return its folder."""
        raise NotImplementedError

    def make_targets(self, adapter: Adapter, n: int) -> list[list[torch.Tensor]]:
        """Decoded target media per sample, in the contract's output order (default: images at the resolution)."""
        if adapter.io_contract.output_types != (MediaType.IMAGE,):
            raise NotImplementedError("override make_targets for non-image outputs")
        size = getattr(adapter, "resolution")
        g = torch.Generator().manual_seed(0)
        return [[torch.randint(0, 256, (3, size, size), generator=g, dtype=torch.uint8)] for _ in range(n)]

    # -- fixtures -----------------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def pretrained(self, tmp_path_factory) -> Path:
        return self.build_checkpoint(tmp_path_factory.mktemp(self.adapter_cls.__name__))

    @pytest.fixture(scope="class")
    def adapter(self, pretrained) -> Adapter:
        return self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)

    @pytest.fixture(scope="class")
    def batch(self, adapter) -> dict[str, Any]:
        conditions = adapter.preprocess([ConditionInput(p) for p in self.prompts])
        return {"condition": default_collate(conditions), "target": self.make_targets(adapter, len(self.prompts))}

    # -- checks -------------------------------------------------------------------------------------------
    def test_metadata_is_readable_without_weights(self):
        cls = self.adapter_cls
        assert isinstance(cls.name, str) and cls.name
        assert isinstance(cls.io_contract, PipelineIOContract)
        assert cls.io_contract.describe()
        assert isinstance(cls.preprocess_version, str) and cls.preprocess_version
        assert all(isinstance(t, str) for t in cls.default_lora_targets)

    def test_registered_under_its_name(self):
        assert get_adapter_class(self.adapter_cls.name) is self.adapter_cls

    def test_denoiser_is_a_submodule(self, adapter):
        assert any(m is adapter.denoiser for m in adapter.modules())

    def test_sharding_blocks_are_repeated_blocks_of_each_network(self, adapter):
        """FSDP2's units (docs/scaling.md): for every trained network, distinct submodules of it, all of one class;
        empty would shard the network whole (correct, but gathered whole for every forward)."""
        blocks = adapter.sharding_blocks()
        assert set(blocks) <= set(adapter.denoisers())
        for name, network in adapter.denoisers().items():
            found = blocks.get(name, [])
            inside = {id(m) for m in network.modules() if m is not network}
            assert found and all(id(b) in inside for b in found), name
            assert len({id(b) for b in found}) == len(found) and len({type(b) for b in found}) == 1, name

    def test_preprocess_gives_per_sample_cpu_tensors(self, adapter):
        out = adapter.preprocess([ConditionInput(p) for p in self.prompts])
        assert len(out) == len(self.prompts)
        assert out[0].keys() == out[1].keys() and out[0]
        for key, value in out[0].items():
            assert value.device.type == "cpu", key
            assert value.shape == out[1][key].shape, key
            assert not value.requires_grad, key

    def test_stages_agree_on_latent_geometry(self, adapter, batch):
        condition = adapter.prepare_condition(batch["condition"])
        clean = adapter.encode_output(batch["target"], condition)
        assert isinstance(clean, LatentState) and clean.batch_size == len(self.prompts)
        noise = adapter.initial_noise(condition, torch.Generator().manual_seed(0))
        assert list(noise.components) == list(clean.components)
        sigma = torch.full((clean.batch_size,), 0.5)
        velocity = adapter.velocity(clean, sigma, condition)
        for name, tensor in clean.components.items():
            assert noise.components[name].shape == tensor.shape, name
            assert velocity.components[name].shape == tensor.shape, name
            assert torch.isfinite(velocity.components[name]).all(), name

    def test_decode_follows_the_output_contract(self, adapter, batch):
        condition = adapter.prepare_condition(batch["condition"])
        media = adapter.decode(adapter.encode_output(batch["target"], condition))
        assert len(media) == len(self.prompts)
        for sample in media:
            assert len(sample) == len(adapter.io_contract.outputs)
            for item, spec in zip(sample, adapter.io_contract.outputs):
                if spec.type is MediaType.IMAGE:
                    assert item.dtype == torch.uint8 and item.ndim == 3 and item.shape[0] == 3

    def test_output_geometry_is_what_sampling_makes(self, adapter, batch):
        """One entry per output; training targets are fitted to the geometry the adapter samples at."""
        geometry = adapter.output_geometry()
        assert len(geometry) == len(adapter.io_contract.outputs)
        assert all(g is None or isinstance(g, MediaGeometry) for g in geometry)
        pickle.loads(pickle.dumps(geometry))  # it travels to the loader workers
        condition = adapter.prepare_condition(batch["condition"])
        sample = adapter.decode(adapter.initial_noise(condition, torch.Generator().manual_seed(0)))[0]
        for item, spec, g in zip(sample, adapter.io_contract.outputs, geometry):
            if g is not None and spec.type is MediaType.IMAGE:
                assert tuple(item.shape[1:]) == (g.height, g.width)

    def test_sampling_is_seeded(self, adapter, batch):
        condition = adapter.prepare_condition(batch["condition"])

        def run(seed):
            return adapter.sample(condition, num_steps=2, generator=torch.Generator().manual_seed(seed))

        a, b, c = run(0), run(0), run(1)
        for name in a.components:
            torch.testing.assert_close(a.components[name], b.components[name])
            assert not torch.equal(a.components[name], c.components[name])

    def test_encoding_is_seeded_by_its_generator(self, adapter, batch):
        """``encode_output`` draws its randomness (a VAE posterior sample) from the generator it is given, never the
        global RNG: training passes one per rank and micro-batch, so a resumed run encodes what the uninterrupted
        one did."""
        condition = adapter.prepare_condition(batch["condition"])
        state = torch.random.get_rng_state()

        def run(seed):
            return adapter.encode_output(batch["target"], condition, generator=torch.Generator().manual_seed(seed))

        a = run(0)
        torch.manual_seed(1234)  # another global state must not matter
        b = run(0)
        torch.random.set_rng_state(state)
        for name in a.components:
            torch.testing.assert_close(a.components[name], b.components[name], rtol=0, atol=0,
                                       msg=f"encode_output({name!r}) differs for the same generator seed")

    def test_noise_schedule_and_its_shift(self, adapter, batch):
        """Training's default shift is the one sampling uses; a sampling shift override gives a valid grid."""
        condition = adapter.prepare_condition(batch["condition"])
        clean = adapter.encode_output(batch["target"], condition)
        assert adapter.timestep_shift() > 0 and adapter.timestep_shift(clean) > 0
        for shift in (None, 1.0, 3.0):
            sigmas = adapter.sampling_sigmas(4, shift=shift)
            assert len(sigmas) == 5 and sigmas[-1] == 0 and sigmas[0] <= 1 and (sigmas.diff() < 0).all(), shift
        assert not torch.equal(adapter.sampling_sigmas(4, shift=1.0), adapter.sampling_sigmas(4, shift=3.0))

    def test_sft_step_trains_the_denoiser_only(self, pretrained, batch):
        """Every trained network (``denoisers()``: the denoiser, or each expert) and nothing else gets gradients."""
        adapter = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)
        adapter.requires_grad_(False)
        networks = list(adapter.denoisers().values())
        assert networks[0] is adapter.denoiser, "denoisers() lists the denoiser first"
        for network in networks:
            network.requires_grad_(True)
        adapter.train()  # frozen components must stay in eval mode (no dropout in the conditions)
        assert {id(m) for m in adapter.trained_networks()} == {id(m) for m in networks}
        assert all(m.training for network in networks for m in network.modules())
        in_denoiser = {id(m) for network in networks for m in network.modules()}
        frozen = [n for n, m in adapter.named_modules() if id(m) not in in_denoiser and n  # n: not the adapter itself
                  and not any(p.requires_grad for p in m.parameters())]  # fmt: skip
        assert frozen and not any(adapter.get_submodule(n).training for n in frozen), frozen  # nested ones included
        loss = SFTObjective().training_loss(adapter, batch).loss
        assert torch.isfinite(loss)
        loss.backward()
        trained = [p for network in networks for p in network.parameters()]
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)
        denoiser = {id(p) for p in trained}
        assert all(p.grad is None for p in adapter.parameters() if id(p) not in denoiser)

    def test_tensor_rows_round_trip(self, adapter, batch):
        """With ``tensor_columns`` declared: the rows ``ff data preprocess-latents`` writes (``to_row`` of the
        preprocessed condition and the encoded latents), read back (``from_row``, collated, ``stored_latents``), are
        the condition and the clean state training would have computed, so SFT from shards equals SFT on the fly."""
        columns = self.adapter_cls.tensor_columns
        if columns is None:
            pytest.skip(f"{self.adapter_cls.__name__} declares no tensor_columns (no training from shards)")
        conditions = adapter.preprocess([ConditionInput(p) for p in self.prompts])
        condition = adapter.prepare_condition(default_collate(conditions))
        clean = adapter.encode_output(batch["target"], condition, generator=torch.Generator().manual_seed(0))
        rows = [columns.to_row(c, {k: v[i].cpu() for k, v in clean.components.items()})
                for i, c in enumerate(conditions)]
        assert set(columns.required) <= set(rows[0]), f"rows lack {set(columns.required) - set(rows[0])}"
        read = [columns.from_row(row) for row in rows]
        stored_condition = default_collate([c for c, _ in read])
        for key in stored_condition:
            torch.testing.assert_close(stored_condition[key], batch["condition"][key], rtol=0, atol=0, msg=key)
        state = adapter.stored_latents(default_collate([latents for _, latents in read]), condition)
        assert list(state.components) == list(clean.components)
        for name, tensor in clean.components.items():
            torch.testing.assert_close(state.components[name], tensor, rtol=0, atol=0, msg=name)
        assert state.masks.keys() == clean.masks.keys(), "stored_latents must set the masks encode_output sets"

    def test_preprocess_identity_keys_the_cache(self, pretrained):
        """Plain JSON data, the same for two loads of one checkpoint (else no condition cache is ever reused)."""
        identity = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs).preprocess_identity()
        assert isinstance(identity, dict) and json.loads(json.dumps(identity)) == identity
        assert self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs).preprocess_identity() == identity

    def test_preprocessing_components_are_preprocessing_only(self, pretrained, batch):
        """Once conditions are cached FlowModule releases ``preprocessing_components``: training (loss and gradient),
        sampling and decoding must still work from the cached conditions alone."""
        adapter = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)
        for name in adapter.preprocessing_components:
            assert isinstance(getattr(adapter, name, None), torch.nn.Module), f"{name} is not a module of the adapter"
        adapter.requires_grad_(False)
        for network in adapter.denoisers().values():
            network.requires_grad_(True)
        assert adapter.release_preprocessing() == list(adapter.preprocessing_components)
        assert adapter.preprocessing_released
        assert all(getattr(adapter, name) is None for name in adapter.preprocessing_components)
        loss = SFTObjective().training_loss(adapter, batch, torch.Generator().manual_seed(0)).loss
        loss.backward()
        trained = [p for network in adapter.denoisers().values() for p in network.parameters()]
        assert torch.isfinite(loss) and any(p.grad is not None for p in trained)
        condition = adapter.prepare_condition(batch["condition"])
        media = adapter.decode(adapter.sample(condition, num_steps=2, generator=torch.Generator().manual_seed(0)))
        assert len(media) == len(self.prompts)

    def test_lora_export_is_prefixed_safetensors(self, pretrained, tmp_path):
        adapter = self.adapter_cls.from_pretrained(pretrained, **self.adapter_kwargs)
        apply_lora(adapter, LoRAConfig(rank=2, alpha=6))  # alpha != rank: a file without it loads at scale 1
        state = lora_state_dict(adapter)
        assert state and all("lora_" in k for k in state)
        path = adapter.save_lora(tmp_path / "lora", state, lora_config(adapter))
        saved = load_file(path)
        assert set(saved) == {f"{adapter.lora_prefix}.{k}" for k in state}
        # The peft config round-trips through the header the way diffusers' load_lora_adapter rebuilds it.
        with safe_open(path, framework="pt") as f:
            header = json.loads(f.metadata()[LORA_ADAPTER_METADATA_KEY])
        prefix = f"{adapter.lora_prefix}."
        assert header and all(k.startswith(prefix) for k in header)
        config = LoraConfig(**{k.removeprefix(prefix): v for k, v in header.items()})
        assert (config.r, config.lora_alpha) == (2, 6)
        assert set(config.target_modules) == set(adapter.default_lora_targets)
        # Every trained network gets its own file, named by lora_file (one network: the same single file).
        files = adapter.save_loras(tmp_path / "loras", lora_state_dicts(adapter), lora_configs(adapter))
        assert list(files) == list(adapter.denoisers())
        for network, file in files.items():
            weight_name, key_prefix = adapter.lora_file(network)
            assert file.name == weight_name and file.is_file()
            assert load_file(file) and all(k.startswith(f"{key_prefix}.") for k in load_file(file))
