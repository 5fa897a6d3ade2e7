"""The strategy matrix in docs/scaling.md is the one benchmarks/matrix.py renders from benchmarks/matrix.json (issue 26,
item 5): the table is generated, never edited by hand, and every refused cell carries ff's reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def matrix_module():
    spec = importlib.util.spec_from_file_location("matrix", REPO / "benchmarks" / "matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_table_is_the_rendered_results():
    matrix = matrix_module()
    results = matrix.load()
    text = matrix.DOC.read_text()
    table = text[text.index(matrix.BEGIN) + len(matrix.BEGIN):text.index(matrix.END)].strip()
    assert table == matrix.render(results)
    for key, result in results.items():
        workflow, objective, tuning, strategy = key.split("/")
        assert workflow in matrix.WORKFLOWS and objective in matrix.OBJECTIVES
        assert tuning in matrix.TUNING and strategy in matrix.STRATEGIES
        if result["status"] == "refused":
            assert result["reason"].strip(), key


def test_the_h3_cells_under_ddp_and_fsdp2_are_not_refused():
    """Every cell of H3 x {SFT, DPO, GRPO} x {DDP, FSDP2} (LoRA) was run and none is refused."""
    results = matrix_module().load()
    for workflow in ("h3-t2va", "h3-fl2va", "h3-ref2va"):
        for objective in ("sft", "dpo", "grpo"):
            for strategy in ("ddp", "fsdp2"):
                result = results.get(f"{workflow}/{objective}/lora/{strategy}")
                assert result is not None and result["status"] in ("ran", "= DDP"), (workflow, objective, strategy)
