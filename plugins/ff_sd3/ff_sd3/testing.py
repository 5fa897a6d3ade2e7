"""A tiny, random-initialised SD3.5 checkpoint in the diffusers layout, built offline in seconds.

:func:`build_tiny_sd3` writes every component of ``StableDiffusion3Pipeline`` (``transformer/``, ``vae/``,
``scheduler/``, ``text_encoder{,_2,_3}/``, ``tokenizer{,_2,_3}/`` and ``model_index.json``) with
``save_pretrained``, so the folder loads both through :class:`ff_sd3.adapter.SD3Adapter` and through diffusers.
Tokenizers are built in code from a fixed word list (the shapes demo vocabulary plus a few fillers): every
listed word is one token, any other word falls back to characters (CLIP: byte-level, T5: ``<unk>`` for what
is not a letter or digit), so nothing crashes on unseen text.

A random VAE decoder does not invert its encoder. Given ``vae_train_dir`` (a folder of images, e.g. the shapes
dataset), the VAE is trained briefly for reconstruction and its ``shift_factor`` / ``scaling_factor`` are set
from the latent statistics so latents have zero mean and unit variance, as SD3's are (Esser et al. 2024, sec. 5.2).

CLI: ``python -m ff_sd3.testing --out DIR [--vae-train-dir IMAGES] [--image-size 32] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor

WORDS: tuple[str, ...] = (
    # shapes demo vocabulary (ff_core.testing.shapes): colours, shapes, backgrounds, glue words
    "red", "green", "blue", "yellow", "magenta", "cyan", "white", "black", "gray",
    "circle", "square", "triangle", "a", "on", "background",
    # fillers for hand-written prompts
    "an", "the", "of", "and", "with", "in", "grey", "orange", "purple", "photo", "image", "shape", "small", "big",
)  # fmt: skip
_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


def build_clip_tokenizer(max_length: int = 16, words: tuple[str, ...] = WORDS):
    """A CLIP BPE tokenizer whose merges spell each of ``words`` as one token (``word</w>``)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    alphabet = sorted(ByteLevel.alphabet())  # every byte has a symbol, so any text tokenizes
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


def build_t5_tokenizer(max_length: int = 16, words: tuple[str, ...] = WORDS):
    """A T5 unigram tokenizer: one piece per word of ``words``, letters and digits as fallback."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in words] + [("\u2581", -5.0)]
    pieces += [(c, -10.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def _seeded(seed: int, build):
    torch.manual_seed(seed)
    return build()


def build_tiny_sd3(
    path: str | Path,
    *,
    seed: int = 0,
    image_size: int = 32,
    text_max_length: int = 16,
    num_layers: int = 3,
    scheduler_shift: float = 1.0,
    vae_train_dir: str | Path | None = None,
    vae_steps: int = 300,
    vae_batch_size: int = 16,
    vae_lr: float = 4e-3,
    vae_kl_weight: float = 1e-5,
) -> Path:
    """Write a tiny random-initialised SD3.5-layout checkpoint to ``path`` and return it.

    Args:
        path: output folder (created; existing component folders are overwritten).
        seed: seed of every random initialisation (and of VAE training).
        image_size: default sample size in pixels (the VAE downsamples by 4, the transformer patch is 1).
        text_max_length: ``model_max_length`` of all three tokenizers (and CLIP's position table).
        num_layers: joint transformer blocks.
        scheduler_shift: ``FlowMatchEulerDiscreteScheduler`` shift (SD3 uses 3.0 at 1024 px; 1.0 suits 32 px).
        vae_train_dir: folder of images (searched recursively for PNG/JPEG) to train the VAE on; ``None`` keeps
            it random (fast path for unit tests; latents then keep ``shift 0, scale 1``).
        vae_steps: Adam steps of VAE training.
        vae_batch_size: images per VAE training step.
        vae_lr: peak Adam learning rate of VAE training (one-cycle schedule).
        vae_kl_weight: weight of the KL term (per latent element) against the pixel MSE.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    path = Path(path)
    tokenizer = build_clip_tokenizer(text_max_length)
    tokenizer_3 = build_t5_tokenizer(text_max_length)

    def clip(hidden: int, projection: int) -> CLIPTextModelWithProjection:
        cfg = CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=text_max_length, projection_dim=projection,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        return CLIPTextModelWithProjection(cfg)

    text_encoder = _seeded(seed + 1, lambda: clip(32, 32))  # CLIP-L stand-in
    text_encoder_2 = _seeded(seed + 2, lambda: clip(32, 32))  # CLIP-G stand-in
    t5_cfg = T5Config(
        vocab_size=len(tokenizer_3), d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    text_encoder_3 = _seeded(seed + 3, lambda: T5EncoderModel(t5_cfg))
    vae = _seeded(seed + 4, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=image_size, scaling_factor=1.0, shift_factor=0.0,
        use_quant_conv=False, use_post_quant_conv=False,  # as SD3's VAE
    ))  # fmt: skip
    latent_size = image_size // 4
    transformer = _seeded(seed + 5, lambda: SD3Transformer2DModel(
        sample_size=latent_size, patch_size=1, in_channels=4, out_channels=4, num_layers=num_layers,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=t5_cfg.d_model, caption_projection_dim=64,
        pooled_projection_dim=text_encoder.config.projection_dim + text_encoder_2.config.projection_dim,
        pos_embed_max_size=max(32, latent_size), qk_norm="rms_norm",  # SD3.5 normalises q and k
    ))  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=scheduler_shift)

    if vae_train_dir is not None:
        images = load_images(vae_train_dir, image_size)
        train_vae(
            vae, images, steps=vae_steps, batch_size=vae_batch_size, lr=vae_lr, kl_weight=vae_kl_weight, seed=seed
        )
        shift, scale = latent_statistics(vae, images)
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)

    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=build_clip_tokenizer(text_max_length),
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )  # fmt: skip
    pipe.save_pretrained(path)
    return path


def load_images(folder: str | Path, size: int) -> Tensor:
    """Every PNG/JPEG under ``folder`` (sorted), RGB, resized to ``size``, as float (N, 3, size, size) in [-1, 1]."""
    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not files:
        raise FileNotFoundError(f"vae_train_dir={str(folder)!r} holds no .png/.jpg images")
    out = []
    for f in files:
        img = Image.open(f).convert("RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.BICUBIC)
        t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1)
        out.append(t.float() / 127.5 - 1)
    return torch.stack(out)


def train_vae(vae, images: Tensor, *, steps: int, batch_size: int, lr: float, kl_weight: float, seed: int) -> float:
    """Train ``vae`` in place: pixel MSE of the decoded posterior sample + ``kl_weight`` * KL; returns last loss."""
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ff_sd3.testing", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--vae-train-dir", default=None, help="folder of images to train the VAE on")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-steps", type=int, default=300)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = build_tiny_sd3(
        a.out, seed=a.seed, image_size=a.image_size, vae_train_dir=a.vae_train_dir, vae_steps=a.vae_steps
    )
    vae_cfg = json.loads((out / "vae" / "config.json").read_text())
    print(
        f"wrote tiny SD3.5 checkpoint to {out} in {time.perf_counter() - t0:.1f}s "
        f"(vae shift_factor={vae_cfg['shift_factor']:.4f}, scaling_factor={vae_cfg['scaling_factor']:.4f})"
    )


if __name__ == "__main__":
    main()
