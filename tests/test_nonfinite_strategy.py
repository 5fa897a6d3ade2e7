"""``model.nonfinite: skip`` is refused under DeepSpeed (issue 24 review).

DeepSpeed's engine keeps the gradients (``p.grad`` is ``None`` on the module's parameters: DeepSpeed's ZeRO stage 1/2
optimiser reduces them into its own flat partitions), so ``skip`` could neither see nor drop a NaN gradient and the
step would be applied. The strategy is a real ``lightning.pytorch.strategies.DeepSpeedStrategy`` instance, made
without its ``__init__`` (which needs the ``deepspeed`` package, not installed here).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from ff_core.errors import ConfigError
from ff_core.module import FlowModule
from ff_core.nonfinite import NonFiniteGuard, check_strategy


def _deepspeed() -> DeepSpeedStrategy:
    return object.__new__(DeepSpeedStrategy)  # isinstance holds; __init__ would import deepspeed


def test_skip_refused_under_deepspeed():
    with pytest.raises(ConfigError, match=r"^model\.nonfinite: skip is not supported under DeepSpeedStrategy"):
        check_strategy("skip", _deepspeed())


def test_stop_under_deepspeed_and_skip_under_ddp_pass():
    check_strategy("stop", _deepspeed())
    check_strategy("skip", DDPStrategy())


def test_flow_module_strategy_check_refuses_it():
    """FlowModule's strategy check (run in setup, before weights load) applies it."""
    module = SimpleNamespace(nonfinite_guard=NonFiniteGuard("skip"))
    with pytest.raises(ConfigError, match=r"^model\.nonfinite"):
        FlowModule._check_strategy(module, _deepspeed())
