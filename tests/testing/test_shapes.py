"""The shapes demo dataset: exact record structure, determinism, and a classifier that is exact on it."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from PIL import Image

from ff_core.testing.shapes import (
    BACKGROUNDS,
    COLOURS,
    PALETTE,
    SHAPES,
    dominant_colour,
    main,
    prompt_colour,
    write_preference_dataset,
    write_shapes_dataset,
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_shapes_dataset(tmp_path_factory.mktemp("shapes"), n_train=96, n_test=12, size=32, seed=0)


def _digest(root) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_records_have_the_exact_v2_structure(dataset):
    lines = (dataset / "train.jsonl").read_text().splitlines()
    assert len(lines) == 96
    first = json.loads(lines[0])
    meta = first["metadata"]
    expected = {
        "schema_version": 2,
        "input": {"prompt": f"a {meta['colour']} {meta['shape']} on a {meta['background']} background", "media": []},
        "supervision": {"type": "demonstration", "target": {"media": [{"type": "image", "path": "images/00000.png"}]}},
        "metadata": meta,
    }
    assert first == expected
    # Compact separators and this key order, byte for byte.
    assert lines[0] == json.dumps(expected, separators=(",", ":"))
    for line in lines:
        rec = json.loads(line)
        assert list(rec) == ["schema_version", "input", "supervision", "metadata"]
        m = rec["metadata"]
        assert m["colour"] in PALETTE and m["shape"] in SHAPES and m["background"] in BACKGROUNDS
        assert (dataset / rec["supervision"]["target"]["media"][0]["path"]).is_file()
    assert {json.loads(line)["metadata"]["colour"] for line in lines} == set(COLOURS)


def test_test_prompts_cover_every_colour(dataset):
    prompts = (dataset / "test.txt").read_text().splitlines()
    assert len(prompts) == 12
    assert sorted(prompt_colour(p) for p in prompts) == sorted(COLOURS * 2)


def test_dataset_is_deterministic_for_a_seed(dataset, tmp_path):
    again = write_shapes_dataset(tmp_path / "again", n_train=96, n_test=12, size=32, seed=0)
    assert _digest(again) == _digest(dataset)
    other = write_shapes_dataset(tmp_path / "other", n_train=96, n_test=12, size=32, seed=1)
    assert _digest(other) != _digest(dataset)


def test_classifier_is_exact_on_the_dataset(dataset):
    for line in (dataset / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        img = Image.open(dataset / rec["supervision"]["target"]["media"][0]["path"])
        tensor = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(32, 32, 3).permute(2, 0, 1)
        assert dominant_colour(img) == rec["metadata"]["colour"]
        assert dominant_colour(tensor) == rec["metadata"]["colour"]
        assert prompt_colour(rec["input"]["prompt"]) == rec["metadata"]["colour"]


@pytest.mark.parametrize("background", list(BACKGROUNDS.values()))
def test_plain_and_gray_images_have_no_colour(background):
    img = torch.tensor(background, dtype=torch.uint8).view(3, 1, 1).expand(3, 16, 16)
    assert dominant_colour(img) == "none"
    noise = torch.Generator().manual_seed(0)
    grayish = (torch.rand(1, 16, 16, generator=noise) * 255).to(torch.uint8).expand(3, 16, 16)
    assert dominant_colour(grayish) == "none"


def test_classifier_tolerates_off_palette_hues():
    orange_ish_red = torch.tensor([230, 40, 20], dtype=torch.uint8).view(3, 1, 1).expand(3, 8, 8)
    assert dominant_colour(orange_ish_red) == "red"
    assert dominant_colour(orange_ish_red.float() / 255) == "red"


def test_prompt_colour():
    assert prompt_colour("A Blue square on a black background") == "blue"
    assert prompt_colour("a dog") == "none"


def test_cli_writes_the_dataset(tmp_path, capsys):
    main([str(tmp_path / "d"), "--n-train", "6", "--n-test", "6"])
    assert len((tmp_path / "d" / "train.jsonl").read_text().splitlines()) == 6
    assert len(list((tmp_path / "d" / "images").glob("*.png"))) == 6


# -- preference pairs (offline DPO) ------------------------------------------------------------------------
def _pixels(path):
    with Image.open(path) as img:
        return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3)


def test_preference_pairs_are_strict_v2_records_that_differ_in_colour_alone(tmp_path):
    """Default: the chosen image shows the prompt's colour, the rejected one another colour; the same shape, place and
    background (the pixels differ exactly where the shape is); the records load as offline-DPO training data."""
    from ff_core.data.records.sources import DatasetConfig, load_split

    root = write_preference_dataset(tmp_path / "pairs", n_train=12, n_test=6, size=32, seed=0)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and [r["metadata"]["colour"] for r in rows] == list(COLOURS) * 2
    for i, row in enumerate(rows):
        meta, sup = row["metadata"], row["supervision"]
        assert list(row) == ["schema_version", "input", "supervision", "metadata"] and row["schema_version"] == 2
        assert sup == {"type": "preference",
                       "chosen": {"media": [{"type": "image", "path": f"pairs/{i:05d}_chosen.png"}]},
                       "rejected": {"media": [{"type": "image", "path": f"pairs/{i:05d}_rejected.png"}]}}  # fmt: skip
        assert meta["chosen"] == meta["colour"] == prompt_colour(row["input"]["prompt"]) != meta["rejected"]
        chosen, rejected = (_pixels(root / sup[arm]["media"][0]["path"]) for arm in ("chosen", "rejected"))
        assert dominant_colour(chosen.permute(2, 0, 1)) == meta["chosen"]
        assert dominant_colour(rejected.permute(2, 0, 1)) == meta["rejected"]
        background = torch.tensor(BACKGROUNDS[meta["background"]], dtype=torch.uint8)
        shape = (chosen != background).any(-1)
        assert shape.any() and torch.equal(shape, (rejected != background).any(-1))
        assert torch.equal(chosen[~shape], rejected[~shape])
    records = load_split(DatasetConfig(name="pairs", dataset_dir=str(root)), "train", "offline-dpo")
    assert len(records) == 12 and all(r.supervision == "preference" and len(r.candidates) == 2 for r in records)
    assert sorted(prompt_colour(p) for p in (root / "test.txt").read_text().splitlines()) == sorted(COLOURS)


def test_preference_shifts_pick_the_colours_and_the_cli_writes_them(tmp_path):
    """chosen_shift 3, rejected_shift 0: the opposite hue is preferred over the prompt's colour (the benchmark's)."""
    root = write_preference_dataset(tmp_path / "opposite", n_train=6, n_test=6, chosen_shift=3, rejected_shift=0)
    for line in (root / "train.jsonl").read_text().splitlines():
        meta = json.loads(line)["metadata"]
        k = COLOURS.index(meta["colour"])
        assert meta["chosen"] == COLOURS[(k + 3) % 6] and meta["rejected"] == meta["colour"]
    with pytest.raises(ValueError, match="pick the same colour"):
        write_preference_dataset(tmp_path / "same", chosen_shift=1, rejected_shift=7)
    for bad in (("green", "green"), ("green", "orange")):
        with pytest.raises(ValueError, match="two different palette colours"):
            write_preference_dataset(tmp_path / "bad", pair=bad)
    with pytest.raises(ValueError, match="without chosen/rejected shifts"):
        write_preference_dataset(tmp_path / "bad", pair=("green", "red"), chosen_shift=3)
    main([str(tmp_path / "cli"), "--preference", "--n-train", "6", "--n-test", "6", "--chosen-shift", "3",
          "--rejected-shift", "0"])  # fmt: skip
    assert (tmp_path / "cli" / "train.jsonl").read_text() == (root / "train.jsonl").read_text()
    assert _digest(tmp_path / "cli") == _digest(root)


def test_a_fixed_pair_ranks_two_colours_for_prompts_that_name_none(tmp_path):
    """pair=(green, red): every chosen image green, every rejected one red, prompts without a colour word; the test
    prompts are every shape on every background in turn."""
    root = write_preference_dataset(tmp_path / "pair", n_train=6, n_test=9, pair=("green", "red"))
    for line in (root / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        meta = row["metadata"]
        assert (meta["colour"], meta["chosen"], meta["rejected"]) == (None, "green", "red")
        assert row["input"]["prompt"] == f"a {meta['shape']} on a {meta['background']} background"
        for arm in ("chosen", "rejected"):
            image = _pixels(root / row["supervision"][arm]["media"][0]["path"]).permute(2, 0, 1)
            assert dominant_colour(image) == meta[arm]
    prompts = (root / "test.txt").read_text().splitlines()
    assert prompts == [f"a {s} on a {b} background" for b in BACKGROUNDS for s in SHAPES]
    assert all(prompt_colour(p) == "none" for p in prompts)
    main([str(tmp_path / "cli"), "--preference", "--n-train", "6", "--n-test", "9", "--pair", "green,red"])
    assert _digest(tmp_path / "cli") == _digest(root)
