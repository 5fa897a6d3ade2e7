"""The small preprocess / prepare_condition helpers of ff_core.adapter, against hand-built expectations."""

from __future__ import annotations

import pytest
import torch

from ff_core.adapter import ConditionInput, move_condition, prompt_rows, reject_input_media


def test_prompt_rows_clone_per_sample_with_negative_prefix():
    embeds, pooled = torch.arange(12.0).view(2, 3, 2), torch.arange(4.0).view(2, 2)
    rows = prompt_rows({"prompt_embeds": embeds, "pooled_prompt_embeds": pooled},
                       {"prompt_embeds": -embeds, "pooled_prompt_embeds": -pooled})  # fmt: skip
    assert [list(r) for r in rows] == [["prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                                        "negative_pooled_prompt_embeds"]] * 2  # fmt: skip
    for i, row in enumerate(rows):
        assert torch.equal(row["prompt_embeds"], embeds[i]) and torch.equal(row["negative_pooled_prompt_embeds"],
                                                                            -pooled[i])  # fmt: skip
        # compact storage of its own: not a view into the batch tensor
        assert row["prompt_embeds"].untyped_storage().nbytes() == embeds[i].numel() * embeds.element_size()


def test_move_condition_casts_floats_only():
    out = move_condition({"e": torch.ones(2, dtype=torch.float32), "ids": torch.ones(2, dtype=torch.int64)},
                         torch.device("cpu"), torch.bfloat16)  # fmt: skip
    assert out["e"].dtype == torch.bfloat16 and out["ids"].dtype == torch.int64


def test_reject_input_media_names_the_input():
    reject_input_media([ConditionInput(prompt="a")], "x")
    bad = ConditionInput(prompt="b", media=[torch.zeros(3, 2, 2)])
    with pytest.raises(ValueError, match=r"inputs\[1\]: fam takes no input media, got 1 item\(s\)"):
        reject_input_media([ConditionInput(prompt="a"), bad], "fam")
