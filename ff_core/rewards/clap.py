"""CLAP score: how well each generated sound matches its prompt, by a CLAP model loaded from a local folder.

Reference: transformers' ``ClapModel`` (Wu et al. 2023, LAION-CLAP, "Large-scale contrastive language-audio
pretraining"): ``get_text_features`` and ``get_audio_features`` are the projected, L2-normalised embeddings
(LAION-CLAP's ``get_text_embedding`` / ``get_audio_embedding``), and ``ClapModel.forward``'s ``logits_per_audio`` (the
docs' "audio-text similarity score") is their dot product times ``exp(logit_scale_a)``. ff scores each sample with
its own prompt: the cosine similarity, optionally times that scale.

The waveform is mixed to mono and resampled to the feature extractor's ``sampling_rate`` (48 kHz for LAION's
checkpoints) by :func:`resample`, band-limited sinc interpolation transcribed from torchaudio (no torchaudio or scipy
here); audio longer than the extractor's ``max_length_s`` (10 s) keeps its first ``max_length_s`` seconds, where the
extractor would crop (or fuse) at random, so a sample's score does not change from one call to the next.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ff_core.rewards.base import RewardBatch
from ff_core.rewards.media import score_in_batches
from ff_core.rewards.models import ModelReward, from_pretrained, projected


def resample(waveform: Tensor, orig_freq: int, new_freq: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> Tensor:  # fmt: skip
    """``waveform`` (..., N) at ``orig_freq`` Hz resampled to ``new_freq`` Hz: ``ceil(N new / orig)`` samples.

    torchaudio's ``functional.resample`` with its defaults (``sinc_interp_hann``; pytorch/audio
    ``src/torchaudio/functional/functional.py``, ``_get_sinc_resample_kernel`` / ``_apply_sinc_resample_kernel``):
    ``y[j] = sum_i x[i] w(t) sinc(pi b t)``, ``t = i / orig - j / new``, with ``b = rolloff x min(orig, new)`` (the
    anti-alias low-pass), the sinc cut after ``lowpass_filter_width`` zero crossings under a Hann window; after
    dividing both rates by their gcd, output phase ``j mod new`` has its own FIR filter, applied as one strided conv1d.
    """
    if orig_freq <= 0 or new_freq <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_freq} -> {new_freq}")
    if orig_freq == new_freq:
        return waveform
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    base = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base)
    dtype = waveform.dtype if waveform.is_floating_point() else torch.float32
    idx = torch.arange(-width, width + orig, dtype=torch.float64, device=waveform.device)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=torch.float64, device=waveform.device)[:, None, None] / new + idx
    t = (t * base).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), t.sin() / t) * window * (base / orig)
    shape = waveform.shape
    x = waveform.to(dtype).reshape(-1, shape[-1])
    y = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (width, width + orig))[:, None], kernel.to(dtype),
                                   stride=orig)  # fmt: skip
    y = y.transpose(1, 2).reshape(len(x), -1)[:, : math.ceil(new * shape[-1] / orig)]
    return y.reshape(*shape[:-1], y.shape[-1])


class ClapScoreReward(ModelReward):
    """Cosine similarity of CLAP's audio embedding of each sample and text embedding of its prompt, times ``scale``
    (and ``exp(logit_scale_a)`` with ``logit_scale: true``, ``ClapModel``'s ``logits_per_audio``).

    The folder holds a ``ClapModel`` and its ``ClapProcessor`` (feature extractor + tokenizer) as ``save_pretrained``
    writes them (e.g. a local copy of ``laion/larger_clap_general``). The first audio output of each sample is scored,
    so audio+video adapters (LTX-2, MiniMax) work as audio-only ones; its sample rate comes from the batch
    (the adapter contract) or ``sample_rate``.

    Args:
        pretrained_model_name_or_path: local folder of the CLAP model and processor.
        scale: multiplies the score.
        logit_scale: also multiply by the model's ``exp(logit_scale_a)`` (about 100 when trained; 1/0.07 at init).
        sample_rate: the waveforms' rate when the batch does not say (Hz).
        batch_size: samples per forward pass.
        dtype: weights' dtype (``float32``, ``bfloat16``, ``float16``).
    """

    name = "clap"
    media_types = ("audio",)

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        scale: float = 1.0,
        logit_scale: bool = False,
        sample_rate: int | None = None,
        batch_size: int = 16,
        dtype: str = "float32",
    ) -> None:
        from transformers import ClapModel, ClapProcessor

        super().__init__(dtype, batch_size=batch_size)
        self.model = from_pretrained(ClapModel, pretrained_model_name_or_path, dtype=self.dtype)
        self.processor = from_pretrained(ClapProcessor, pretrained_model_name_or_path)
        self.freeze()
        self.scale = scale
        self.logit_scale = logit_scale
        self.sample_rate = sample_rate
        self.batch_size = batch_size

    def waveform(self, audio: Tensor, rate: float) -> Tensor:
        """A float (C, N) waveform at ``rate`` Hz as the feature extractor takes it: mono (the channels' mean) at its
        ``sampling_rate``, at most ``max_length_s`` seconds (the first ones)."""
        extractor = self.processor.feature_extractor
        mono = audio.detach().to("cpu", torch.float32).reshape(-1, audio.shape[-1]).mean(0)
        mono = resample(mono, round(rate), extractor.sampling_rate)
        return mono[: extractor.nb_max_samples]

    def __call__(self, batch: RewardBatch) -> Tensor:
        outputs = batch.outputs(self.media_types, self.name)
        rate = batch.rates[batch.output_index(self.media_types, self.name)] or self.sample_rate
        if rate is None:
            raise ValueError("reward 'clap': the batch does not give the audio's sample rate; set args.sample_rate")
        audio = [self.waveform(x, rate) for x in outputs]
        return score_in_batches(self._score, audio, batch.prompts, self.batch_size) * self.scale

    @torch.no_grad()
    def _score(self, audio: list[Tensor], prompts: list[str]) -> Tensor:
        extractor, tokenizer = self.processor.feature_extractor, self.processor.tokenizer
        text = tokenizer(list(prompts), padding=True, truncation=True, return_tensors="pt").to(self.device)
        features = extractor([a.numpy() for a in audio], sampling_rate=extractor.sampling_rate, return_tensors="pt")
        text_embeds = projected(self.model.get_text_features(input_ids=text["input_ids"],
                                                           attention_mask=text.get("attention_mask")))
        is_longer = features["is_longer"].to(self.device) if "is_longer" in features else None
        audio_embeds = projected(self.model.get_audio_features(
            input_features=features["input_features"].to(self.device, self.dtype), is_longer=is_longer))
        # Both are already L2-normalised by ClapModel; normalising again is a no-op that keeps older versions right.
        score = (torch.nn.functional.normalize(audio_embeds.float(), dim=-1)
                 * torch.nn.functional.normalize(text_embeds.float(), dim=-1)).sum(-1)
        return score * self.model.logit_scale_a.exp().float() if self.logit_scale else score
