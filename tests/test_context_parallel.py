"""Context parallelism's core pieces (issue 27; the families' ``ff fit`` runs live in their plugins' tests).

* :class:`~ff_core.context_parallel.UlyssesAnythingAttention` (the backward diffusers 0.42 lacks) on 2 gloo processes,
  against ``scaled_dot_product_attention`` on the whole sequence in one: a token count and a head count the group
  does not divide (7 query tokens split 4 + 3, 5 key tokens 3 + 2, 3 heads), a key mask; the output and the gradients
  of queries, keys and values per rank's slice.
* The refusals, before any weight loads: SD3's transformer has no context-parallel plan; a group of 1.
* :class:`Tokens`: the callback the plugins' runs use to show that each rank's attention holds its slice only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ff_core.errors import ConfigError
from ff_core.strategies import ContextParallelStrategy
from tests.test_ddp_resume import free_port


class Tokens(L.Callback):
    """Per rank: the token count of every self-attention input (modules named ``...attn1``) of the first training
    step: the sequence each rank's attention activations are made of."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath, self.seen, self.handles = Path(dirpath), set(), []

    def on_train_start(self, trainer, pl_module) -> None:
        def record(module, args, kwargs) -> None:
            self.seen.add(int((args[0] if args else kwargs["hidden_states"]).shape[1]))

        for network in pl_module.adapter.denoisers().values():
            for name, module in network.named_modules():
                if name.endswith("attn1"):
                    self.handles.append(module.register_forward_pre_hook(record, with_kwargs=True))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(sorted(self.seen)))


def _attention_rank(rank: int, port: int, out: str) -> None:
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import _native_attention_backward_op, _native_attention_forward_op
    from torch.distributed.device_mesh import init_device_mesh

    from ff_core.context_parallel import UlyssesAnythingAttention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=2, ulysses_anything=True))
    config.setup(rank, 2, torch.device("cpu"), mesh=mesh)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 7, 3, 4, generator=g), torch.randn(2, 5, 3, 4, generator=g), torch.randn(2, 5, 3, 4,
                                                                                                   generator=g)
    mask = torch.rand(2, 1, 1, 5, generator=g) > 0.3
    mask[..., 0] = True
    slices = [x.tensor_split(2, dim=1)[rank].clone().requires_grad_(True) for x in (q, k, v)]
    local_mask = mask.tensor_split(2, dim=-1)[rank].contiguous()
    o = UlyssesAnythingAttention.apply(*slices, local_mask, 0.0, False, None, False, False,
                                       _native_attention_forward_op, _native_attention_backward_op, config)
    weight = torch.randn(2, 7, 3, 4, generator=g).tensor_split(2, dim=1)[rank]
    (o * weight).sum().backward()
    torch.save({"out": o.detach(), "grads": [x.grad for x in slices]}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_ulysses_anything_attention_has_the_whole_sequences_output_and_gradients(tmp_path):
    mp.start_processes(_attention_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    g = torch.Generator().manual_seed(0)
    q, k, v = (x.requires_grad_(True) for x in (torch.randn(2, 7, 3, 4, generator=g), torch.randn(2, 5, 3, 4,
                                                generator=g), torch.randn(2, 5, 3, 4, generator=g)))  # fmt: skip
    mask = torch.rand(2, 1, 1, 5, generator=g) > 0.3
    mask[..., 0] = True
    whole = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask).transpose(1, 2)
    weight = torch.randn(2, 7, 3, 4, generator=g)
    (whole * weight).sum().backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks], dim=1), whole.detach())
    for i, x in enumerate((q, k, v)):
        torch.testing.assert_close(torch.cat([r["grads"][i] for r in ranks], dim=1), x.grad)


def test_a_denoiser_without_a_plan_is_refused_before_weights_load(tiny_sd3):
    from ff_core.module import FlowModule

    module = FlowModule("sd3-5", str(tiny_sd3))
    with pytest.raises(ConfigError, match=r"context_parallel_size.*SD3Transformer2DModel.*no context-parallel plan"):
        module._check_strategy(ContextParallelStrategy(context_parallel_size=2))
    assert module.adapter is None  # nothing loaded


def test_a_group_of_one_is_refused():
    with pytest.raises(ConfigError, match="context_parallel_size"):
        ContextParallelStrategy(context_parallel_size=1)
