"""The dataset card (``README.md``, with the Hub's YAML front matter) and ``LICENSE`` of a smoke dataset."""

from __future__ import annotations

from typing import Any

from ff_core.data.smoke.catalogue import ROWS_PER_ALIAS

_TITLES = {"sft": "SFT demonstrations", "offline-dpo": "offline-DPO preferences"}


def readme(manifest: dict[str, Any]) -> str:
    """The card of the dataset ``manifest`` describes: one Hub config per alias (its ``train.jsonl``), what the rows
    hold, the alias table, how to prepare a run from it and how it was made."""
    algorithm, profiles = manifest["algorithm"], manifest["profiles"]
    front = ["---", "license: cc0-1.0", f"pretty_name: Flow-Factory {_TITLES[algorithm]} smoke dataset",
             "tags: [synthetic, smoke-test, flow-matching]", "size_categories: [n<1K]", "configs:"]  # fmt: skip
    for name, entry in profiles.items():
        front += [f"  - config_name: {name}", "    data_files:", "      - split: train",
                  f"        path: {entry['train']}"]
    rows = ["| alias | profile | ff adapter | outputs | inputs | geometry |", "|---|---|---|---|---|---|"]
    for name, entry in profiles.items():
        forms = " / ".join(", ".join(i.get("slot") or i["type"] for i in form) or "prompt" for form in entry["inputs"])
        geometry = ", ".join(f"{k} {v}" for k, v in entry["geometry"].items())
        adapter = entry["adapter"] + (f" ({entry['variant']})" if entry["variant"] else "")
        rows.append(f"| `{name}` | {entry['profile']} | `{adapter}` | {' + '.join(entry['outputs'])} | {forms} | "
                    f"{geometry} |")  # fmt: skip
    unserved = "".join(f"\n* `{n}`: {why}" for n, why in manifest["unserved"].items())
    supervision = ("one `demonstration` target per row" if algorithm == "sft" else
                   "a `preference` pair per row: the chosen candidate and a corrupted rejected one; a rejected "
                   "video keeps the chosen clip's decoded first and last frames, so conditioned workflows stay "
                   "valid")  # fmt: skip
    body = f"""
# Flow-Factory {_TITLES[algorithm]} smoke dataset

A tiny, self-contained, synthetic dataset for smoke runs of `{algorithm}` training (the dataset guide's "Public offline
smoke datasets"). Each alias holds {ROWS_PER_ALIAS} strict V2 records (`schema_version: 2`), {supervision}: two
local batches on up to 16 ranks at batch size 1. Media paths are relative to the alias's folder
(`profiles/<alias>/`); provenance is in every record's `metadata`, in `provenance.json` (generator, seed, library
versions, the SHA-256 of every file) and in `manifest.json`.

{chr(10).join(rows)}
{f"{chr(10)}Not in this build (no installed adapter serves them):{unserved}{chr(10)}" if unserved else ""}
## Use

Materialise exactly `world_size x per_device_batch_size x batches_per_rank` rows for one run (media copied next to its
`train.jsonl`, validated against the adapter's contract; nothing preprocessed or cached):

```bash
ff data smoke prepare --algorithm {algorithm} --profile <alias> --world-size 8 --source {manifest['repo_id']}@<commit>
```

## How it was made

`ff data smoke build OUT --seed {manifest['seed']}` (catalogue version {manifest['catalogue_version']}) writes this
folder and its sibling byte for byte: procedural scenes (a coloured shape moving across a plain background, a steady
tone), deterministic encoders. No downloads, no real people, no third-party content.

## License

CC0-1.0 (see `LICENSE`).
"""
    return "\n".join(front + ["---"]) + "\n" + body


def license_text() -> str:
    return """CC0 1.0 Universal (CC0-1.0) Public Domain Dedication

The media and records of this dataset were generated procedurally by ff (`ff data smoke build`); they contain no
third-party material. To the extent possible under law, the authors have waived all copyright and related or
neighboring rights to this dataset.

Full legal text: https://creativecommons.org/publicdomain/zero/1.0/legalcode
"""
