"""Ragged conditions: per-sample condition tensors of different shapes collate by the adapter's declared rule
(``stack`` / ``pad`` with a mask / ``list``), in both the record and the tensor-row collators."""

from __future__ import annotations

import pytest
import torch

from ff_core.data.cache.collation import check_rules, collate_conditions
from ff_core.data.samples import SampleCollator
from ff_core.data.tensor_parquet.rows import TensorRowCollator


def sample(index: int, length: int, frames: int) -> dict:
    g = torch.Generator().manual_seed(index)
    condition = {"text": torch.randn(length, 4, generator=g), "frames": torch.randn(frames, 3, generator=g),
                 "pooled": torch.randn(6, generator=g)}
    return {"index": index, "prompt": f"p{index}", "condition": condition, "metadata": {}, "target": []}


RULES = {"text": "pad", "frames": "list"}


def test_pad_list_and_stack_by_rule():
    samples = [sample(7, 3, 1), sample(9, 5, 2)]
    batch = collate_conditions([s["condition"] for s in samples], RULES)
    text, mask = batch["text"], batch["text_mask"]
    assert text.shape == (2, 5, 4) and mask.dtype == torch.bool
    assert mask.tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert torch.equal(text[0, :3], samples[0]["condition"]["text"]) and not text[0, 3:].any()
    assert torch.equal(text[1], samples[1]["condition"]["text"])
    assert [f.shape[0] for f in batch["frames"]] == [1, 2]
    assert batch["frames"][1] is samples[1]["condition"]["frames"]
    assert batch["pooled"].shape == (2, 6)
    # No padded token reaches a reduction that honours the mask: a masked mean equals each sample's own mean.
    masked_mean = (text * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    for row, s in enumerate(samples):
        assert torch.allclose(masked_mean[row], s["condition"]["text"].mean(0))


def test_mixed_shapes_without_a_rule_name_the_key_and_samples():
    samples = [sample(7, 3, 1), sample(9, 5, 1)]
    message = r"condition 'text': .*sample 7: \(3, 4\), sample 9: \(5, 4\).*'pad' or 'list'"
    with pytest.raises(ValueError, match=message):
        SampleCollator().collate(samples)


def test_pad_needs_equal_trailing_axes():
    with pytest.raises(ValueError, match="other axes must agree"):
        collate_conditions([{"text": torch.zeros(2, 4)}, {"text": torch.zeros(2, 5)}], {"text": "pad"})


def test_rules_are_checked():
    with pytest.raises(ValueError, match="unknown rule"):
        SampleCollator({"text": "concat"})
    with pytest.raises(ValueError, match="both a key and the mask"):
        check_rules({"text": "pad", "text_mask": "stack"}, "X")


def test_sample_and_tensor_row_collators_apply_the_rules():
    samples = [sample(1, 2, 1), sample(2, 4, 3)]
    batch = SampleCollator(RULES).collate(samples)
    assert batch["condition"]["text"].shape == (2, 4, 4) and batch["condition"]["text_mask"].sum().item() == 6
    rows = [{k: s[k] for k in ("index", "prompt", "condition", "metadata")} | {"latents": {"latent": torch.zeros(2)}}
            for s in samples]
    batch = TensorRowCollator(condition_collation=RULES).collate(rows)
    assert batch["condition"]["text"].shape == (2, 4, 4) and len(batch["condition"]["frames"]) == 2
    assert batch["latents"]["latent"].shape == (2, 2)


def test_lazy_values_pad_and_stack_as_their_tensors_do(tmp_path):
    """Values a worker only located (``FileTensor``: which bytes of which file) collate to a lazy batch that reads
    into the very batch the tensors themselves collate to, bit for bit, mask included; a mix of dtypes is read and
    padded as tensors are; ``list`` keeps them (the loader reads lists too)."""
    import os

    from ff_core.data.dataflow import LazyValue, materialize
    from ff_core.data.tensor_parquet import FileTensor
    from ff_core.data.tensor_parquet.file_tensor import file_identity

    g = torch.Generator().manual_seed(0)
    text = [torch.randn(n, 4, generator=g).to(torch.bfloat16) for n in (3, 5, 2)]
    pooled = [torch.randn(6, generator=g).to(torch.bfloat16) for _ in range(3)]
    path = tmp_path / "raw.bin"
    path.write_bytes(b"".join(t.view(torch.uint8).numpy().tobytes() for t in (*text, *pooled)))
    fd = os.open(path, os.O_RDONLY)
    identity = file_identity(fd)
    os.close(fd)
    lazy, at = [], 0
    for t in (*text, *pooled):
        lazy.append(FileTensor(str(path), identity, at, t.shape, t.dtype))
        at += t.numel() * t.element_size()
    rules = {"text": "pad", "frames": "list"}
    tensors = [{"text": t, "pooled": p, "frames": t} for t, p in zip(text, pooled)]
    expected = collate_conditions(tensors, rules)
    for mixed in (lazy[:3], [lazy[0], text[1], lazy[2]]):  # all located, or some read already
        conditions = [{"text": t, "pooled": p, "frames": t} for t, p in zip(mixed, [lazy[3], pooled[1], lazy[5]])]
        batch = collate_conditions(conditions, rules)
        assert isinstance(batch["text"], LazyValue) and isinstance(batch["pooled"], LazyValue)
        assert isinstance(batch["text_mask"], torch.Tensor)  # from the shapes: nothing was read
        done = materialize(batch)
        assert done.keys() == expected.keys()
        for key in ("text", "text_mask", "pooled"):
            assert done[key].dtype == expected[key].dtype and torch.equal(done[key], expected[key]), key
        assert all(torch.equal(a, b) for a, b in zip(done["frames"], text))
    # Several dtypes: read and padded as tensors are (the first value's dtype).
    promoted = [{"text": lazy[0]}, {"text": text[1].float()}]
    got = collate_conditions(promoted, {"text": "pad"})
    want = collate_conditions([{"text": text[0]}, {"text": text[1].float()}], {"text": "pad"})
    assert not isinstance(got["text"], LazyValue) and torch.equal(got["text"], want["text"])
    with pytest.raises(ValueError, match=r"condition 'pooled': .*sample 0: \(6,\), sample 1: \(3, 4\)"):
        collate_conditions([{"pooled": lazy[3]}, {"pooled": lazy[0]}])
