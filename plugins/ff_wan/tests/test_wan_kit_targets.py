"""The conformance kit feeds ``encode_output`` what ``ff fit`` feeds it (issue 31): ``DecodedVideo`` clips decoded from
a real MP4 by the training loader's code, frames ``uint8`` (F, H, W, 3). A Wan adapter written against the kit's old
targets, ``uint8`` (F, 3, H, W) tensors, is right on that form and crashes at the first training step; the kit now
fails it, naming the form it was given (also when the plugin's kit still overrides ``make_targets`` with such tensors),
and still passes the real adapter."""

from __future__ import annotations

import re

import pytest
import test_wan_conformance as wan  # a module: pytest does not collect its classes a second time
import torch
from ff_wan import WanT2VAdapter
from wan_geometry import FPS, FRAMES, SIZE

from ff_core.adapter import LatentState
from ff_core.data.media.decode import DecodedVideo
from ff_core.testing.conformance import media_tensor
from ff_core.testing.conformance_checks import prepare


class TensorOnlyWan(WanT2VAdapter):
    """Written against the kit's old targets: stacks ``uint8`` (F, 3, H, W) tensors as they are. Right on that form
    (WanT2VAdapter's latents), a ``TypeError`` on the ``DecodedVideo`` clips the training loader delivers."""

    @torch.no_grad()
    def encode_output(self, media, condition, generator=None):
        x = torch.stack([outputs[0] for outputs in media]).float() / 127.5 - 1  # (B, F, 3, H, W) in [-1, 1]
        z = self.vae.encode(x.permute(0, 2, 1, 3, 4)).latent_dist.sample(generator=generator)
        return LatentState({"latent": self.normalize(z.float())})


class _OldFormKit(wan.TestWanT2VConformance):
    """A plugin kit written for the old kit (whose base raised for video): ``make_targets`` overridden with random
    ``uint8`` (F, 3, H, W) tensors of its own making. Its other checks take them; the training-targets check does
    not."""

    def make_targets(self, adapter, n):
        g = torch.Generator().manual_seed(0)
        return [[torch.randint(0, 256, (FRAMES, 3, SIZE, SIZE), generator=g, dtype=torch.uint8)] for _ in range(n)]


@pytest.fixture(scope="module")
def kit():
    return wan.TestWanT2VConformance()


@pytest.fixture(scope="module")
def pretrained(tiny_wan):
    return tiny_wan("t2v")


@pytest.fixture(scope="module")
def pipe(kit, pretrained):
    return kit.load_reference_pipeline(pretrained)


def test_the_kit_hands_encode_output_decoded_clips_on_the_adapters_grid(kit, pretrained):
    adapter = WanT2VAdapter.from_pretrained(pretrained, **kit.adapter_kwargs)
    targets = kit.make_targets(adapter, 2)
    assert [len(t) for t in targets] == [1, 1]
    for (video,) in targets:
        assert isinstance(video, DecodedVideo) and video.audio is None
        assert video.frames.dtype == torch.uint8 and tuple(video.frames.shape) == (FRAMES, SIZE, SIZE, 3)
        assert video.fps == FPS
        torch.testing.assert_close(video.timestamps, torch.arange(FRAMES, dtype=torch.float64) / FPS)
    assert not torch.equal(targets[0][0].frames, targets[1][0].frames)
    assert torch.equal(kit.make_targets(adapter, 2)[1][0].frames, targets[1][0].frames)  # seeded: every check alike


def test_an_adapter_written_for_the_old_tensor_form_fails_the_kit_naming_the_form(kit, pretrained, tmp_path):
    real = WanT2VAdapter.from_pretrained(pretrained, **kit.adapter_kwargs)
    broken = TensorOnlyWan.from_pretrained(pretrained, **kit.adapter_kwargs)
    # Only the form is wrong: on the old tensors it encodes what the real adapter encodes from the clips.
    inputs = kit.make_inputs(real, tmp_path)
    targets = kit.make_targets(real, len(inputs))
    condition = prepare(real, inputs)
    old = broken.encode_output([[media_tensor(t[0])] for t in targets], condition, torch.Generator().manual_seed(0))
    ours = real.encode_output(targets, condition, torch.Generator().manual_seed(0))
    torch.testing.assert_close(old.components["latent"], ours.components["latent"], atol=1e-6, rtol=1e-5)
    # A kit still overriding make_targets with the old tensors passes every other check, and fails this one too.
    assert set(_OldFormKit().run_checks(broken, pretrained, tmp_path / "old")) == {"training_targets"}

    failed = kit.run_checks(broken, pretrained, tmp_path / "new")
    assert set(failed) == {"training_targets"}, failed
    form = re.escape(f"each [DecodedVideo with frames uint8 (F, H, W, 3) = ({FRAMES}, {SIZE}, {SIZE}, 3) at 8 fps]")
    message = failed["training_targets"]
    assert re.search(
        rf"^TensorOnlyWan\.encode_output fails on the targets `ff fit`'s loader delivers \({len(inputs)} "
        rf"sample\(s\), {form}; decoded from real files .*: TypeError: ",
        message,
    ), message
    with pytest.raises(AssertionError, match=r"DecodedVideo with frames uint8 \(F, H, W, 3\)"):
        kit.test_encode_output_takes_the_targets_training_delivers(broken, inputs)
    assert kit.run_checks(real, pretrained, tmp_path / "real") == {}


def test_the_encoding_check_against_the_pipeline_fails_it_the_same_way(kit, pretrained, pipe, tmp_path):
    inputs = kit.make_inputs(WanT2VAdapter.from_pretrained(pretrained, **kit.adapter_kwargs), tmp_path)
    real = WanT2VAdapter.from_pretrained(pretrained, **kit.adapter_kwargs)
    kit.check_encoding(real, pipe, kit.run_reference(real, pipe, inputs, guidance_scale=1.0))
    broken = TensorOnlyWan.from_pretrained(pretrained, **kit.adapter_kwargs)
    case = kit.run_reference(broken, pipe, inputs, guidance_scale=1.0)
    with pytest.raises(AssertionError, match=r"fails on the targets .*\[DecodedVideo with frames uint8 \(F, H, W, 3\)"):
        kit.check_encoding(broken, pipe, case)
