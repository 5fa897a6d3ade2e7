"""The plugin author's manual: every hook ff calls, when, with what, and what it expects back.

A plugin is a Python module named by an entry point in the ``ff`` group::

    # pyproject.toml of your distribution
    [project.entry-points.ff]
    my-family = "my_package.plugin"

The module defines functions decorated with :data:`hookimpl` whose names match the specs below. ff loads each
entry point in isolation: a plugin that fails to import is reported by ``ff plugins`` with its distribution
name and error, and every other plugin still loads. Set ``FF_DISABLE_PLUGIN_AUTOLOAD=1`` to load none
(hermetic tests); adapters can then still be named by dotted path (``my_package.adapter:MyAdapter``). Set
``FF_PLUGINS=my_package.plugin[,other.plugin]`` to load plugin modules that are importable but not installed (a
source tree on ``PYTHONPATH``); they load even with autoload off, and ``ff plugins`` lists their distribution as
``FF_PLUGINS``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ff_core.adapter import Adapter
    from ff_core.rewards import Reward

PROJECT = "ff"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def ff_adapters() -> list[type[Adapter]]:
    """Return the adapter classes this plugin provides.

    Called once per process, when the registry is first built (``ff plugins``, ``ff fit``, ``ff data``).
    Each class must subclass :class:`ff_core.adapter.Adapter` and set ``name`` and ``io_contract`` as class
    attributes; nothing may load weights here. Results of all plugins are merged; two adapters with the same
    ``name`` from different plugins are a conflict reported by ``ff plugins`` (the first one loaded wins).
    """


@hookspec
def ff_rewards() -> list[type[Reward]]:
    """Return the reward classes this plugin provides.

    Called once per process, when the registry is first built, like :func:`ff_adapters`; ff_core's own rewards
    (``colour``, ``brightness``, ``jpeg_compressibility``, ``audio_loudness``, ``clip_score``) come through this
    same hook. Each class must subclass :class:`ff_core.rewards.Reward` and set ``name`` (what recipes write in
    ``rewards: [{name: ...}]``); ``kind`` (``pointwise`` or ``groupwise``), ``required_fields`` (record metadata it
    reads) and ``media_types`` default to a pointwise image reward reading no metadata. Nothing may load weights
    here: a reward loads its model in ``__init__``. Two rewards with the same ``name`` are a conflict reported by
    ``ff plugins`` (the first one loaded wins; ff_core's built-ins load first).
    """


@hookspec(firstresult=True)
def ff_adapter_interface_version() -> str:
    """Return the ff adapter-interface version (``"major.minor"``) this plugin's adapters are written for.

    Optional; an adapter class's own ``interface_version`` attribute takes precedence. ff compares it with
    :data:`ff_core.ADAPTER_INTERFACE_VERSION` when the plugin registers and refuses (reported by ``ff plugins``,
    naming both versions and the distribution) a plugin that targets another major version or a newer minor one.
    """
