"""Shared tiny builders for plugin tests: offline tokenizers, a briefly trained tiny VAE, tiny datasets.

Every plugin's tiny-checkpoint factory needs the same three things, built offline in seconds:

* **tokenizers** from an in-memory vocabulary (:func:`build_clip_tokenizer`, :func:`build_t5_tokenizer` (also the
  (U)MT5 tokenizer Wan ships), :func:`build_gemma_tokenizer`, :func:`build_qwen2_tokenizer` (Qwen2.5 / Qwen3-VL),
  :func:`build_llama_tokenizer` (Llama 3 / LLaVA-Llama-3)): every word of the test datasets' vocabulary is one
  token, any other text falls back to characters (or bytes), so nothing crashes on unseen prompts; each pads on the
  side it was built with, also once saved and loaded back;
* **a tiny image VAE** (:func:`build_tiny_image_vae`): a diffusers ``AutoencoderKL`` trained briefly on the shapes
  images (:func:`train_vae`) with its ``shift_factor`` / ``scaling_factor`` set from the latent statistics
  (:func:`latent_statistics`), so that decode inverts encode and latents are zero-mean, unit-variance as a
  released family's are (Esser et al. 2024, sec. 5.2). With ``cache_dir`` it is built once per folder (and once per
  process) and loaded back with ``from_pretrained``; likewise **a tiny video VAE** (:func:`build_tiny_video_vae`, an
  ``AutoencoderKLWan`` with per-channel ``latents_mean`` / ``latents_std``) and **a tiny audio VAE**
  (:func:`build_tiny_audio_vae`, Stable Audio's waveform ``AutoencoderOobleck``);
* **tiny datasets** for every output kind (:func:`write_tiny_dataset`: ``image`` shapes, ``video`` moving shapes,
  ``audio`` tones, ``video+audio`` clips with their soundtrack; demonstrations or preference pairs).

Example (a plugin's factory)::

    from ff_core.testing.tiny import build_clip_tokenizer, build_t5_tokenizer, build_tiny_image_vae, seeded

    tokenizer, tokenizer_2 = build_clip_tokenizer(16), build_t5_tokenizer(16)
    vae = build_tiny_image_vae(seed=4, latent_channels=16, train_dir=shapes / "images", cache_dir=build / "vae")
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
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
# Every builder passes ``padding_side`` to the tokenizer's constructor: transformers saves the constructor's arguments
# (``init_kwargs``) to tokenizer_config.json, not the attribute, so a side set on a built tokenizer
# (``tokenizer.padding_side = "right"``) is lost by ``save_pretrained`` and the reloaded one pads on its class's default
# side (transformers 5: ``GemmaTokenizer`` and ``LlamaTokenizer`` pad on the left).
PADDING_SIDES: tuple[str, ...] = ("left", "right")
"""The sides a tokenizer may pad on (every builder's ``padding_side``)."""


def _check_padding_side(padding_side: str) -> str:
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    return padding_side


def _spelling_merges(spellings: Iterable[Sequence[str]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges that spell each symbol sequence of ``spellings`` as one token (each merged token added to
    ``vocab``): each is spelled with the merges so far, then left-to-right merges of what is left are appended.
    Appended merges rank below every earlier one, so sequences already spelled as one token stay one token."""
    merges: list[tuple[str, str]] = []
    for symbols in spellings:
        parts = _apply_bpe(list(symbols), {m: r for r, m in enumerate(merges)})
        merged = parts[0]
        for part in parts[1:]:
            merges.append((merged, part))
            merged += part
            vocab.setdefault(merged, len(vocab))
    return merges


def _apply_bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the best-ranked adjacent pair until none is ranked (BPE on one word)."""
    while len(symbols) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
        if rank == len(ranks):
            break
        symbols = [*symbols[:i], symbols[i] + symbols[i + 1], *symbols[i + 2 :]]
    return symbols


def build_clip_tokenizer(max_length: int = 16, words: Sequence[str] = WORDS, padding_side: str = "right"):
    """A CLIP BPE tokenizer (``transformers.CLIPTokenizer``) whose merges spell each of ``words`` as one token
    (``word</w>``); every byte has a symbol, so any text tokenizes.

    Args:
        max_length: ``model_max_length`` (the text encoder's position table must be at least this long).
        words: the vocabulary spelled as single tokens.
        padding_side: ``right`` (CLIP's), or ``left``; kept by ``save_pretrained``.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    alphabet = sorted(ByteLevel.alphabet())
    for token in alphabet + [c + "</w>" for c in alphabet]:
        vocab.setdefault(token, len(vocab))
    merges = _spelling_merges(([*word[:-1], word[-1] + "</w>"] for word in words), vocab)
    for token in (_CLIP_BOS, _CLIP_EOS):
        vocab.setdefault(token, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length,
                         padding_side=_check_padding_side(padding_side))  # fmt: skip


def build_t5_tokenizer(max_length: int = 16, words: Sequence[str] = WORDS, padding_side: str = "right"):
    """A T5 unigram tokenizer (``transformers.T5Tokenizer``): one piece per word of ``words``, letters and digits as
    fallback, ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 as T5's and UMT5's (Wan ships google/umt5-xxl's tokenizer with
    the same special tokens, so this one stands in for it too).

    Args:
        max_length: ``model_max_length``.
        words: the vocabulary spelled as single pieces.
        padding_side: ``right`` (T5's), or ``left``; kept by ``save_pretrained``.
    """
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in words] + [("\u2581", -5.0)]
    pieces += [(c, -10.0) for c in _LETTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length,
                       padding_side=_check_padding_side(padding_side))  # fmt: skip


def build_gemma_tokenizer(max_length: int = 16, words: Sequence[str] = WORDS, padding_side: str = "left"):
    """A Gemma BPE tokenizer (``transformers.GemmaTokenizerFast``) with Gemma's special tokens (``<pad>`` 0,
    ``<eos>`` 1, ``<bos>`` 2 (prepended), ``<unk>`` 3) whose merges spell each word of ``words`` as one token;
    letters and digits are single tokens, anything else is ``<unk>``.

    Args:
        max_length: ``model_max_length``.
        words: the vocabulary spelled as single tokens.
        padding_side: ``left`` (the released Gemma 3 tokenizer's; LTX-2's pipeline pads on the left), or ``right``
            (a prompt template cropped from the front needs it); kept by ``save_pretrained``.
    """
    from transformers import GemmaTokenizerFast

    vocab = {t: i for i, t in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))}
    for c in "\u2581" + _LETTERS:
        vocab.setdefault(c, len(vocab))
    # Gemma adds no prefix space: a prompt's first word is ``word``, every later one ``▁word``; spell both.
    merges = _spelling_merges((w for word in words for w in ("\u2581" + word, word)), vocab)
    # add_bos_token explicitly: the released tokenizer prepends <bos>, and without the flag none is added here.
    return GemmaTokenizerFast(vocab=vocab, merges=merges, model_max_length=max_length, add_bos_token=True,
                              padding_side=_check_padding_side(padding_side))  # fmt: skip


QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)  # fmt: skip
"""Qwen2/Qwen3-VL's special tokens (end of text, chat turns, the vision block markers Qwen3-VL's processor reads)."""


def build_qwen2_tokenizer(max_length: int = 64, words: Sequence[str] = WORDS, padding_side: str = "right"):
    """A Qwen2 byte-level BPE tokenizer (``transformers.Qwen2TokenizerFast``, what Qwen2.5 / Qwen3-VL ship) whose merges
    spell each word of ``words`` as one token (``word`` and ``Ġword``, after a space); every byte has a symbol, so any
    text tokenizes. :data:`QWEN_SPECIAL_TOKENS` are special tokens (never split), so ``Qwen3VLProcessor`` finds its
    vision markers and a Qwen chat template's turn markers are one token each; ``<|endoftext|>`` pads.

    Args:
        max_length: ``model_max_length``.
        words: the vocabulary spelled as single tokens.
        padding_side: ``right`` (Qwen2's), or ``left``; kept by ``save_pretrained``.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2TokenizerFast

    vocab: dict[str, int] = {}
    for token in sorted(ByteLevel.alphabet()):
        vocab.setdefault(token, len(vocab))
    merges = _spelling_merges((w for word in words for w in ("\u0120" + word, word)), vocab)  # Ġ: byte-level space
    for token in QWEN_SPECIAL_TOKENS:
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=merges, model_max_length=max_length,
                                   padding_side=_check_padding_side(padding_side))  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    return tokenizer


LLAMA_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<pad>",
)  # fmt: skip
"""Llama 3's special tokens (begin / end of text, the chat template's header and turn markers) and the ``<pad>``
token LLaVA-Llama-3 (HunyuanVideo's text encoder) adds."""


def build_llama_tokenizer(max_length: int = 64, words: Sequence[str] = WORDS, padding_side: str = "right"):
    """A Llama BPE tokenizer (``transformers.LlamaTokenizerFast``, the class HunyuanVideo's LLaVA-Llama-3 text encoder
    is loaded with) with Llama 3's special tokens (:data:`LLAMA_SPECIAL_TOKENS`): ``<|begin_of_text|>`` prepended
    (BOS), ``<|end_of_text|>`` (EOS), ``<pad>`` padding, and the chat markers ``<|start_header_id|>``,
    ``<|end_header_id|>``, ``<|eot_id|>`` one token each, so a Llama 3 prompt template (HunyuanVideo's) tokenizes
    as the released one does around the prompt. Merges spell each word of ``words`` as one token (``▁word`` and
    ``word``, the first word after a special token or a newline); letters and digits are single tokens and any other
    character its UTF-8 bytes (``<0x0A>``, Llama's byte fallback), so any text tokenizes, never to ``<unk>``.

    Args:
        max_length: ``model_max_length`` (a template's tokens count too: HunyuanVideo reads ``crop_start`` more
            tokens than ``max_sequence_length``).
        words: the vocabulary spelled as single tokens.
        padding_side: ``right`` (default: Llama 3's, and what a template cropped from the front needs,
            :func:`ff_core.prompt_templates.encode_with_template`), or ``left``; kept by ``save_pretrained`` (the
            class's own default is ``left``).
    """
    from transformers import LlamaTokenizerFast

    bos, eos, *markers, pad = LLAMA_SPECIAL_TOKENS
    vocab = {"<unk>": 0}
    for token in (bos, eos, pad, *markers, *(f"<0x{b:02X}>" for b in range(256)), *("\u2581" + _LETTERS)):
        vocab.setdefault(token, len(vocab))
    merges = _spelling_merges((w for word in words for w in ("\u2581" + word, word)), vocab)
    return LlamaTokenizerFast(vocab=vocab, merges=merges, bos_token=bos, eos_token=eos, pad_token=pad,
                              unk_token="<unk>", add_bos_token=True, additional_special_tokens=list(markers),
                              model_max_length=max_length, padding_side=_check_padding_side(padding_side))  # fmt: skip


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

    The one-cycle warm-up is 10 % of the steps, and at least 2 steps from 3 steps on (OneCycleLR divides by each
    phase's length: fewer steps would make one empty); 1 or 2 steps run at ``lr``.

    Args:
        vae: any diffusers autoencoder with ``encode(x).latent_dist`` and ``decode(z).sample``.
        images: training inputs in [-1, 1], batch-first in the VAE's layout ((N, 3, H, W); a video VAE's
            (N, 3, F, H, W); an audio VAE's (N, C, samples)).
        steps: Adam steps (>= 1).
        batch_size: inputs per step.
        lr: peak learning rate.
        kl_weight: weight of the KL term.
        seed: seed of batch drawing and posterior sampling.
    """
    if steps < 1:
        raise ValueError(f"train_vae: steps must be >= 1, got {steps}")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # posterior sampling uses the global generator
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    if steps >= 3:
        # Phase ends at pct_start * steps - 1 and steps - 1: both phases non-empty needs 1 <= pct_start * steps < steps.
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=max(0.1, 2 / steps))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
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


def _trained(cls, prefix: str, args: dict[str, Any], build: Callable[[], Any], train: Callable[[Any], None],
             cache_dir: str | Path | None):  # fmt: skip
    """``build()`` trained in place by ``train(vae)``; with ``cache_dir``, saved under ``cache_dir/<prefix><hash of
    args>`` and loaded back with ``cls.from_pretrained`` on later calls, in this process from memory. A fresh copy."""
    key = prefix + hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / key if cache_dir is not None else None
    if folder is not None and str(folder) in _VAE_CACHE:
        return _copy(_VAE_CACHE[str(folder)])
    if folder is not None and (folder / "config.json").is_file():
        vae = cls.from_pretrained(folder)
    else:
        vae = build()
        train(vae)
        if folder is not None:
            _save_atomically(vae, folder)
    if folder is not None:
        _VAE_CACHE[str(folder)] = vae
    return _copy(vae.eval())


def _files(folder: str | Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Every file under ``folder`` (recursively, sorted) with one of ``suffixes``; ``FileNotFoundError`` if none."""
    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in suffixes)
    if not files:
        raise FileNotFoundError(f"{str(folder)!r} holds no {'/'.join(suffixes)} files")
    return files


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
        return seeded(seed, lambda: AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(block_out_channels), layers_per_block=1,
            latent_channels=latent_channels, norm_num_groups=8, sample_size=image_size, scaling_factor=scaling_factor,
            shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
        ))  # fmt: skip

    if train_dir is None:
        return build()
    files = _files(train_dir, (".png", ".jpg", ".jpeg"))

    def train(vae: AutoencoderKL) -> None:
        images = load_images(train_dir, image_size)
        train_vae(vae, images, steps=steps, batch_size=batch_size, lr=lr, kl_weight=kl_weight, seed=train_seed)
        shift, scale = latent_statistics(vae, images)
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)

    args = dict(seed=seed, train_seed=train_seed, image_size=image_size, latent_channels=latent_channels, lr=lr,
                steps=steps, block_out_channels=list(block_out_channels), batch_size=batch_size, kl_weight=kl_weight,
                files=[(p.name, p.stat().st_size) for p in files])  # fmt: skip
    return _trained(AutoencoderKL, "vae-", args, build, train, cache_dir)


def load_clips(folder: str | Path, num_frames: int, size: int) -> Tensor:
    """The first ``num_frames`` frames of every MP4 under ``folder`` (sorted), each fitted to ``size`` x ``size`` as the
    training loader fits targets (cover, centre crop), as float (N, 3, F, size, size) in [-1, 1] (a video VAE's
    input)."""
    from ff_core.contracts import MediaGeometry
    from ff_core.data.media.decode import decode_clip
    from ff_core.data.media.geometry import fit_media

    geometry = MediaGeometry(size, size, num_frames=num_frames)
    clips = [fit_media(decode_clip(p, num_frames=num_frames), geometry).frames for p in _files(folder, (".mp4",))]
    return torch.stack(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1


def load_waveforms(folder: str | Path, sample_rate: int, channels: int, samples: int) -> Tensor:
    """Every WAV under ``folder`` (sorted), converted once to ``channels`` channels at ``sample_rate`` and cut or
    right-padded to ``samples`` (:func:`ff_core.audio.to_model_rate`), as float (N, channels, samples) (an audio
    VAE's input)."""
    from ff_core.audio import to_model_rate
    from ff_core.data.media.decode import decode_audio

    out = []
    for path in _files(folder, (".wav",)):
        audio = decode_audio(path)
        out.append(to_model_rate(audio.waveform, audio.clock_rate, sample_rate, channels, samples))
    return torch.stack(out)


def build_tiny_video_vae(
    *,
    seed: int = 0,
    z_dim: int = 4,
    base_dim: int = 4,
    latents_mean: Sequence[float] | None = None,
    latents_std: Sequence[float] | None = None,
    train_dir: str | Path | None = None,
    num_frames: int = 5,
    size: int = 32,
    steps: int = 100,
    batch_size: int = 4,
    lr: float = 4e-3,
    kl_weight: float = 1e-6,
    train_seed: int | None = None,
    cache_dir: str | Path | None = None,
):
    """A tiny diffusers ``AutoencoderKLWan`` in Wan2.1's layout (4x temporal, 8x spatial compression as the real one:
    ``(F - 1) / 4 + 1`` latent frames of ``H / 8`` x ``W / 8``), trained briefly on ``train_dir``'s clips when given.

    Its latents are normalised per channel, ``(z - latents_mean) / latents_std`` (``WanPipeline``'s rule, from the
    VAE config's lists). Untrained, the lists are the arguments, or drawn from ``seed`` (means ~0.2 apart from 0,
    stds in [0.5, 1.5]) so that an adapter ignoring them fails the kit's encoding and decoding checks; trained, they
    are the per-channel mean and standard deviation of the training clips' posterior samples. ``cache_dir`` keeps
    trained VAEs as :func:`build_tiny_image_vae` does (a CPU training step of the default size takes ~1 s).

    Args:
        seed: seed of the initialisation, of the drawn statistics (and of training, unless ``train_seed`` is given).
        z_dim: latent channels (Wan2.1: 16).
        base_dim: the first level's channels (Wan2.1: 96); every level keeps it (``dim_mult`` all 1).
        latents_mean: the untrained VAE's per-channel means (``None``: drawn).
        latents_std: the untrained VAE's per-channel standard deviations (``None``: drawn).
        train_dir: folder of MP4 clips (searched recursively), e.g. a moving-shapes dataset's ``videos/``; ``None``:
            random weights.
        num_frames: frames of each training clip (its first ones), ``(num_frames - 1) % 4 == 0``.
        size: the side training frames are fitted to (a multiple of 8).
        steps: Adam steps of VAE training.
        batch_size: clips per training step.
        lr: peak Adam learning rate (one-cycle schedule).
        kl_weight: weight of the KL term (per latent element) against the pixel MSE.
        train_seed: seed of batch drawing and posterior sampling in training; ``None``: ``seed``.
        cache_dir: where trained VAEs are kept; ``None``: build every time.
    """
    from diffusers import AutoencoderKLWan

    train_seed = seed if train_seed is None else train_seed
    g = torch.Generator().manual_seed(seed)
    drawn_mean, drawn_std = torch.randn(z_dim, generator=g) * 0.2, 0.5 + torch.rand(z_dim, generator=g)
    mean = [round(float(v), 4) for v in (drawn_mean if latents_mean is None else latents_mean)]
    std = [round(float(v), 4) for v in (drawn_std if latents_std is None else latents_std)]
    if len(mean) != z_dim or len(std) != z_dim or min(std) <= 0:
        raise ValueError(f"latents_mean / latents_std need {z_dim} values (z_dim), the stds > 0; got {mean}, {std}")

    def build() -> AutoencoderKLWan:
        return seeded(seed, lambda: AutoencoderKLWan(
            base_dim=base_dim, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std,
        ))  # fmt: skip

    if train_dir is None:
        return build()
    files = _files(train_dir, (".mp4",))

    @torch.no_grad()
    def statistics(vae: AutoencoderKLWan, clips: Tensor) -> None:
        torch.manual_seed(0)
        z = torch.cat([vae.encode(clips[i : i + 8]).latent_dist.sample() for i in range(0, len(clips), 8)])
        z = z.transpose(0, 1).flatten(1)  # (z_dim, everything else)
        vae.register_to_config(latents_mean=[float(v) for v in z.mean(1)], latents_std=[float(v) for v in z.std(1)])

    def train(vae: AutoencoderKLWan) -> None:
        clips = load_clips(train_dir, num_frames, size)
        train_vae(vae, clips, steps=steps, batch_size=batch_size, lr=lr, kl_weight=kl_weight, seed=train_seed)
        statistics(vae, clips)

    args = dict(seed=seed, train_seed=train_seed, z_dim=z_dim, base_dim=base_dim, num_frames=num_frames, size=size,
                steps=steps, batch_size=batch_size, lr=lr, kl_weight=kl_weight,
                files=[(p.name, p.stat().st_size) for p in files])  # fmt: skip
    return _trained(AutoencoderKLWan, "video-vae-", args, build, train, cache_dir)


def build_tiny_audio_vae(
    *,
    seed: int = 0,
    sample_rate: int = 8000,
    audio_channels: int = 1,
    latent_channels: int = 4,
    downsampling_ratios: Sequence[int] = (2, 4, 8),
    train_dir: str | Path | None = None,
    seconds: float = 0.5,
    steps: int = 100,
    batch_size: int = 4,
    lr: float = 4e-3,
    kl_weight: float = 1e-6,
    train_seed: int | None = None,
    cache_dir: str | Path | None = None,
):
    """A tiny diffusers ``AutoencoderOobleck`` (Stable Audio's waveform VAE): ``audio_channels`` x ``samples`` at
    ``sample_rate`` in, ``latent_channels`` x ``samples / prod(downsampling_ratios)`` out (64x by default: 125 latent
    frames a second at 8 kHz), trained briefly on ``train_dir``'s WAV files when given.

    Its config holds no latent normalisation (``StableAudioPipeline`` decodes its latents as they are); a family that
    normalises them keeps its statistics itself. ``cache_dir`` keeps trained VAEs as :func:`build_tiny_image_vae`
    does.

    Args:
        seed: seed of the initialisation (and of training, unless ``train_seed`` is given).
        sample_rate: the waveform rate (``config.sampling_rate``).
        audio_channels: 1 (mono) or 2.
        latent_channels: latent channels (Stable Audio Open: 64); the encoder's width is twice it (mean and scale).
        downsampling_ratios: the encoder's strides, one level each (the hop is their product).
        train_dir: folder of WAV files (searched recursively), e.g. a tone dataset's ``audio/``; ``None``: random
            weights.
        seconds: how much of each training file (its start) is trained on, padded with silence when shorter.
        steps: Adam steps of VAE training.
        batch_size: waveforms per training step.
        lr: peak Adam learning rate (one-cycle schedule).
        kl_weight: weight of the KL term (per latent element) against the waveform MSE.
        train_seed: seed of batch drawing and posterior sampling in training; ``None``: ``seed``.
        cache_dir: where trained VAEs are kept; ``None``: build every time.
    """
    from diffusers import AutoencoderOobleck

    train_seed = seed if train_seed is None else train_seed
    ratios = [int(r) for r in downsampling_ratios]

    def build() -> AutoencoderOobleck:
        return seeded(seed, lambda: AutoencoderOobleck(
            encoder_hidden_size=2 * latent_channels, downsampling_ratios=ratios,
            channel_multiples=[1] + [2] * (len(ratios) - 1), decoder_channels=2 * latent_channels,
            decoder_input_channels=latent_channels, audio_channels=audio_channels, sampling_rate=sample_rate,
        ))  # fmt: skip

    if train_dir is None:
        return build()
    files = _files(train_dir, (".wav",))
    hop = int(np.prod(ratios))

    def train(vae: AutoencoderOobleck) -> None:
        samples = -(-round(seconds * sample_rate) // hop) * hop  # whole latent frames
        waves = load_waveforms(train_dir, sample_rate, audio_channels, samples)
        train_vae(vae, waves, steps=steps, batch_size=batch_size, lr=lr, kl_weight=kl_weight, seed=train_seed)

    args = dict(seed=seed, train_seed=train_seed, sample_rate=sample_rate, audio_channels=audio_channels,
                latent_channels=latent_channels, downsampling_ratios=ratios, seconds=seconds, steps=steps,
                batch_size=batch_size, lr=lr, kl_weight=kl_weight,
                files=[(p.name, p.stat().st_size) for p in files])  # fmt: skip
    return _trained(AutoencoderOobleck, "audio-vae-", args, build, train, cache_dir)


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
    """A fresh copy, so a caller that trains or moves its VAE leaves the cached one as built: the class rebuilt from
    its config with the weights loaded (``copy.deepcopy`` refuses a module with ``torch.nn.utils.weight_norm``, such as
    ``AutoencoderOobleck``, once it has run a forward)."""
    out = type(vae).from_config(vae.config)
    out.load_state_dict(vae.state_dict())
    return out.eval()


# -- tiny datasets -----------------------------------------------------------------------------------------------
OUTPUT_KINDS: tuple[str, ...] = ("image", "video", "audio", "video+audio")
"""The output kinds :func:`write_tiny_dataset` writes: a contract's output types joined by ``+`` (LTX-2's ordered
(video, audio) pair is ``video+audio``)."""

SUPERVISIONS: tuple[str, ...] = ("demonstration", "preference")
"""V2 supervision types: a ``target`` per record (SFT), or a ``chosen`` and a ``rejected`` one (offline DPO)."""

AV_WORDS: tuple[str, ...] = (*VIDEO_WORDS, "low", "middle", "high", "tone")
"""The audio+video datasets' vocabulary: the video words plus the tones' pitches (``a red square with a low tone``)."""

PITCHES: dict[str, float] = {"low": 220.0, "middle": 440.0, "high": 880.0}
"""The tones of the audio datasets, by the word their captions use."""


def write_tiny_dataset(
    root: str | Path,
    kind: str,
    n: int = 8,
    *,
    size: int = 32,
    seed: int = 0,
    supervision: str = "demonstration",
    frames: int = 9,
    fps: float = 8.0,
    sample_rate: int = 16000,
) -> Path:
    """A tiny V2 dataset folder (``train.jsonl`` + media + ``test.txt``) whose targets are of output ``kind``.

    ``image``: the shapes (:func:`ff_core.testing.shapes.write_shapes_dataset`, ``images/``); ``video``: moving
    shapes (:func:`ff_core.testing.moving_shapes.write_moving_shapes_dataset`, ``videos/``, MP4 with the record's
    ``fps``); ``audio``: 0.5 s mono WAV tones whose pitch the caption names (``audio/``, ``sample_rate`` in the
    record); ``video+audio``: ordered (video, audio) pairs, a coloured square on grey (MP4 under ``videos/``, ``fps``
    in the record) and a tone lasting exactly the clip (mono WAV under ``audios/``, ``sample_rate`` in the record),
    captioned ``a red square with a low tone`` (docs/datasets.md: V2 records of audio+video targets).

    With ``supervision="preference"`` every record is a preference pair (offline DPO) whose arms differ in one
    thing the caption names: images in the shape's colour (:func:`ff_core.testing.shapes.write_preference_dataset`),
    videos in the direction of motion (the rejected clip moves the other way), audio and audio+video in the tone's
    pitch (the rejected pair keeps the square and sounds another pitch).

    Args:
        root: the dataset folder (created).
        kind: one of :data:`OUTPUT_KINDS`.
        n: training records.
        size: image / frame side in pixels (even).
        seed: drawing seed.
        supervision: one of :data:`SUPERVISIONS`.
        frames: frames per clip (``video``, ``video+audio``).
        fps: the clips' frame rate, in the file and in each record.
        sample_rate: the WAV files' rate (``audio``, ``video+audio``).
    """
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind must be one of {OUTPUT_KINDS}, got {kind!r}")
    if supervision not in SUPERVISIONS:
        raise ValueError(f"supervision must be one of {SUPERVISIONS}, got {supervision!r}")
    preference = supervision == "preference"
    if kind == "image":
        from ff_core.testing.shapes import write_preference_dataset, write_shapes_dataset

        write = write_preference_dataset if preference else write_shapes_dataset
        return write(root, n_train=n, n_test=6, size=size, seed=seed)
    if kind == "video" and not preference:
        from ff_core.testing.moving_shapes import write_moving_shapes_dataset

        return write_moving_shapes_dataset(root, n_train=n, n_test=4, width=size, height=size, frames=frames, fps=fps,
                                           seed=seed)  # fmt: skip
    if kind == "video":
        return _write_moving_pairs(Path(root), n, size=size, frames=frames, fps=fps, seed=seed)
    if kind == "audio":
        return _write_tone_dataset(Path(root), n, rate=sample_rate, preference=preference)
    return _write_av_dataset(Path(root), n, size=size, frames=frames, fps=fps, rate=sample_rate, preference=preference)


def _write_records(root: Path, records: list[dict[str, Any]], prompts: list[str]) -> Path:
    """``train.jsonl`` (one V2 record per line) and ``test.txt`` (the distinct prompts, in order) under ``root``."""
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "test.txt").write_text("".join(p + "\n" for p in dict.fromkeys(prompts)))
    return root


def _record(prompt: str, target: list[dict[str, Any]], rejected: list[dict[str, Any]] | None = None,
            **metadata: Any) -> dict[str, Any]:  # fmt: skip
    """A V2 record of ``prompt``: a demonstration of ``target``, or with ``rejected`` a preference for ``target``;
    ``metadata`` (reward fields) when given."""
    if rejected is None:
        supervision = {"type": "demonstration", "target": {"media": target}}
    else:
        supervision = {"type": "preference", "chosen": {"media": target}, "rejected": {"media": rejected}}
    record = {"schema_version": 2, "input": {"prompt": prompt, "media": []}, "supervision": supervision}
    return {**record, "metadata": metadata} if metadata else record


def _write_moving_pairs(root: Path, n: int, *, size: int, frames: int, fps: float, seed: int) -> Path:
    """Moving-shapes preference pairs: the chosen clip moves as the caption says, the rejected one the other way (same
    colour, shape and height, mirrored start), ``videos/<i>_chosen.mp4`` / ``_rejected.mp4``."""
    import random

    from ff_core.testing.moving_shapes import DIRECTIONS, MotionSpec, draw_clip, write_mp4
    from ff_core.testing.shapes import COLOURS, SHAPES

    rng = random.Random(seed)
    records, prompts = [], []
    for i in range(n):
        colour, direction = COLOURS[i % len(COLOURS)], DIRECTIONS[(i // len(COLOURS)) % 2]
        spec = MotionSpec(colour, rng.choice(SHAPES), direction)
        other = MotionSpec(colour, spec.shape, DIRECTIONS[1 - DIRECTIONS.index(direction)])
        placement = rng.getstate()  # both clips drawn from one state: same size, height and (mirrored) start
        media = {}
        for arm, motion in (("chosen", spec), ("rejected", other)):
            rng.setstate(placement)
            rel = f"videos/{i:05d}_{arm}.mp4"
            write_mp4(root / rel, draw_clip(motion, frames, size, size, rng), fps)
            media[arm] = [{"type": "video", "path": rel, "fps": fps}]
        prompts.append(spec.prompt)
        records.append(_record(spec.prompt, media["chosen"], media["rejected"], colour=colour, direction=direction))
    return _write_records(root, records, prompts)


def _write_tone_dataset(root: Path, n: int, seconds: float = 0.5, rate: int = 16000, preference: bool = False) -> Path:
    from ff_core.callbacks.media_log import audio_to_wav

    records, prompts, t = [], [], np.arange(int(seconds * rate)) / rate
    pitches = list(PITCHES)

    def wav(rel: str, pitch: str) -> list[dict[str, Any]]:
        tone = torch.from_numpy(0.25 * np.sin(2 * np.pi * PITCHES[pitch] * t)).float()[None]  # (C=1, N)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(audio_to_wav(tone, rate))  # ff's one WAV writer (what media logging writes)
        return [{"type": "audio", "path": rel, "sample_rate": rate}]

    for i in range(n):
        pitch = pitches[i % len(pitches)]
        rejected = wav(f"audio/{i:05d}_rejected.wav", pitches[(i + 1) % len(pitches)]) if preference else None
        prompts.append(f"a {pitch} tone")
        records.append(_record(prompts[-1], wav(f"audio/{i:05d}.wav", pitch), rejected))
    return _write_records(root, records, [f"a {p} tone" for p in PITCHES])


def _write_av_dataset(root: Path, n: int, *, size: int, frames: int, fps: float, rate: int, preference: bool) -> Path:
    """Audio+video pairs (:func:`ff_core.testing.clips.av_clip`: a palette square on grey, a tone of ``frames / fps``
    seconds) written by :func:`ff_core.testing.clips.write_av_pair`; a preference's rejected pair sounds the next
    pitch."""
    from ff_core.testing.clips import av_clip, write_av_pair
    from ff_core.testing.shapes import COLOURS, PALETTE

    pitches = list(PITCHES)
    records, prompts = [], []
    for i in range(n):
        colour, pitch = COLOURS[i % len(COLOURS)], pitches[i % len(pitches)]

        def pair(stem: str, hz: float) -> list[dict[str, Any]]:
            clip, tone = av_clip(PALETTE[colour], hz, frames, fps, rate, size=size)
            return write_av_pair(root, stem, clip, tone, fps, rate)

        chosen = pair(f"{i:05d}", PITCHES[pitch])
        rejected = pair(f"{i:05d}_rejected", PITCHES[pitches[(i + 1) % len(pitches)]]) if preference else None
        prompts.append(f"a {colour} square with a {pitch} tone")
        records.append(_record(prompts[-1], chosen, rejected, colour=colour, pitch=pitch))
    return _write_records(root, records, prompts)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    what = "Write a tiny V2 dataset of one output kind (write_tiny_dataset)."
    p = argparse.ArgumentParser(prog="python -m ff_core.testing.tiny", description=what)
    p.add_argument("out", help="the dataset folder")
    p.add_argument("--kind", default="image", choices=OUTPUT_KINDS)
    p.add_argument("--n", type=int, default=8, help="training records")
    p.add_argument("--size", type=int, default=32, help="image / frame side in pixels")
    p.add_argument("--supervision", default="demonstration", choices=SUPERVISIONS)
    a = p.parse_args(argv)
    root = write_tiny_dataset(a.out, a.kind, a.n, size=a.size, supervision=a.supervision)
    print(f"wrote {a.n} {a.kind} {a.supervision} records to {root}")


if __name__ == "__main__":
    main()
