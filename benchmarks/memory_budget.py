"""Per-GPU memory budget of the full-size recipes under each strategy, from parameter counts (docs/scaling.md).

Every component is built on the meta device from the released checkpoints' configs (the values below are their
``config.json`` entries), so its parameters are counted exactly without downloading a weight. The budget counts
weights, gradients and AdamW state (model states) only; activations depend on resolution, frames and batch and are
listed apart (``gradient_checkpointing`` cuts them to about one block's worth). Bytes per trained parameter:

* full fine-tuning, bf16 mixed precision: fp32 weight 4 + fp32 gradient 4 + AdamW moments 8 = 16 bytes, held whole on
  every rank under DDP, 16 / N under FSDP2 / FSDP1 (and ZeRO-3), 4 + (4 + 8) / N under ZeRO-2 (gradients and
  optimiser state partitioned, weights not); FSDP2 with ``param_dtype: bfloat16`` also gathers one block in bf16 at a
  time (transient, not counted);
* LoRA: the frozen base weights at 2 bytes (bf16 checkpoint dtype), whole under DDP/ZeRO-2, / N under FSDP; the LoRA
  itself (< 1 % of the base at rank 64) is negligible;
* frozen components: the text encoders are released once the conditions are cached (``data.enable_preprocess``), so
  only the VAE stays, in bf16, replicated.

Activations under context parallelism (``ff_core.strategies.ContextParallelStrategy``, docs/scaling.md "Sequence
parallel"), per rank, in bf16, for one sample of ``S`` tokens split over ``cp`` ranks (Ulysses: each rank holds
``S / cp`` tokens of every layer's activations, and inside attention the whole sequence for ``1 / cp`` of the heads:
the same size). With ``gradient_checkpointing`` the backward keeps each block's input (``L * S / cp * d``) and
recomputes one block at a time, whose working set is taken as ``S / cp * (14 d + 2 f)`` (norms, q, k, v, attention
output, projections, residuals: ~14 ``d``-wide tensors; the MLP's two ``f``-wide ones); without it every block's
working set stays. An estimate to size a run with, not a measurement.

Usage: ``python benchmarks/memory_budget.py [--gpus 8]`` prints two Markdown tables (GiB per GPU).
"""

from __future__ import annotations

import argparse

import torch

GIB = 2**30

SD3_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": (128, 256, 512, 512),
           "down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
           "layers_per_block": 2, "use_quant_conv": False, "use_post_quant_conv": False}  # fmt: skip
SD35_MEDIUM = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
               "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
               "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
               "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm"}  # fmt: skip
SD35_LARGE = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38, "attention_head_dim": 64,
              "num_attention_heads": 38, "joint_attention_dim": 4096, "caption_projection_dim": 2432,
              "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192,
              "qk_norm": "rms_norm"}  # fmt: skip
WAN_1_3B = {"patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6}  # fmt: skip
WAN_14B = {**WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# MiniMax H3: diffusers' defaults of MiniMaxH3Transformer3DModel / AutoencoderKLMiniMaxH3(Audio) are the released
# configs; the conditioner is a Qwen3-VL whose text stack is 5120 wide (the transformer's text_dim), read at layer 50
# of 64: Qwen3-VL-32B's text config (its vision tower: 27 blocks of 1152, Qwen3-VL's default).
QWEN3_VL_32B_TEXT = {"vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip


def count(build) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def components() -> dict[str, dict[str, int]]:
    """Parameter counts per recipe: the trained transformer, the VAE, the text encoders (released after caching)."""
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        AutoencoderKLWan,
        MiniMaxH3Transformer3DModel,
        SD3Transformer2DModel,
        WanTransformer3DModel,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        T5Config,
        T5EncoderModel,
    )

    def clip(hidden: int, layers: int, heads: int, projection: int) -> int:
        return count(lambda: CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=49408, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=77, projection_dim=projection)))  # fmt: skip

    def t5(vocab: int) -> int:
        return count(lambda: T5EncoderModel(T5Config(vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240,
                                                     num_layers=24, num_heads=64, feed_forward_proj="gated-gelu")))

    sd3_text = clip(768, 12, 12, 768) + clip(1280, 32, 20, 1280) + t5(32128)  # CLIP-L, CLIP-G, T5-XXL encoder
    sd3_vae = count(lambda: AutoencoderKL(**SD3_VAE))
    wan_text, wan_vae = t5(256384), count(lambda: AutoencoderKLWan())  # umT5-XXL encoder; Wan2.1 VAE
    return {
        "SD3.5-medium": {"trained": count(lambda: SD3Transformer2DModel(**SD35_MEDIUM)), "vae": sd3_vae,
                         "text": sd3_text},
        "SD3.5-large": {"trained": count(lambda: SD3Transformer2DModel(**SD35_LARGE)), "vae": sd3_vae,
                        "text": sd3_text},
        "Wan2.1 T2V 1.3B": {"trained": count(lambda: WanTransformer3DModel(**WAN_1_3B)), "vae": wan_vae,
                            "text": wan_text},
        "Wan2.1 T2V 14B": {"trained": count(lambda: WanTransformer3DModel(**WAN_14B)), "vae": wan_vae,
                           "text": wan_text},
        # The video and audio VAEs together (both stay: targets are encoded on the fly, samples decoded).
        "MiniMax H3 (T2VA)": {"trained": count(MiniMaxH3Transformer3DModel),
                              "vae": count(AutoencoderKLMiniMaxH3) + count(AutoencoderKLMiniMaxH3Audio),
                              "text": count(lambda: Qwen3VLForConditionalGeneration(Qwen3VLConfig(
                                  text_config=QWEN3_VL_32B_TEXT, vision_config={"out_hidden_size": 5120})))},
    }  # fmt: skip


def budget(n: dict[str, int], gpus: int) -> dict[str, float]:
    """GiB per GPU of model states (see the module docstring for the bytes per parameter)."""
    p, vae = n["trained"], 2 * n["vae"]
    return {
        "full DDP": (16 * p + vae) / GIB,
        "full ZeRO-2": ((4 + 12 / gpus) * p + vae) / GIB,
        "full FSDP2": (16 * p / gpus + vae) / GIB,
        "LoRA DDP": (2 * p + vae) / GIB,
        "LoRA FSDP2": (2 * p / gpus + vae) / GIB,
    }


# Long clips (tokens of one sample, the ff adapters' denoiser_tokens for these geometries) and the transformer shape.
LONG_CLIPS = {
    # 81 frames at 720x1280: (1 + 80 / 4) x (720 / 16) x (1280 / 16) = 21 x 45 x 80
    "Wan2.1 T2V 14B, 720p 81 frames": {"tokens": 21 * 45 * 80, "d": 5120, "f": 13824, "layers": 40},
    # 121 frames at 704x1280 (VAE 8x temporal, 32x spatial, patch 1): 16 x 22 x 40 video + 126 audio (5 s at 25/s)
    "LTX-2, 704p 121 frames + audio": {"tokens": 16 * 22 * 40 + 126, "d": 4096, "f": 16384, "layers": 48},
    # 10 s at 24 fps: 243 frames (17 n + 5), 5 n + 2 = 72 latent frames of 22 x 40 (16x VAE, patch 2) + 2 x 405 audio
    "MiniMax H3, 704p 10 s": {"tokens": 72 * 22 * 40 + 2 * 405, "d": 5376, "f": 14336, "layers": 50},
}


def activations(clip: dict[str, int], cp: int, checkpointing: bool = True) -> float:
    """GiB per rank of one sample's activations in bf16 (module docstring)."""
    s, d, f, layers = clip["tokens"] / cp, clip["d"], clip["f"], clip["layers"]
    block = s * (14 * d + 2 * f)
    kept = layers * s * d + block if checkpointing else layers * block
    return 2 * kept / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel ranks")
    gpus = parser.parse_args().gpus
    counts = components()
    columns = list(budget(next(iter(counts.values())), gpus))
    print(f"| model | trained params | VAE | text encoders (released) | {' | '.join(columns)} |")
    print("|---|---|---|---|" + "---|" * len(columns))
    for model, n in counts.items():
        row = budget(n, gpus)
        print(f"| {model} | {n['trained'] / 1e9:.2f} B | {n['vae'] / 1e6:.0f} M | {n['text'] / 1e9:.2f} B | "
              + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")  # fmt: skip
    print(f"\nGiB per GPU of weights, gradients and AdamW state with {gpus} GPUs (activations not included).\n")
    sizes = (1, 2, 4, 8)
    print("| clip (one sample) | tokens | " + " | ".join(f"cp={n}" for n in sizes) + " | cp=1, no checkpointing |")
    print("|---|---|" + "---|" * (len(sizes) + 1))
    for name, clip in LONG_CLIPS.items():
        print(f"| {name} | {clip['tokens']:,} | " + " | ".join(f"{activations(clip, n):.1f}" for n in sizes)
              + f" | {activations(clip, 1, checkpointing=False):.0f} |")  # fmt: skip
    print("\nGiB per rank of activations in bf16 with gradient checkpointing, by context-parallel size.")


if __name__ == "__main__":
    main()
