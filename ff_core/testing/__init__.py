"""Test helpers for ff and its plugin authors: synthetic datasets, tiny-component builders, the conformance kit."""

try:  # pytest is a test dependency: the datasets and builders here also run without it
    import pytest
except ImportError:  # pragma: no cover
    pass
else:
    # The kit's asserts report their operands under pytest, in a plugin's tests too: its modules are registered for
    # assertion rewriting before anything imports them (importing a package runs its __init__ first).
    pytest.register_assert_rewrite("ff_core.testing.conformance", "ff_core.testing.reference")
