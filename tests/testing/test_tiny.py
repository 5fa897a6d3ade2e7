"""The shared tiny builders (ff_core.testing.tiny): offline tokenizers, the cached trained tiny VAE, tiny datasets."""

import pytest
import torch

from ff_core.testing.tiny import (
    OUTPUT_KINDS,
    VIDEO_WORDS,
    WORDS,
    build_clip_tokenizer,
    build_gemma_tokenizer,
    build_t5_tokenizer,
    build_tiny_image_vae,
    write_tiny_dataset,
)

BUILDERS = {"clip": build_clip_tokenizer, "t5": build_t5_tokenizer, "gemma": build_gemma_tokenizer}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_tokenizers_spell_each_word_as_one_token_and_round_trip(kind, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = BUILDERS[kind](16, VIDEO_WORDS)
    special = set(tokenizer.all_special_ids)
    for word in VIDEO_WORDS:
        ids = [i for i in tokenizer(word).input_ids if i not in special]
        assert len(ids) == 1, (kind, word, tokenizer.convert_ids_to_tokens(ids))
    prompt = "a red square moving left, 42 zebras!"  # unseen words and punctuation fall back, never crash
    ids = tokenizer(prompt, padding="max_length", truncation=True).input_ids
    assert len(ids) == 16
    tokenizer.save_pretrained(tmp_path)  # what a tiny checkpoint's tokenizer/ folder holds
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(prompt, padding="max_length", truncation=True).input_ids == ids


def test_special_tokens_are_the_released_ones():
    t5, gemma = build_t5_tokenizer(), build_gemma_tokenizer()
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)  # T5 / UMT5
    assert (gemma.pad_token_id, gemma.eos_token_id, gemma.bos_token_id, gemma.unk_token_id) == (0, 1, 2, 3)
    assert gemma("a red").input_ids[0] == gemma.bos_token_id
    assert build_clip_tokenizer()("red").input_ids[0] == build_clip_tokenizer().bos_token_id
    assert "red" in WORDS


def test_trained_vae_is_built_once_per_cache_folder(tmp_path):
    images = write_tiny_dataset(tmp_path / "shapes", "image", n=8) / "images"
    kwargs = dict(seed=3, train_dir=images, steps=4, batch_size=4, block_out_channels=(8, 8), cache_dir=tmp_path / "c")
    a = build_tiny_image_vae(**kwargs)
    assert a.config.shift_factor != 0 and a.config.scaling_factor != 1  # set from the latent statistics
    (folder,) = (tmp_path / "c").iterdir()
    from diffusers import AutoencoderKL

    from ff_core.testing import tiny

    with pytest.MonkeyPatch.context() as mp:  # from this process' memory: neither trained nor read again
        mp.setattr(tiny, "train_vae", lambda *a, **k: pytest.fail("the cached VAE was trained again"))
        mp.setattr(AutoencoderKL, "from_pretrained", lambda *a, **k: pytest.fail("the cached VAE was read again"))
        b = build_tiny_image_vae(**kwargs)
    assert b is not a and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    tiny._VAE_CACHE.clear()  # a new session: loaded back from the folder, not retrained
    c = build_tiny_image_vae(**kwargs)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert len(list((tmp_path / "c").iterdir())) == 1 and (folder / "config.json").is_file()
    d = build_tiny_image_vae(**{**kwargs, "steps": 5})  # another training: another key
    assert len(list((tmp_path / "c").iterdir())) == 2 and not torch.equal(next(a.parameters()), next(d.parameters()))


def test_an_interrupted_vae_cache_save_leaves_no_folder(tmp_path, monkeypatch):
    """The cache folder appears whole or not at all: a save that dies after ``config.json`` leaves nothing a later
    session would load half-written; the next build trains and publishes it."""
    from diffusers import AutoencoderKL

    from ff_core.testing import tiny

    images = write_tiny_dataset(tmp_path / "shapes", "image", n=4) / "images"
    kwargs = dict(seed=5, train_dir=images, steps=1, batch_size=2, block_out_channels=(8, 8), cache_dir=tmp_path / "c")
    save = AutoencoderKL.save_pretrained

    def dies_after_the_config(self, folder, **kw):
        self.save_config(folder)
        raise KeyboardInterrupt

    monkeypatch.setattr(AutoencoderKL, "save_pretrained", dies_after_the_config)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_image_vae(**kwargs)
    assert list((tmp_path / "c").iterdir()) == []
    monkeypatch.setattr(AutoencoderKL, "save_pretrained", save)
    tiny._VAE_CACHE.clear()
    build_tiny_image_vae(**kwargs)
    (folder,) = (tmp_path / "c").iterdir()
    assert (folder / "config.json").is_file() and (folder / "diffusion_pytorch_model.safetensors").is_file()


def test_tone_wavs_are_rounded_16_bit_pcm_as_media_logging_writes(tmp_path):
    """One WAV writer (``audio_to_wav``): samples ``round(x * 32767)``, not truncated."""
    import wave

    import numpy as np

    root = write_tiny_dataset(tmp_path / "tones", "audio", n=1)
    with wave.open(str(root / "audio" / "00000.wav")) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    t = np.arange(8000) / 16000
    tone = torch.from_numpy(0.25 * np.sin(2 * np.pi * 220.0 * t)).float()  # "a low tone": the first record
    assert np.array_equal(pcm, (tone * 32767).round().to(torch.int16).numpy())


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
def test_tiny_datasets_are_valid_v2_datasets_of_each_output_kind(kind, tmp_path):
    from ff_core.data.media.decode import decode_media
    from ff_core.data.records.sources import DatasetConfig, load_split

    root = write_tiny_dataset(tmp_path / kind, kind, n=3)
    records = list(load_split(DatasetConfig(name=kind, dataset_dir=str(root), eval={}), "train", None))
    assert len(records) == 3
    for record in records:
        (targets,) = record.candidates  # video+audio: the ordered (video, audio) pair
        assert "+".join(t.type.value for t in targets) == kind
        for target in targets:
            assert target.path.is_file() and decode_media(target, referenced_by=record.where) is not None
