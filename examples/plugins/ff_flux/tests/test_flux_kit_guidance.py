"""The kit's guidance mapping (issue 31, item 7): ff's CFG scale and a guidance-embedded adapter's distilled scale go to
the pipeline arguments a plugin declares (``reference_cfg_argument``, ``reference_embedded_guidance_argument``;
FluxPipeline: ``true_cfg_scale`` and ``guidance_scale``, as HunyuanVideoPipeline's). A kit left at the default, which
would put ff's CFG on FLUX.1's embedded-guidance ``guidance_scale``, and one that names one argument for both, are
refused before the pipeline runs, saying which scale went where; a denoiser failure says it too."""

from __future__ import annotations

import pytest
from ff_flux import FluxAdapter
from test_flux_conformance import FluxKit


class DefaultMappingKit(FluxKit):
    """The kit's defaults, as a HunyuanVideo or FLUX.1 author starting from the template has them."""

    reference_cfg_argument = "guidance_scale"
    reference_embedded_guidance_argument = None


class OneArgumentForBothKit(FluxKit):
    reference_cfg_argument = "guidance_scale"


class MisspeltKit(FluxKit):
    reference_cfg_argument = "true_cfg"


@pytest.fixture(scope="module")
def dev(tiny_flux_dev):
    return FluxAdapter.from_pretrained(tiny_flux_dev, **FluxKit.adapter_kwargs)


@pytest.fixture(scope="module")
def pipe(tiny_flux_dev):
    return FluxKit().load_reference_pipeline(tiny_flux_dev)


@pytest.fixture(scope="module")
def inputs(dev, tmp_path_factory):
    return FluxKit().make_inputs(dev, tmp_path_factory.mktemp("inputs"))


def test_the_declared_mapping_passes_each_scale_to_its_argument(dev, pipe):
    assert dev.embedded_guidance == 3.5
    cfg, embedded = FluxKit().reference_guidance_arguments(dev, pipe, 4.0)
    assert (cfg, embedded) == ({"true_cfg_scale": 4.0}, {"guidance_scale": 3.5})  # the adapter's default, explicitly
    assert FluxKit().reference_guidance_arguments(dev, pipe, 1.0, embedded_guidance=2.5)[1] == {"guidance_scale": 2.5}


def test_the_default_mapping_on_a_guidance_embedded_adapter_is_refused_saying_where_the_cfg_went(dev, pipe, inputs):
    with pytest.raises(AssertionError) as failure:
        DefaultMappingKit().run_reference(dev, pipe, inputs, guidance_scale=1.0)
    message = str(failure.value)
    assert message.startswith(
        "FluxAdapter has a guidance-embedded denoiser (embedded_guidance 3.5), but the kit names no FluxPipeline "
        "argument for the embedded guidance (reference_embedded_guidance_argument is None), while ff's CFG scale 1 "
        "goes to guidance_scale=1 (reference_cfg_argument)."
    ), message
    assert "reference_cfg_argument = 'true_cfg_scale' and reference_embedded_guidance_argument = 'guidance_scale'" in (
        message
    )


def test_one_argument_for_both_scales_is_ambiguous(dev, pipe, inputs):
    expected = (
        r"^ambiguous guidance mapping: ff's CFG scale 4 \(reference_cfg_argument\) and FluxAdapter's embedded guidance "
        r"3\.5 \(reference_embedded_guidance_argument\) both go to FluxPipeline's guidance_scale: one argument cannot "
        r"carry both\."
    )
    with pytest.raises(AssertionError, match=expected):
        OneArgumentForBothKit().run_reference(dev, pipe, inputs, guidance_scale=4.0)


def test_an_argument_the_pipeline_does_not_take_is_named(dev, pipe, inputs):
    expected = (
        r"^FluxPipeline\.__call__ takes no true_cfg: ff's CFG scale 1 was to go to true_cfg=1, the embedded guidance "
        r"to guidance_scale=3\.5\. Its guidance arguments: true_cfg_scale, guidance_scale "
    )
    with pytest.raises(AssertionError, match=expected):
        MisspeltKit().run_reference(dev, pipe, inputs, guidance_scale=1.0)


def test_an_adapter_without_embedded_guidance_takes_the_default_mapping(tiny_flux_schnell, pipe):
    """A checkpoint without a guidance embedding (schnell-like): nothing is passed for embedded guidance, nothing is
    ambiguous."""
    schnell = FluxAdapter.from_pretrained(tiny_flux_schnell, **FluxKit.adapter_kwargs)
    assert schnell.embedded_guidance is None
    assert DefaultMappingKit().reference_guidance_arguments(schnell, pipe, 1.0) == ({"guidance_scale": 1.0}, {})


def test_a_denoiser_failure_says_which_scale_went_where(dev, pipe, inputs):
    """The pipeline run at embedded guidance 5, the adapter's condition at its default 3.5: the denoiser differs, and
    the message shows the mapping and the guidance the pipeline's transformer received."""
    kit = FluxKit()
    case = kit.run_reference(dev, pipe, inputs, guidance_scale=1.0, embedded_guidance=5.0)
    with pytest.raises(AssertionError) as failure:
        kit.check_denoiser(dev, pipe, case)
    assert str(failure.value).endswith(
        "Guidance: ff's CFG scale 1 went to FluxPipeline's true_cfg_scale=1, the embedded guidance to "
        "guidance_scale=5; its denoiser received guidance=5."
    ), str(failure.value)
