"""Shared tiny builders for plugin tests: offline tokenizers, a briefly trained tiny VAE, tiny datasets.

Every plugin's tiny-checkpoint factory needs the same three things, built offline in seconds:

* **tokenizers** from an in-memory vocabulary (:func:`build_clip_tokenizer`, :func:`build_t5_tokenizer` (also the
  (U)MT5 tokenizer Wan ships), :func:`build_gemma_tokenizer`,
  :func:`build_qwen2_tokenizer`): every word of the test datasets' vocabulary is one
  token, any other text falls back to characters, so nothing crashes on unseen prompts;
* **a tiny image VAE** (:func:`build_tiny_image_vae`): a diffusers ``AutoencoderKL`` trained briefly on the shapes
  images (:func:`train_vae`) with its ``shift_factor`` / ``scaling_factor`` set from the latent statistics
  (:func:`latent_statistics`), so that decode inverts encode and latents are zero-mean, unit-variance as a
  released family's are (Esser et al. 2024, sec. 5.2). With ``cache_dir`` it is built once per folder (and once per
  process) and loaded back with ``from_pretrained``;
* **tiny datasets** for every output kind (:func:`write_tiny_dataset`: ``image`` shapes, ``video`` moving shapes,
  ``audio`` tones).

Example (a plugin's factory)::

    from ff_core.testing.tiny import build_clip_tokenizer, build_t5_tokenizer, build_tiny_image_vae, seeded

    tokenizer, tokenizer_2 = build_clip_tokenizer(16), build_t5_tokenizer(16)
    vae = build_tiny_image_vae(seed=4, latent_channels=16, train_dir=shapes / "images", cache_dir=build / "vae")
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

T = TypeVar("T")

WORDS: tuple[str, ...] = (
    # shapes demo vocabulary (ff_core.testing.shapes): colours, shapes, backgrounds, glue words
    "red", "green", "blue", "yellow", "magenta", "cyan", "white", "black", "gray",
    "circle", "square", "triangle", "a", "on", "background",
    # fillers for hand-written prompts
    "an", "the", "of", "and", "with", "in", "grey", "orange", "purple", "photo", "image", "shape", "small", "big",
)  # fmt: skip
"""The image datasets' vocabulary (:mod:`ff_core.testing.shapes` plus fillers): the default of every tokenizer."""

VIDEO_WORDS: tuple[str, ...] = (
    "red", "green", "blue", "yellow", "magenta", "cyan", "white", "black", "gray",
    "circle", "square", "triangle", "a", "on", "background", "moving", "left", "right", "to", "the",
    "an", "of", "and", "with", "in", "video", "shape", "small", "big",
)  # fmt: skip
"""The video datasets' vocabulary (:mod:`ff_core.testing.moving_shapes`: colours, shapes, directions)."""

_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
_LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789"


def seeded(seed: int, build: Callable[[], T]) -> T:
    """``build()`` after ``torch.manual_seed(seed)``: each component of a tiny checkpoint gets its own seed, so
    changing one component's size leaves the others' weights as they were."""
    torch.manual_seed(seed)
    return build()


# -- tokenizers --------------------------------------------------------------------------------------------------
def build_clip_tokenizer(max_length: int = 16, words: Sequence[str] = WORDS):
    """A CLIP BPE tokenizer (``transformers.CLIPTokenizer``) whose merges spell each of ``words`` as one token
    (``word</w>``); every byte has a symbol, so any text tokenizes.

    Args:
        max_length: ``model_max_length`` (the text encoder's position table must be at least this long).
        words: the vocabulary spelled as single tokens.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    alphabet = sorted(ByteLevel.alphabet())
    for token in alphabet + [c + "</w>" for c in alphabet]:
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in words:
        # Spell the word with the merges so far, then append left-to-right merges of what is left. Appended
        # merges rank below every earlier one, so words already spelled as one token stay one token.
        parts = _apply_bpe([*word[:-1], word[-1] + "</w>"], {m: r for r, m in enumerate(merges)})
        merged = parts[0]
        for part in parts[1:]:
            merges.append((merged, part))
            merged += part
            vocab.setdefault(merged, len(vocab))
    for token in (_CLIP_BOS, _CLIP_EOS):
        vocab.setdefault(token, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def _apply_bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the best-ranked adjacent pair until none is ranked (BPE on one word)."""
    while len(symbols) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
        if rank == len(ranks):
            break
        symbols = [*symbols[:i], symbols[i] + symbols[i + 1], *symbols[i + 2 :]]
    return symbols


def build_t5_tokenizer(max_length: int = 16, words: Sequence[str] = WORDS):
    """A T5 unigram tokenizer (``transformers.T5Tokenizer``): one piece per word of ``words``, letters and digits as
    fallback, ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 as T5's and UMT5's (Wan ships google/umt5-xxl's tokenizer with
    the same special tokens, so this one stands in for it too).

    Args:
        max_length: ``model_max_length``.
        words: the vocabulary spelled as single pieces.
    """
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in words] + [("\u2581", -5.0)]
    pieces += [(c, -10.0) for c in _LETTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def build_gemma_tokenizer(max_length: int = 16, words: Sequence[str] = WORDS):
    """A Gemma BPE tokenizer (``transformers.GemmaTokenizerFast``) with Gemma's special tokens (``<pad>`` 0,
    ``<eos>`` 1, ``<bos>`` 2 (prepended), ``<unk>`` 3) whose merges spell each word of ``words`` as one token;
    letters and digits are single tokens, anything else is ``<unk>``.

    Args:
        max_length: ``model_max_length``.
        words: the vocabulary spelled as single tokens.
    """
    from transformers import GemmaTokenizerFast

    vocab = {t: i for i, t in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))}
    for c in "\u2581" + _LETTERS:
        vocab.setdefault(c, len(vocab))
    merges: list[tuple[str, str]] = []
    # Gemma adds no prefix space: a prompt's first word is ``word``, every later one ``▁word``; spell both.
    for spelled in [w for word in words for w in ("\u2581" + word, word)]:
        # As for CLIP: spell with the merges so far, then append left-to-right merges of what is left.
        parts = _apply_bpe(list(spelled), {m: r for r, m in enumerate(merges)})
        merged = parts[0]
        for part in parts[1:]:
            merges.append((merged, part))
            merged += part
            vocab.setdefault(merged, len(vocab))
    # add_bos_token explicitly: the released tokenizer prepends <bos>, and without the flag none is added here.
    return GemmaTokenizerFast(vocab=vocab, merges=merges, model_max_length=max_length, add_bos_token=True)


QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)  # fmt: skip
"""Qwen2/Qwen3-VL's special tokens (end of text, chat turns, the vision block markers Qwen3-VL's processor reads)."""


def build_qwen2_tokenizer(max_length: int = 64, words: Sequence[str] = WORDS):
    """A Qwen2 byte-level BPE tokenizer (``transformers.Qwen2TokenizerFast``, what Qwen2.5 / Qwen3-VL ship) whose merges
    spell each word of ``words`` as one token (``word`` and ``Ġword``, after a space); every byte has a symbol, so any
    text tokenizes. :data:`QWEN_SPECIAL_TOKENS` are special tokens (never split), so ``Qwen3VLProcessor`` finds its
    vision markers.

    Args:
        max_length: ``model_max_length``.
        words: the vocabulary spelled as single tokens.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2TokenizerFast

    vocab: dict[str, int] = {}
    for token in sorted(ByteLevel.alphabet()):
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for spelled in [w for word in words for w in ("\u0120" + word, word)]:  # Ġ: the byte-level space
        parts = _apply_bpe(list(spelled), {m: r for r, m in enumerate(merges)})
        merged = parts[0]
        for part in parts[1:]:
            merges.append((merged, part))
            merged += part
            vocab.setdefault(merged, len(vocab))
    for token in QWEN_SPECIAL_TOKENS:
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=merges, model_max_length=max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    return tokenizer


# -- a tiny VAE trained on the shapes ----------------------------------------------------------------------------
def load_images(folder: str | Path, size: int) -> Tensor:
    """Every PNG/JPEG under ``folder`` (sorted), RGB, resized to ``size``, as float (N, 3, size, size) in [-1, 1]."""
    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not files:
        raise FileNotFoundError(f"{str(folder)!r} holds no .png/.jpg images")
    out = []
    for f in files:
        img = Image.open(f).convert("RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.BICUBIC)
        t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1)
        out.append(t.float() / 127.5 - 1)
    return torch.stack(out)


def train_vae(vae, images: Tensor, *, steps: int, batch_size: int, lr: float, kl_weight: float, seed: int) -> float:
    """Train a diffusers VAE in place for reconstruction: pixel MSE of the decoded posterior sample + ``kl_weight``
    * KL per latent element, Adam with a one-cycle schedule; returns the last loss.

    Args:
        vae: any diffusers autoencoder with ``encode(x).latent_dist`` and ``decode(z).sample``.
        images: training inputs in [-1, 1], batch-first in the VAE's layout ((N, 3, H, W); a video VAE's
            (N, 3, F, H, W)).
        steps: Adam steps.
        batch_size: inputs per step.
        lr: peak learning rate.
        kl_weight: weight of the KL term.
        seed: seed of batch drawing and posterior sampling.
    """
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # posterior sampling uses the global generator
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    vae.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x = images[torch.randint(len(images), (min(batch_size, len(images)),), generator=g)]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        kl = posterior.kl().mean() / posterior.mean[0].numel()  # per latent element
        loss = torch.nn.functional.mse_loss(recon, x) + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    vae.eval()
    return float(loss.detach())


@torch.no_grad()
def latent_statistics(vae, images: Tensor) -> tuple[float, float]:
    """``(shift_factor, scaling_factor)`` making posterior samples of ``images`` zero-mean, unit-variance."""
    torch.manual_seed(0)
    z = torch.cat([vae.encode(images[i : i + 64]).latent_dist.sample() for i in range(0, len(images), 64)])
    return float(z.mean()), float(1.0 / z.std())


_VAE_CACHE: dict[str, Any] = {}


def build_tiny_image_vae(
    *,
    seed: int = 0,
    image_size: int = 32,
    latent_channels: int = 4,
    block_out_channels: Sequence[int] = (16, 32, 32),
    train_dir: str | Path | None = None,
    steps: int = 300,
    batch_size: int = 16,
    lr: float = 4e-3,
    kl_weight: float = 1e-5,
    train_seed: int | None = None,
    cache_dir: str | Path | None = None,
    shift_factor: float = 0.0,
    scaling_factor: float = 1.0,
):
    """A tiny diffusers ``AutoencoderKL`` in the SD3 / FLUX.1 layout (no quant convs; ``2 ** (len(blocks) - 1)``x
    downsampling), trained briefly on ``train_dir``'s images when given.

    Trained, its ``shift_factor`` / ``scaling_factor`` make the posterior samples of the training images zero-mean,
    unit-variance; untrained (the fast path for plumbing tests) they are the arguments'. With ``cache_dir``,
    the trained VAE is saved under ``cache_dir/<key>`` (key: a hash of every argument and the image files' names and
    sizes) and loaded back with ``from_pretrained`` on later calls, in this process from memory: one build per
    session and per build folder.

    Args:
        seed: seed of the initialisation (and of training, unless ``train_seed`` is given).
        image_size: ``sample_size`` and the side the training images are resized to.
        latent_channels: latent channels (SD3: 16 in the released model, 4 here; FLUX.1: 16).
        block_out_channels: channels per encoder level.
        train_dir: folder of images (searched recursively for PNG/JPEG), e.g. the shapes dataset's ``images/``;
            ``None``: random weights.
        steps: Adam steps of VAE training.
        batch_size: images per training step.
        lr: peak Adam learning rate (one-cycle schedule).
        kl_weight: weight of the KL term (per latent element) against the pixel MSE.
        train_seed: seed of batch drawing and posterior sampling in training; ``None``: ``seed``.
        cache_dir: where trained VAEs are kept; ``None``: build every time.
        shift_factor: the untrained VAE's ``shift_factor`` (trained: fitted). A non-trivial latent normalisation lets
            a reference check see an adapter that ignores it.
        scaling_factor: the untrained VAE's ``scaling_factor`` (trained: fitted).
    """
    from diffusers import AutoencoderKL

    train_seed = seed if train_seed is None else train_seed

    def build() -> AutoencoderKL:
        n = len(block_out_channels)
        return AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(block_out_channels), layers_per_block=1,
            latent_channels=latent_channels, norm_num_groups=8, sample_size=image_size, scaling_factor=scaling_factor,
            shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
        )  # fmt: skip

    if train_dir is None:
        return seeded(seed, build)
    files = sorted(p for p in Path(train_dir).rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    args = dict(seed=seed, train_seed=train_seed, image_size=image_size, latent_channels=latent_channels, lr=lr,
                steps=steps, block_out_channels=list(block_out_channels), batch_size=batch_size, kl_weight=kl_weight,
                files=[(p.name, p.stat().st_size) for p in files])  # fmt: skip
    key = "vae-" + hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / key if cache_dir is not None else None
    if folder is not None and str(folder) in _VAE_CACHE:
        return _copy(_VAE_CACHE[str(folder)])
    if folder is not None and (folder / "config.json").is_file():
        vae = AutoencoderKL.from_pretrained(folder)
    else:
        vae = seeded(seed, build)
        images = load_images(train_dir, image_size)
        train_vae(vae, images, steps=steps, batch_size=batch_size, lr=lr, kl_weight=kl_weight, seed=train_seed)
        shift, scale = latent_statistics(vae, images)
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        if folder is not None:
            _save_atomically(vae, folder)
    if folder is not None:
        _VAE_CACHE[str(folder)] = vae
    return _copy(vae.eval())


def _save_atomically(vae, folder: Path) -> None:
    """``save_pretrained`` into a temporary folder beside ``folder``, then publish it whole (a build interrupted
    mid-save leaves no ``config.json`` without weights for the next session to load)."""
    import shutil
    import tempfile

    from ff_core.atomic import replace_dir

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp creates 0700; the published folder is an ordinary one
        vae.save_pretrained(tmp)
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy(vae):
    """A fresh copy, so a caller that trains or moves its VAE leaves the cached one as built."""
    import copy

    return copy.deepcopy(vae)


# -- tiny datasets -----------------------------------------------------------------------------------------------
OUTPUT_KINDS: tuple[str, ...] = ("image", "video", "audio")


def write_tiny_dataset(root: str | Path, kind: str, n: int = 8, *, size: int = 32, seed: int = 0) -> Path:
    """A tiny V2 SFT dataset folder (``train.jsonl`` + media + ``test.txt``) whose targets are of output ``kind``.

    ``image``: the shapes (:func:`ff_core.testing.shapes.write_shapes_dataset`, ``images/``); ``video``: moving
    shapes, 9 frames at 8 fps (:func:`ff_core.testing.moving_shapes.write_moving_shapes_dataset`, ``videos/``);
    ``audio``: 0.5 s mono 16 kHz WAV tones whose pitch the caption names (``audio/``).

    Args:
        root: the dataset folder (created).
        kind: one of :data:`OUTPUT_KINDS`.
        n: training records.
        size: image / frame side in pixels (even).
        seed: drawing seed.
    """
    if kind == "image":
        from ff_core.testing.shapes import write_shapes_dataset

        return write_shapes_dataset(root, n_train=n, n_test=6, size=size, seed=seed)
    if kind == "video":
        from ff_core.testing.moving_shapes import write_moving_shapes_dataset

        return write_moving_shapes_dataset(root, n_train=n, n_test=4, width=size, height=size, seed=seed)
    if kind == "audio":
        return _write_tone_dataset(Path(root), n)
    raise ValueError(f"kind must be one of {OUTPUT_KINDS}, got {kind!r}")


_PITCHES = {"low": 220.0, "middle": 440.0, "high": 880.0}


def _write_tone_dataset(root: Path, n: int, seconds: float = 0.5, rate: int = 16000) -> Path:
    from ff_core.callbacks.media_log import audio_to_wav

    lines, t = [], np.arange(int(seconds * rate)) / rate
    for i in range(n):
        pitch = list(_PITCHES)[i % len(_PITCHES)]
        rel = f"audio/{i:05d}.wav"
        tone = torch.from_numpy(0.25 * np.sin(2 * np.pi * _PITCHES[pitch] * t)).float()[None]  # (C=1, N)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(audio_to_wav(tone, rate))  # ff's one WAV writer (what media logging writes)
        lines.append(json.dumps({"schema_version": 2, "input": {"prompt": f"a {pitch} tone", "media": []},
                                 "supervision": {"type": "demonstration",
                                                 "target": {"media": [{"type": "audio", "path": rel}]}}}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "test.txt").write_text("".join(f"a {p} tone\n" for p in _PITCHES))
    return root
