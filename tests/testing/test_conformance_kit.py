"""The conformance kit's own wiring: its modules are rewritten by pytest (asserts report their operands in a plugin's
tests), and its comparisons say what differs and where."""

import pytest
import torch

from ff_core.testing import conformance, reference
from ff_core.testing.reference import check_close, differences, is_permutation


@pytest.mark.parametrize("module", [conformance, reference])
def test_kit_modules_are_registered_for_assertion_rewriting(module):
    assert type(module.__loader__).__name__ == "AssertionRewritingHook", module.__loader__


def test_differences_name_the_worst_element_and_count_the_others():
    theirs = torch.zeros(2, 3)
    ours = theirs.clone()
    ours[1, 2], ours[0, 0] = 0.5, 1e-6
    assert differences(ours, theirs, atol=1e-4, rtol=0) == (
        "max |adapter - reference| = 0.5 at index [1, 2] (adapter 0.5, reference 0); 1 of 6 elements beyond "
        "atol=0.0001, rtol=0")
    mask = torch.tensor([[1.0], [0.0]])  # the second sample pinned: not compared
    assert differences(ours, theirs, atol=1e-4, rtol=0, mask=mask) is None
    assert differences(ours[:1], theirs, atol=1, rtol=0) == "shapes differ: adapter (1, 3), reference (2, 3)"
    with pytest.raises(AssertionError, match=r"^the latents differs from the reference: max .*\. Check this\.$"):
        check_close("the latents", ours, theirs, atol=1e-4, hint="Check this.")


def test_a_permutation_is_told_from_other_differences():
    x = torch.randn(2, 4, 3, 3, generator=torch.Generator().manual_seed(0))
    assert is_permutation(x.transpose(-1, -2), x, atol=1e-6)
    assert not is_permutation(x * 1.1, x, atol=1e-6)
