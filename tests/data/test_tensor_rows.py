"""Training rows from tensor-parquet shards (issue 10 item 4): the adapter's column declaration, the processor and
collator, packing from the stored shapes alone, exact resume under both distributors, and the data.datasets entry."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ff_core.data.dataflow import (
    DataflowLoader,
    DataParallelCoords,
    LazyValue,
    ListBatchCollator,
    MapDistributor,
    PoolPackingBatcher,
    RawItemProcessor,
    SamplerDistributor,
    materialize,
)
from ff_core.data.datamodule import FlowDataModule
from ff_core.data.records.sources import DatasetConfig, check_dataset_configs
from ff_core.data.tensor_parquet import TensorParquetWriter, encode_tensor, tensor_schema
from ff_core.data.tensor_parquet.rows import (
    StoredTokenCount,
    TensorColumns,
    TensorRowCollator,
    TensorRowProcessor,
    TensorRows,
    open_shards,
)
from ff_core.errors import DatasetError, DatasetErrors

COLUMNS = TensorColumns(condition={"text_embedding": "prompt_embeds", "pooled": "pooled"}, latents=("latent",))


def row_tensors(i: int, side: int = 4, text: int = 3) -> dict[str, torch.Tensor]:
    """Row ``i``'s tensors: values that name the row, so a mix-up shows."""
    return {"text_embedding": torch.full((text, 5), float(i)), "pooled": torch.arange(6.0) + i,
            "latent": torch.arange(2 * side * side, dtype=torch.float32).reshape(2, side, side) * (i + 1)}


def write_rows(root, rows: list[dict], rows_per_file: int = 3, tensors=None) -> None:
    tensors = tensors or [k for k in rows[0] if k != "prompt"]
    with TensorParquetWriter(root, tensor_schema({"prompt": pa.string()}, tensors), rows_per_file=rows_per_file) as w:
        for row in rows:
            w.write(row)


@pytest.fixture
def shards(tmp_path):
    """Two shard roots of 7 and 5 rows (global rows 0..11), tensors per :func:`row_tensors`."""
    roots = []
    for name, ids in (("a", range(7)), ("b", range(7, 12))):
        write_rows(tmp_path / name, [{"prompt": f"p{i}", **row_tensors(i)} for i in ids])
        roots.append(tmp_path / name)
    return roots


def rows_of(roots, columns=COLUMNS, hand_off=True) -> TensorRows:
    configs = [DatasetConfig(name=r.name, tensor_parquet_dir=str(r)) for r in roots]
    return TensorRows([s.dataset for s in open_shards(configs, columns, "test", hand_off=hand_off)])


# -- the column declaration ------------------------------------------------------------------------------------
def test_columns_map_rows_both_ways():
    assert COLUMNS.required == ("text_embedding", "pooled", "latent")
    row = row_tensors(2)
    condition, latents = COLUMNS.from_row({**row, "prompt": "x"})
    assert set(condition) == {"prompt_embeds", "pooled"} and list(latents) == ["latent"]
    assert condition["prompt_embeds"] is row["text_embedding"]
    assert COLUMNS.to_row(condition, latents) == row
    with pytest.raises(KeyError, match="no 'pooled' \\(column 'pooled'\\)"):
        COLUMNS.to_row({"prompt_embeds": row["text_embedding"]}, latents)
    optional = TensorColumns(condition=("a", "neg"), optional=("neg",))
    assert optional.required == ("a", "latent") and optional.missing(["latent"]) == ["a"]
    assert optional.to_row({"a": row["pooled"]}, {"latent": row["latent"]}).keys() == {"a", "latent"}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"condition": ("x",), "latents": ("x",)}, "both condition and latent"),
    ({"condition": ("x",), "optional": ("y",)}, "not condition columns"),
    ({"condition": "x"}, "not the string 'x'"),
    ({"condition": ("x",), "latents": ()}, "at least one latent"),
])
def test_columns_refuse_inconsistent_declarations(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TensorColumns(**kwargs)


# -- processor and collator ------------------------------------------------------------------------------------
def test_processor_and_collator_give_the_stored_tensors(shards):
    rows = rows_of(shards)
    assert len(rows) == 12 and rows.locate(8) == (1, 1)
    processor = TensorRowProcessor(rows, COLUMNS)
    batch = materialize(TensorRowCollator().collate([processor.process(i) for i in (8, 0, 5)]))
    assert batch["index"].tolist() == [8, 0, 5] and batch["prompt"] == ["p8", "p0", "p5"]
    for k, i in enumerate((8, 0, 5)):
        expected = row_tensors(i)
        assert torch.equal(batch["condition"]["prompt_embeds"][k], expected["text_embedding"])
        assert torch.equal(batch["condition"]["pooled"][k], expected["pooled"])
        assert torch.equal(batch["latents"]["latent"][k], expected["latent"])
    assert batch["latents"]["latent"].dtype == torch.float32 and batch["metadata"] == [{}, {}, {}]


def test_a_placeholder_where_training_needs_a_tensor_names_file_row_and_column(tmp_path):
    """The absent-tensor placeholder ``(b"", [], "")`` reads as None; in a column training needs it is an error."""
    rows = []
    for i in range(3):
        row = {"prompt": f"p{i}"}
        for name, t in row_tensors(i).items():
            row |= encode_tensor(t, name)
        rows.append(row)
    rows[0] |= {"latent_bytes": b"", "latent_shape": [], "latent_dtype": ""}
    (tmp_path / "b").mkdir()
    schema = tensor_schema({"prompt": pa.string()}, list(row_tensors(0)))
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "b" / "f.parquet", row_group_size=1)
    processor = TensorRowProcessor(rows_of([tmp_path / "b"]), COLUMNS)
    assert torch.equal(processor.process(1)["latents"]["latent"], row_tensors(1)["latent"])
    with pytest.raises(DatasetError) as err:
        processor.process(0)
    assert str(err.value).startswith(f"{tmp_path / 'b' / 'f.parquet'}: row group 0, row 0: latent: the row holds the "
                                     "empty placeholder")


def test_collator_names_the_rows_of_a_batch_with_mixed_shapes(tmp_path):
    write_rows(tmp_path / "mixed", [{"prompt": "", **row_tensors(i, side=4 + 2 * (i % 2))} for i in range(4)])
    rows = rows_of([tmp_path / "mixed"])
    processor = TensorRowProcessor(rows, COLUMNS)
    with pytest.raises(ValueError, match=r"latents 'latent'.*row 0: \(2, 4, 4\), row 1: \(2, 6, 6\)"):
        TensorRowCollator().collate([processor.process(i) for i in (0, 1)])


def test_preference_rows_give_both_arms(tmp_path):
    """A preference row holds the condition once and each latent column twice, ``chosen_`` and ``rejected_``."""
    rows = [{"prompt": f"p{i}", "text_embedding": row_tensors(i)["text_embedding"], "pooled": row_tensors(i)["pooled"],
             "chosen_latent": row_tensors(i)["latent"], "rejected_latent": -row_tensors(i)["latent"]} for i in range(3)]
    write_rows(tmp_path / "pairs", rows)
    configs = [DatasetConfig(name="pairs", tensor_parquet_dir=str(tmp_path / "pairs"))]
    assert COLUMNS.required_for("preference") == ("text_embedding", "pooled", "chosen_latent", "rejected_latent")
    table = TensorRows([s.dataset for s in open_shards(configs, COLUMNS, "test", supervision="preference")])
    processor = TensorRowProcessor(table, COLUMNS, supervision="preference")
    batch = materialize(TensorRowCollator().collate([processor.process(i) for i in (2, 0)]))
    assert set(batch) == {"index", "prompt", "condition", "chosen_latents", "rejected_latents", "metadata"}
    assert torch.equal(batch["chosen_latents"]["latent"][0], row_tensors(2)["latent"])
    assert torch.equal(batch["rejected_latents"]["latent"][1], -row_tensors(0)["latent"])
    with pytest.raises(DatasetErrors, match="no tensor column 'latent'"):  # demonstration columns are not there
        open_shards(configs, COLUMNS, "test")


def test_max_dataset_size_serves_the_first_rows(shards):
    configs = [DatasetConfig(name="a", tensor_parquet_dir=str(shards[0]), train={"max_dataset_size": 2}),
               DatasetConfig(name="b", tensor_parquet_dir=str(shards[1]))]
    sources = open_shards(configs, COLUMNS, "test")
    rows = TensorRows([s.dataset for s in sources], [s.rows for s in sources])
    assert len(rows) == 7 and [rows.locate(i) for i in (1, 2)] == [(0, 1), (1, 0)]
    assert TensorRowProcessor(rows, COLUMNS).process(2)["prompt"] == "p7"


# -- packing from the stored shapes only -------------------------------------------------------------------------
def test_packing_weighs_rows_by_their_shape_columns_without_decoding_a_tensor(tmp_path):
    """Every ``latent_bytes`` is corrupt (too short: decoding it fails), yet a PoolPackingBatcher over deferred
    samples builds its batches, from the ``_shape`` columns alone, exactly as over the true shapes."""
    sides = [4, 8, 4, 6, 8, 2, 6, 4, 2, 8]
    bad = [{"prompt": "", **encode_tensor(row_tensors(i)["text_embedding"], "text_embedding"),
            **encode_tensor(row_tensors(i)["pooled"], "pooled"),
            "latent_bytes": b"\x00" * 8, "latent_shape": [2, s, s], "latent_dtype": "float32"}
           for i, s in enumerate(sides)]
    write_rows(tmp_path / "corrupt", bad, rows_per_file=4, tensors=["text_embedding", "pooled", "latent"])
    rows = rows_of([tmp_path / "corrupt"])
    with pytest.raises(DatasetError, match="latent_bytes: row 0.*8 bytes"):
        TensorRowProcessor(rows, COLUMNS).process(0)  # the bytes really are unreadable

    size = StoredTokenCount("latent", patch=(2, 2))
    assert [size({"shapes": {"latent": (2, s, s)}}) for s in (4, 6, 8)] == [4, 9, 16]  # (s/2)^2 tokens

    def packed(processor, n=10):
        batcher = PoolPackingBatcher(max_tokens=32, pool_size=4, max_batch_size=4, size_fn=size)
        loader = DataflowLoader(MapDistributor(list(range(n)) if processor is None else rows, seed=5),
                                processor or _TrueShapes(sides), batcher=batcher,
                                collator=ListBatchCollator(["shapes"]), steps_per_epoch=6)
        return [b["index"].tolist() for b in loader]

    got = packed(TensorRowProcessor(rows, COLUMNS, defer=True))
    assert got == packed(None)
    assert len({len(b) for b in got}) > 1  # the budget really shaped the batches


class _TrueShapes(RawItemProcessor):
    """The reference: the shapes the rows were written with, held in memory."""

    def __init__(self, sides):
        self.sides = sides

    def process(self, item):
        return {"index": item, "shapes": {"latent": (2, self.sides[item], self.sides[item])}}


def test_deferred_rows_are_read_by_the_collator(shards):
    rows = rows_of(shards)
    processor = TensorRowProcessor(rows, COLUMNS, defer=True)
    samples = [processor.process(i) for i in (3, 9)]
    assert samples[0] == {"index": 3, "shapes": {"text_embedding": (3, 5), "pooled": (6,), "latent": (2, 4, 4)}}
    batch = materialize(TensorRowCollator(processor).collate(samples))
    assert torch.equal(batch["latents"]["latent"][1], row_tensors(9)["latent"])
    with pytest.raises(ValueError, match="deferred"):
        TensorRowCollator().collate(samples)


# -- exact resume ------------------------------------------------------------------------------------------------
def loader(rows, distributor, batch_size=2, num_workers=0, **kw):
    dist = distributor(rows, seed=3, name="train", identity={"a": {"rows": len(rows)}})
    return DataflowLoader(dist, TensorRowProcessor(rows, COLUMNS), collator=TensorRowCollator(),
                          batch_size=batch_size, num_workers=num_workers, coords=DataParallelCoords(0, 1), **kw)


def take(dl, steps):
    out = []
    while len(out) < steps:
        for batch in dl:
            out.append((batch["index"].tolist(), batch["latents"]["latent"].sum().item()))
            if len(out) == steps:
                break
    return out


@pytest.mark.parametrize(("distributor", "workers"), [(SamplerDistributor, 0), (MapDistributor, 0),
                                                      (SamplerDistributor, 2)])
def test_resumed_loader_continues_the_uninterrupted_order(shards, distributor, workers):
    """Stop after 5 batches (mid-epoch 1), rebuild everything from the state: the next 10 batches are the
    uninterrupted run's. The offline sampler's epochs are complete traversals (6 batches of 12 rows). With workers
    (rows handed to the main process as file ranges) the resumed run is the uninterrupted one without workers."""
    rows = rows_of(shards)
    full = take(loader(rows, distributor), 15)
    first = loader(rows, distributor, num_workers=workers)
    assert take(first, 5) == full[:5]
    resumed = loader(rows_of(shards), distributor, num_workers=workers)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # what a checkpoint holds
    assert take(resumed, 10) == full[5:]
    if distributor is SamplerDistributor:
        assert sorted(i for ids, _ in full[:6] for i in ids) == list(range(12))
    assert [ids for ids, _ in full[:6]] != [ids for ids, _ in full[6:12]]  # reshuffled every epoch


def test_workers_read_the_shards_in_their_own_processes(shards):
    """The reader is pickled to DataLoader workers (no open file crosses); the offline order does not depend on
    the worker count."""
    rows = rows_of(shards)
    assert take(loader(rows, SamplerDistributor, num_workers=2), 8) == take(loader(rows, SamplerDistributor), 8)


class LazyFlagCollator(TensorRowCollator):
    """Records, in the worker, whether the stacked latents and conditions were still file ranges there."""

    def collate(self, samples):
        batch = super().collate(samples)
        parts = ("latents", "condition")
        batch["lazy"] = [all(isinstance(v, LazyValue) for k, v in batch[part].items() if not k.endswith("_mask"))
                         for part in parts]
        return batch


def flat(batch, prefix=""):
    """``(key path, value)`` of every leaf of a batch."""
    if isinstance(batch, dict):
        return [x for k, v in batch.items() for x in flat(v, f"{prefix}/{k}")]
    return [(prefix, batch)]


def same(a, b) -> bool:
    fa, fb = flat(a), flat(b)
    return [k for k, _ in fa] == [k for k, _ in fb] and all(
        torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        for (_, x), (_, y) in zip(fa, fb))


@pytest.mark.parametrize("collation", [None, {"prompt_embeds": "pad"}, {"prompt_embeds": "pad", "pooled": "stack"}])
def test_file_ranges_give_the_batches_reading_tensors_gives(tmp_path, collation):
    """With ``hand_off`` the rows' tensors are stacked as file ranges (a padded text embedding too), in the workers or
    in the main process (no worker), and the loader reads them straight into the batch: every batch equals the one
    collated from tensors read eagerly (``hand_off=False``, no worker), key by key, bit for bit, masks included.
    Condition collation rules (Wan's: text embeddings padded per batch, the rest stacked) keep the conditions file
    ranges too: nothing but the masks is read before the batch is materialised."""
    columns = TensorColumns(condition={"text_embedding": "prompt_embeds", "pooled": "pooled"}, latents=("latent",),
                            pad={"text_embedding": 6} if collation is None else {})
    rows = [{"prompt": f"p{i}", **row_tensors(i, text=1 + i % 6)} for i in range(10)]
    write_rows(tmp_path / "a", rows)
    batches = {}
    for workers, hand_off in ((0, False), (0, True), (2, True)):
        table = rows_of([tmp_path / "a"], columns, hand_off=hand_off)
        dist = SamplerDistributor(table, seed=3, name="train", identity={"a": {"rows": len(table)}})
        dl = DataflowLoader(dist, TensorRowProcessor(table, columns), collator=LazyFlagCollator(condition_collation=
                            collation), batch_size=3, num_workers=workers, coords=DataParallelCoords(0, 1))
        batches[workers, hand_off] = list(dl)
    eager = batches[0, False]
    assert len(eager) == 4 and all(b["lazy"] == [False, False] for b in eager)
    for key in ((0, True), (2, True)):
        assert all(b["lazy"] == [True, True] for b in batches[key])
        if collation:  # padded to each batch's longest, with the mask of real entries
            assert all(b["condition"]["prompt_embeds_mask"].sum(1).tolist() ==
                       [1 + i % 6 for i in b["index"].tolist()] for b in batches[key])
        for a, b in zip(eager, batches[key], strict=True):
            assert same({**a, "lazy": None}, {**b, "lazy": None})
            assert not any(isinstance(v, LazyValue) for _, v in flat(b))
    first = eager[0]
    i = first["index"][0].item()
    if collation is None:
        assert torch.equal(first["condition"]["prompt_embeds"][0, :1 + i % 6], rows[i]["text_embedding"])
    assert torch.equal(first["latents"]["latent"][0], rows[i]["latent"])


# -- data.datasets entries ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "x"}, "exactly one of dataset_dir"),
    ({"name": "x", "dataset_dir": "a", "tensor_parquet_dir": "b"}, "exactly one of dataset_dir"),
])
def test_an_entry_is_a_folder_or_shards(entry, message):
    with pytest.raises(ValueError, match=message):
        DatasetConfig(**entry)


def test_shard_entries_train_offline_only_without_eval_media_or_folders():
    shards_entry = DatasetConfig(name="s", tensor_parquet_dir="r", eval={}, image_dir="i")
    folder = DatasetConfig(name="f", dataset_dir="d")
    with pytest.raises(ValueError) as exc:
        check_dataset_configs([shards_entry, folder], "grpo")
    assert str(exc.value).splitlines() == [
        "data.datasets[0].tensor_parquet_dir: tensor-parquet shards train the offline trainers (sft, offline-dpo), "
        "not 'grpo'",
        "data.datasets[0].eval: tensor-parquet shards hold no evaluation prompts; evaluate on a dataset folder entry "
        "(dataset_dir with eval: {}, train: null)",
        "data.datasets[0].image_dir: only dataset folders (dataset_dir) have media folders",
        "data.datasets: training mixes tensor-parquet shards with dataset folders; train from one kind (convert "
        "folders with `ff data preprocess-latents`)",
    ]
    eval_only = DatasetConfig(name="f", dataset_dir="d", train=None, eval={})
    check_dataset_configs([DatasetConfig(name="s", tensor_parquet_dir="r"), eval_only], "sft")


def test_setup_names_the_file_and_column_an_adapter_misses_before_weights_load(tmp_path):
    """sd3-5 trains from prompt_embeds, pooled_prompt_embeds and latent; shards without pooled embeddings fail in
    setup, which reads footers only (no checkpoint exists here at all)."""
    write_rows(tmp_path / "s", [{"prompt": "", "prompt_embeds": torch.zeros(3, 4), "latent": torch.zeros(2, 4, 4)}])
    data = FlowDataModule([{"name": "s", "tensor_parquet_dir": str(tmp_path / "s")}], adapter="sd3-5")
    with pytest.raises(DatasetErrors) as exc:
        data.setup("fit")
    assert exc.value.format() == (
        f"{tmp_path}/s/worker_0/data_chunk_0.parquet: pooled_prompt_embeds: no tensor column 'pooled_prompt_embeds' "
        "(pooled_prompt_embeds_bytes, _shape, _dtype), which adapter 'sd3-5' trains from; dataset 's' has "
        "prompt_embeds, latent")


def test_a_missing_shard_root_is_one_error_naming_the_key(tmp_path):
    data = FlowDataModule([{"name": "s", "tensor_parquet_dir": str(tmp_path / "nope")}], adapter="sd3-5")
    with pytest.raises(DatasetErrors, match="tensor_parquet_dir: dataset 's': folder does not exist"):
        data.setup("fit")


def test_stored_token_count_adds_a_text_length():
    size = StoredTokenCount("vae_latent", patch=(1, 2, 2), text_column="text_embedding")
    # Wan at 720p: 31 latent frames of 90x160 -> 31 * 45 * 80 tokens, plus L = 77 text tokens.
    assert size({"shapes": {"vae_latent": (16, 31, 90, 160), "text_embedding": (77, 4096)}}) == 111600 + 77


def test_validate_with_a_model_checks_the_columns_it_trains_from(tmp_path):
    import io

    from ff_core.cli.data import main

    tensors = {"prompt_embeds": torch.zeros(3, 4), "latent": torch.zeros(2, 4, 4)}
    write_rows(tmp_path / "s", [{"prompt": "", **tensors}])
    out = io.StringIO()
    assert main(["validate", str(tmp_path / "s"), "--model", "sd3-5"], out) == 2
    assert out.getvalue().splitlines() == [
        f"{tmp_path}/s/worker_0/data_chunk_0.parquet: pooled_prompt_embeds: no tensor column 'pooled_prompt_embeds' "
        "(pooled_prompt_embeds_bytes, _shape, _dtype), which adapter 'sd3-5' trains from; the dataset has "
        "prompt_embeds, latent", f"ff data validate: 1 problem(s) in {tmp_path}/s"]
    write_rows(tmp_path / "ok", [{"prompt": "", **tensors, "pooled_prompt_embeds": torch.zeros(8)}])
    assert main(["validate", str(tmp_path / "ok"), "--model", "sd3-5"], io.StringIO()) == 0


def test_stripped_text_embeddings_are_zero_padded_to_the_declared_length(tmp_path):
    """The card stores text embeddings ``[L, D]`` with padding stripped; Wan's pipeline pads them with zeros to 512.
    Declared ``pad``, rows of different ``L`` read as the padded tensors and batch together; a longer row is an error
    naming file and row."""
    columns = TensorColumns(condition={"text_embedding": "prompt_embeds"}, pad={"text_embedding": 6})
    rows = [{"prompt": "", "text_embedding": torch.arange(1.0, 1 + 5 * n).reshape(n, 5), "latent": torch.zeros(2, 2)}
            for n in (2, 6, 4, 7)]
    write_rows(tmp_path / "text", rows, rows_per_file=2)
    table = rows_of([tmp_path / "text"], columns)
    processor = TensorRowProcessor(table, columns)
    batch = materialize(TensorRowCollator().collate([processor.process(i) for i in range(3)]))
    embeds = batch["condition"]["prompt_embeds"]
    assert embeds.shape == (3, 6, 5)
    for k, n in enumerate((2, 6, 4)):
        assert torch.equal(embeds[k, :n], rows[k]["text_embedding"]) and not embeds[k, n:].any()
    with pytest.raises(DatasetError, match=r"data_chunk_1.parquet: row group 1, row 0: text_embedding: 7 entries on "
                                           r"axis 0, more than the pad length 6"):
        processor.process(3)
    with pytest.raises(ValueError, match="TensorColumns.pad"):
        TensorColumns(condition=("a",), pad={"latent": 4})


def sd3_row(i: int, negative: bool) -> dict:
    row = {"prompt": f"p{i}", "prompt_embeds": torch.full((3, 4), float(i)), "pooled_prompt_embeds": torch.zeros(8),
           "latent": torch.zeros(2, 4, 4)}
    if negative:
        row |= {"negative_prompt_embeds": torch.ones(3, 4), "negative_pooled_prompt_embeds": torch.ones(8)}
    return row


def test_optional_columns_are_read_only_when_every_root_has_them(tmp_path):
    """SD3's negative-prompt embeddings are optional: read when all roots store them, else from none (one batch never
    mixes rows with and without them)."""
    from ff_sd3.adapter import SD3Adapter

    write_rows(tmp_path / "neg", [sd3_row(i, True) for i in range(2)])
    write_rows(tmp_path / "plain", [sd3_row(i, False) for i in range(2)])

    def read(*names):
        configs = [DatasetConfig(name=n, tensor_parquet_dir=str(tmp_path / n)) for n in names]
        return [set(s.dataset.tensor_names) for s in open_shards(configs, SD3Adapter.tensor_columns, "sd3-5")]

    required = {"prompt_embeds", "pooled_prompt_embeds", "latent"}
    assert read("neg") == [required | {"negative_prompt_embeds", "negative_pooled_prompt_embeds"}]
    assert read("neg", "plain") == [required, required]


def test_setup_warns_when_row_groups_hold_many_rows_and_no_window_is_set(tmp_path, caplog):
    import pyarrow.parquet as pq

    write_rows(tmp_path / "ff", [sd3_row(i, False) for i in range(4)])
    table = pa.concat_tables([pq.read_table(f) for f in sorted((tmp_path / "ff").rglob("*.parquet"))])
    (tmp_path / "ref" / "w").mkdir(parents=True)
    pq.write_table(table, tmp_path / "ref" / "w" / "data_chunk_0.parquet", row_group_size=4)

    def warnings(root, **kw):
        caplog.clear()
        FlowDataModule([{"name": "s", "tensor_parquet_dir": str(root)}], adapter="sd3-5", **kw).setup("fit")
        return [r.getMessage() for r in caplog.records if "row_group_window" in r.getMessage()]

    assert warnings(tmp_path / "ff") == []  # ff's layout: one row per group
    assert warnings(tmp_path / "ref") == [
        "data.datasets: tensor-parquet row groups hold up to 4 rows and Parquet decodes whole groups: a uniformly "
        "shuffled row order decodes a group per row. Set data.row_group_window (e.g. 4) to shuffle groups, then rows "
        "within windows of groups"]
    assert warnings(tmp_path / "ref", row_group_window=2) == []


@pytest.mark.parametrize("hand_off", [None, False])
def test_data_hand_off_turns_file_ranges_off(tmp_path, hand_off):
    """``data.hand_off`` (default true): workers hand uncompressed values over as file ranges; ``false``: they read
    them and the rows cross in shared memory (shards far larger than RAM, FUSE)."""
    write_rows(tmp_path / "s", [sd3_row(i, False) for i in range(2)])
    kw = {} if hand_off is None else {"hand_off": hand_off}
    data = FlowDataModule([{"name": "s", "tensor_parquet_dir": str(tmp_path / "s")}], adapter="sd3-5", **kw)
    data.setup("fit")
    ds = data.train_rows.datasets[0]
    crossed = next(iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)))
    lazy = {k for k, v in crossed.items() if isinstance(v, LazyValue)}
    assert lazy == (set() if hand_off is False else {"prompt_embeds", "pooled_prompt_embeds", "latent"})
    with pytest.raises(ValueError, match="data.hand_off must be true or false, got 'auto'"):
        FlowDataModule([{"name": "s", "tensor_parquet_dir": str(tmp_path / "s")}], hand_off="auto")
