"""MiniMax H3 training rows in tensor-parquet shards (docs/minimax.md, "Training from shards").

``ff data preprocess-latents`` stores per record what a training step would otherwise compute: the condition
``preprocess`` returns and the clean latents ``encode_output`` returns (both posterior modes in fp32, by default). The
column names follow FastVideo's tensor-parquet schemas (``pyarrow_schema_t2va``: ``vae_latent``, ``audio_latent``,
``text_embedding``; the Wan card's ``text_embedding``, padding stripped); the other condition columns keep the
condition keys they feed, so a Ref2VA row carries its whole condition prefix (the flattened reference latents, their
shapes, the soundtrack rows, the layout geometry and the canonical ``reference_manifest``) and FL2VA its keyframe
latents and anchors. The prefix itself (the references / keyframes noised to ``t = 0.999``) is never stored: it is
realised in ``prepare_condition`` from the stored latents with the objective's generator, as from the condition cache,
so shards and dataset folders give the same condition bit for bit (fp32 storage).

Text embeddings are stored unpadded ``(L, D)``: the adapters' ``condition_collation`` pads them per batch
(``prompt_embeds`` / ``text_token_tags``: ``pad``), as it pads cached conditions. Integer tensors (tags, anchors,
shapes, counts, the manifest's UTF-8 bytes) are stored as int64 / uint8 and are never cast by ``--dtype``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ff_core.contracts import TensorColumns

if TYPE_CHECKING:
    from ff_core.data.tensor_parquet.checks import StoredShape

#: Stored latent column -> LatentState component, in the state's order (video first, audio second).
LATENT_COLUMNS: dict[str, str] = {"vae_latent": "video", "audio_latent": "audio"}
#: Every workflow's text columns -> condition keys: the embeddings under the card's name, the tags under their own.
TEXT_COLUMNS: dict[str, str] = {"text_embedding": "prompt_embeds", "text_token_tags": "text_token_tags"}


def h3_columns(*condition_keys: str) -> TensorColumns:
    """The columns of an H3 workflow: :data:`TEXT_COLUMNS`, then ``condition_keys`` under their own names (FL2VA's
    keyframes, Ref2VA's references), then the two latent columns :data:`LATENT_COLUMNS`."""
    return TensorColumns(condition={**TEXT_COLUMNS, **{k: k for k in condition_keys}}, latents=LATENT_COLUMNS)


def _config(path: str | os.PathLike, subfolder: str) -> dict[str, Any]:
    """``<subfolder>/config.json`` of the checkpoint (config files only, never weights); ``{}`` when absent."""
    from ff_core.pretrained import read_config

    try:
        return read_config(path, subfolder=subfolder)
    except FileNotFoundError:
        return {}
    except OSError as exc:  # huggingface_hub's EntryNotFoundError for a hub file that does not exist
        if type(exc).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
            return {}
        raise


def stored_shapes(
    pretrained_model_name_or_path: str | os.PathLike | None, transformer_subfolder: str, columns: TensorColumns
) -> dict[str, StoredShape]:
    """What each stored column's per-row shape must be for one checkpoint, from its config files alone (``ff fit``
    checks every shard row against it before weights load; :meth:`~ff_core.adapter.Adapter.resolve_tensor_shapes`).

    * ``vae_latent`` (C, F', h, w): C = ``vae/config.json`` ``latent_channels``; F', h, w multiples of the
      transformer's ``patch_size`` (``patchify_video_latents`` reshapes by it).
    * ``audio_latent`` (2, C_a, L): stereo (the mono codec's two batch items), C_a = ``audio_vae/config.json``
      ``latent_channels``.
    * ``text_embedding`` (L, ``text_dim``): ``hidden_states[50]`` of Qwen3-VL, what the transformer's token refiner
      takes; ``text_token_tags`` (L,).
    * FL2VA ``keyframe_latents`` (k, C, 1, h, w) (one latent frame per keyframe), ``keyframe_anchors`` (k,).
    * Ref2VA ``reference_latents`` flat (N,), ``reference_shapes`` (n, 4) (each visual reference's (C, f, h, w)),
      ``reference_audio`` (rows, C_a), the per-reference codes and ``reference_manifest`` 1-D.

    A size the configs do not give is not checked; nothing without a checkpoint. Only the ``columns`` the workflow
    reads are returned.

    Args:
        pretrained_model_name_or_path: the checkpoint folder or hub id (``None``: unknown).
        transformer_subfolder: the workflow's transformer partition (``transformer`` / ``transformer_ref``).
        columns: the workflow's :class:`TensorColumns`.
    """
    from ff_core.data.tensor_parquet.checks import StoredShape

    if pretrained_model_name_or_path is None:
        return {}
    vae = _config(pretrained_model_name_or_path, "vae")
    audio_vae = _config(pretrained_model_name_or_path, "audio_vae")
    transformer = _config(pretrained_model_name_or_path, transformer_subfolder)
    channels = {0: int(vae["latent_channels"])} if "latent_channels" in vae else {}
    audio = int(audio_vae["latent_channels"]) if "latent_channels" in audio_vae else None
    patch = [int(p) for p in transformer.get("patch_size") or ()]
    video_multiples = dict(zip((1, 2, 3), patch))
    one_d = StoredShape(1, meaning="(n,)")
    shapes = {
        "vae_latent": StoredShape(4, channels, video_multiples,
                                  "(C, F', h, w): C = the video VAE's latent_channels, F', h, w multiples of the "
                                  "transformer's patch_size"),
        "audio_latent": StoredShape(3, {0: 2, **({1: audio} if audio else {})}, meaning="(2, C_a, L): stereo, "
                                    "C_a = the audio VAE's latent_channels"),
        "text_embedding": StoredShape(2, {-1: int(transformer["text_dim"])} if "text_dim" in transformer else {},
                                      meaning="(L, text_dim)"),
        "text_token_tags": StoredShape(1, meaning="(L,)"),
        "keyframe_latents": StoredShape(5, {1 + a: n for a, n in channels.items()} | {2: 1},
                                        {3 + i: p for i, p in enumerate(patch[1:])},
                                        "(k, C, 1, h, w): C = the video VAE's latent_channels, h, w multiples of the "
                                        "transformer's patch_size"),
        "keyframe_anchors": StoredShape(1, meaning="(k,)"),
        "reference_latents": StoredShape(1, meaning="(N,): the visual references' latents flattened"),
        "reference_shapes": StoredShape(2, {1: 4}, meaning="(n, 4): each visual reference's (C, f, h, w)"),
        "reference_audio": StoredShape(2, {1: audio} if audio else {}, meaning="(rows, C_a)"),
        "reference_audio_rows": one_d, "reference_kinds": one_d, "reference_has_audio": one_d,
        "reference_manifest": StoredShape(1, meaning="(bytes,): UTF-8 JSON"),
    }  # fmt: skip
    return {c: shapes[c] for c in (*columns.condition, *columns.latents) if c in shapes}


__all__ = ["LATENT_COLUMNS", "TEXT_COLUMNS", "h3_columns", "stored_shapes"]
