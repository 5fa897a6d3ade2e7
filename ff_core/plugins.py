"""Plugin discovery: a pluggy PluginManager fed by the ``ff`` entry-point group, one plugin at a time.

pluggy's bulk ``load_setuptools_entrypoints`` stops at the first plugin that fails to import; ff loads each
entry point in its own ``try`` so one broken plugin is reported (by distribution and error) and the rest
still work, the way pytest isolates its plugins.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import inspect
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import pluggy

from ff_core import ADAPTER_INTERFACE_VERSION, hookspecs
from ff_core.adapter import Adapter
from ff_core.rewards.base import GROUPWISE, POINTWISE, Reward

ENTRY_POINT_GROUP = "ff"
DISABLE_ENV = "FF_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "FF_PLUGINS"
"""Comma-separated plugin modules to load besides the entry points (pytest's ``PYTEST_PLUGINS``): a plugin that is not
installed, from a source tree on ``PYTHONPATH`` (examples/plugins/ff_flux's tests). Loaded even with autoload off."""
BUILTIN_PLUGIN = "ff-core"
BUILTIN_DISTRIBUTION = "ff-core"


@dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter and where it came from."""

    name: str
    cls: type[Adapter]
    distribution: str
    version: str
    interface: str | None = None
    """The adapter-interface version the adapter targets (``None``: undeclared, checked as
    :data:`UNDECLARED_INTERFACE`)."""

    @property
    def summary(self) -> str:
        return self.cls.io_contract.describe()


@dataclass(frozen=True)
class RewardInfo:
    """One registered reward and where it came from."""

    name: str
    cls: type[Reward]
    distribution: str
    version: str

    @property
    def summary(self) -> str:
        cls = self.cls
        fields = f"; needs metadata {', '.join(cls.required_fields)}" if cls.required_fields else ""
        return f"{cls.kind} reward of {'/'.join(cls.media_types)}{fields}"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded or registered."""

    plugin: str
    distribution: str
    error: str


class BuiltinRewards:
    """ff_core's own rewards, registered (as the plugin ``ff-core``) through the same ``ff_rewards`` hook as any
    plugin's (STYLE 11)."""

    @staticmethod
    @hookspecs.hookimpl
    def ff_rewards() -> list[type[Reward]]:
        # Only classes: the CLIP model loads when a recipe builds the reward (transformers imports lazily, in __init__).
        from ff_core.rewards.aesthetic import AestheticReward
        from ff_core.rewards.audio import AudioLoudnessReward
        from ff_core.rewards.clap import ClapScoreReward
        from ff_core.rewards.clip import ClipScoreReward
        from ff_core.rewards.hps import HpsReward
        from ff_core.rewards.image import BrightnessReward, ColourReward, JpegCompressibilityReward
        from ff_core.rewards.image_reward import ImageRewardReward
        from ff_core.rewards.ocr import OcrReward
        from ff_core.rewards.pickscore import PickScoreReward
        from ff_core.rewards.remote import RemoteReward
        from ff_core.rewards.vlm_judge import VlmJudgeReward

        return [ColourReward, BrightnessReward, JpegCompressibilityReward, AudioLoudnessReward, ClipScoreReward,
                OcrReward, ClapScoreReward, VlmJudgeReward,
                PickScoreReward, AestheticReward, HpsReward, ImageRewardReward, RemoteReward]


@dataclass
class PluginRegistry:
    """Adapters and rewards found through entry points (plus dotted paths resolved on demand).

    ff_core's built-in rewards (:class:`BuiltinRewards`) register first, through the same hook, also when autoload is
    disabled.

    Args:
        entry_points: entry points to load; default: the installed ``ff`` group, or none when
            ``FF_DISABLE_PLUGIN_AUTOLOAD`` is set.
    """

    entry_points: Iterable[md.EntryPoint] | None = None
    manager: pluggy.PluginManager = field(init=False)
    failures: list[PluginFailure] = field(init=False, default_factory=list)
    _adapters: dict[str, AdapterInfo] = field(init=False, default_factory=dict)
    _rewards: dict[str, RewardInfo] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self._register(BUILTIN_PLUGIN, BUILTIN_DISTRIBUTION, _core_version(), lambda: BuiltinRewards)
        eps = self.entry_points
        if eps is None:
            eps = () if os.environ.get(DISABLE_ENV) else md.entry_points(group=ENTRY_POINT_GROUP)
        for ep in eps:
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            self._register(ep.name, dist, version, ep.load)
        for module_name in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
            self._register(module_name, PLUGINS_ENV, "-", lambda m=module_name: importlib.import_module(m))

    def _register(self, name: str, dist: str, version: str, load) -> None:
        try:
            module = load()
            if self.manager.is_registered(module):  # named by FF_PLUGINS and installed too: once is enough
                return
            self.manager.register(module, name=name)
            # Ask this plugin alone, so a faulty hook is blamed on the plugin that has it.
            others = [p for p in self.manager.get_plugins() if p is not module]
            adapters = [c for r in self.manager.subset_hook_caller("ff_adapters", remove_plugins=others)() for c in r]
            rewards = [c for r in self.manager.subset_hook_caller("ff_rewards", remove_plugins=others)() for c in r]
            target = self.manager.subset_hook_caller("ff_adapter_interface_version", remove_plugins=others)()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of a third-party plugin is reported
            # SystemExit too: a plugin calling sys.exit() at import (or in a hook) would otherwise end `ff plugins`,
            # `ff fit` and `ff data validate --model` for every family; KeyboardInterrupt still stops ff.
            if self.manager.has_plugin(name):
                self.manager.unregister(name=name)
            self.failures.append(PluginFailure(name, dist, _describe_failure(exc)))
            return
        self._add_adapters(adapters, name, dist, version, target)
        self._add_rewards(rewards, name, dist, version)

    def _add_rewards(self, classes: list[type[Reward]], plugin: str, dist: str, version: str) -> None:
        for cls in classes:
            problem = _check_reward_class(cls)
            if problem is None and cls.name in self._rewards:
                problem = f"reward name {cls.name!r} is already provided by {self._rewards[cls.name].distribution}"
            if problem:
                self.failures.append(PluginFailure(plugin, dist, problem))
                continue
            self._rewards[cls.name] = RewardInfo(cls.name, cls, dist, version)

    def _add_adapters(
        self, classes: list[type[Adapter]], plugin: str, dist: str, version: str, target: str | None = None
    ) -> None:
        for cls in classes:
            declared = declared_interface(cls, target)
            who = f"plugin {plugin!r} ({dist} {version})"
            problem = _check_adapter_class(cls) or interface_problem(declared, who, cls) or stage_problem(cls)
            if problem is None and cls.name in self._adapters:
                other = self._adapters[cls.name]
                problem = f"adapter name {cls.name!r} is already provided by {other.distribution}"
            if problem:
                self.failures.append(PluginFailure(plugin, dist, problem))
                continue
            self._adapters[cls.name] = AdapterInfo(cls.name, cls, dist, version, declared)

    def adapters(self) -> dict[str, AdapterInfo]:
        return dict(self._adapters)

    def rewards(self) -> dict[str, RewardInfo]:
        return dict(self._rewards)

    def reward_class(self, name: str) -> type[Reward]:
        """Resolve a registered reward name or a dotted path ``pkg.module:Class``; unknown names raise KeyError
        naming the closest registered reward."""
        if name in self._rewards:
            return self._rewards[name].cls
        if ":" in name or ("." in name and closest_name(name, self._rewards) is None):
            return load_dotted_reward(name)
        close = closest_name(name, self._rewards)
        guess = f"; did you mean {close!r}?" if close else ""
        known = ", ".join(sorted(self._rewards)) or "none"
        hint = "".join(f"\n  plugin {f.plugin} ({f.distribution}) failed: {f.error}" for f in self.failures)
        raise KeyError(f"unknown reward {name!r}{guess} (registered rewards: {known}){hint}")

    def adapter_class(self, name: str) -> type[Adapter]:
        """Resolve a registered name, or a dotted path ``pkg.module:Class`` (or ``pkg.module.Class``).

        An unknown name raises KeyError naming the closest registered name (``sd3`` -> ``sd3-5``).
        """
        if name in self._adapters:
            return self._adapters[name].cls
        why = ""
        if ":" in name or "." in name:
            try:
                return load_dotted_adapter(name)
            except KeyError as exc:
                # ``pkg.mod:Class`` is certainly a path; ``sd3.5`` is more likely a mistyped name: say both.
                if ":" in name or closest_name(name, self._adapters) is None:
                    raise
                why = f" (not a registered name, nor an importable dotted path: {exc.__cause__ or exc.args[0]})"
        close = closest_name(name, self._adapters)
        guess = f"; did you mean {close!r}?" if close else ""
        known = ", ".join(sorted(self._adapters)) or "none (is a plugin such as ff-sd3 installed?)"
        hint = "".join(f"\n  plugin {f.plugin} ({f.distribution}) failed: {f.error}" for f in self.failures)
        raise KeyError(f"unknown adapter {name!r}{why}{guess} (registered adapters: {known}){hint}")


def _describe_failure(exc: BaseException) -> str:
    """``Type: message`` of a plugin's failure; a ``SystemExit`` says that the plugin called ``sys.exit`` and with what
    code (its ``str`` alone is the bare code, ``'3'``)."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: the plugin called sys.exit({exc.code!r}) while loading"
    return f"{type(exc).__name__}: {exc}"


def closest_name(name: str, names: Iterable[str]) -> str | None:
    """The registered name ``name`` most likely meant, or ``None``.

    Case and punctuation are ignored first (``SD3-5``, ``sd35`` -> ``sd3-5``), then :func:`difflib.get_close_matches`
    picks the most similar name (``sd3`` -> ``sd3-5``).
    """
    names = sorted(names)
    squashed = {_squash(n): n for n in names}
    if _squash(name) in squashed:
        return squashed[_squash(name)]
    found = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.6)
    return found[0] if found else None


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def load_dotted_adapter(path: str) -> type[Adapter]:
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"cannot import adapter {path!r}: {exc}") from exc
    problem = (_check_adapter_class(cls) or interface_problem(declared_interface(cls), f"{path!r}", cls)
               or stage_problem(cls))  # fmt: skip
    if problem:
        raise KeyError(f"{path!r}: {problem}")
    return cls


def load_dotted_reward(path: str) -> type[Reward]:
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise KeyError(f"cannot import reward {path!r}: {exc}") from exc
    problem = _check_reward_class(cls)
    if problem:
        raise KeyError(f"{path!r}: {problem}")
    return cls


def _check_reward_class(cls: object) -> str | None:
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        return f"{cls!r} is not a subclass of ff_core.rewards.Reward"
    if not isinstance(getattr(cls, "name", None), str):
        return f"{cls.__name__} does not set the class attribute 'name'"
    if cls.kind not in (POINTWISE, GROUPWISE):
        return f"{cls.__name__}.kind must be {POINTWISE!r} or {GROUPWISE!r}, got {cls.kind!r}"
    return None


def _check_adapter_class(cls: object) -> str | None:
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        return f"{cls!r} is not a subclass of ff_core.adapter.Adapter"
    for attr in ("name", "io_contract"):
        if not hasattr(cls, attr):
            return f"{cls.__name__} does not set the class attribute {attr!r}"
    return None


def unimplemented(cls: type, names: Iterable[str]) -> list[str]:
    """The methods of ``names`` that ``cls`` leaves to :class:`~ff_core.adapter.Adapter`, whose versions raise
    (``FlowDataModule`` checks the ones a run calls before weights load)."""
    return [n for n in names if inspect.getattr_static(cls, n) is vars(Adapter)[n]]


GUARDED_ARGUMENTS: dict[str, frozenset[str] | None] = {
    "sampling_sigmas": frozenset({"state"}),  # 1.1: an override without it still samples (Adapter.sampling_schedules)
    "sample": None,  # every optional argument: passed only when set, each checked before weights load (evaluation.py)
    "save_loras": frozenset({"extra_files"}),  # FlowCheckpoint writes its record after an override without it
}
"""Optional arguments of the base's stage methods ff-core passes only to an override that takes them (``None``: all of
the method's optional arguments; :func:`takes_argument` is the test): a minor version that adds an argument to an
existing method lists it here."""


def takes_argument(function: Any, name: str) -> bool:
    """Whether ``function`` (a bound method, or a class's function) takes an argument ``name`` by name: a parameter of
    that name, or ``**kwargs``: how ``FlowCheckpoint`` (``save_loras``' ``extra_files``) and the evaluation checks
    (``sample``'s optional arguments) test a :data:`GUARDED_ARGUMENTS` override before passing it (``sampling_sigmas``'
    ``state`` is tested in :meth:`~ff_core.adapter.Adapter.sampling_schedules`, below the registry)."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name and p.kind is not p.POSITIONAL_ONLY or p.kind is p.VAR_KEYWORD for p in parameters)


def _caller_view(attr: object) -> tuple[str, inspect.Signature, inspect.Signature] | None:
    """``(kind, signature as a caller sees it, as written)`` of a class attribute: ``kind`` is ``method``,
    ``classmethod`` or ``staticmethod``; the caller's view leaves the bound ``self`` / ``cls`` out. ``None`` for
    anything else (a property, data)."""
    if isinstance(attr, (classmethod, staticmethod)):
        kind, func = type(attr).__name__, attr.__func__
    elif inspect.isfunction(attr):
        kind, func = "method", attr
    else:
        return None
    signature = inspect.signature(func)
    params = list(signature.parameters.values())
    if kind != "staticmethod" and params and params[0].kind in (params[0].POSITIONAL_ONLY,
                                                                params[0].POSITIONAL_OR_KEYWORD):  # fmt: skip
        params = params[1:]  # self / cls (a wrapper's *args keeps taking it)
    return kind, signature.replace(parameters=params), signature


def _argument_problem(name: str, base: inspect.Signature, override: inspect.Signature) -> str | None:
    """What ``override`` cannot take of the arguments ff-core passes as ``base`` (the Adapter method) declares them:
    each at its position and, when optional, by its name too (ff-core passes some of each way); or an argument it
    requires that the base does not declare. ``None`` when it takes them all."""
    params = list(override.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_args = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    by_name = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    guarded = GUARDED_ARGUMENTS.get(name, frozenset())
    wanted = [a for a in base.parameters.values() if a.kind not in (a.VAR_POSITIONAL, a.VAR_KEYWORD)]
    for index, arg in enumerate(wanted):
        if arg.default is not arg.empty and (guarded is None or arg.name in guarded):
            continue
        optional = arg.default is not arg.empty
        if optional and arg.name not in by_name and not var_kwargs:
            return f"without the argument {arg.name}=, which ff-core passes"
        at_position = (index < len(positional) and (not optional or positional[index].name == arg.name)
                       or index >= len(positional) and var_args)  # fmt: skip
        if arg.kind is not arg.KEYWORD_ONLY and not at_position:
            if optional:
                return f"without {arg.name} as its {index + 1}. argument, where ff-core may pass it"
            return f"without its {index + 1}. argument ({arg.name}), which ff-core passes"
    names = {a.name for a in wanted}
    for index, p in enumerate(params):
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if required and (index >= len(wanted) if p.kind is not p.KEYWORD_ONLY else p.name not in names):
            return f"requiring the argument {p.name}, which ff-core never passes"
    return None


def stage_problem(cls: type[Adapter]) -> str | None:
    """Why ``cls``'s overrides cannot be called the way ff-core calls the stages, or ``None``: an override of a
    classmethod that is not one, or one that cannot take an argument the base declares at its position (and, optional
    ones, by name; :data:`GUARDED_ARGUMENTS` aside) or requires one the base does not. Checked at registration, so
    such an adapter is refused with this line rather than failing inside training. Stages left to the base (which
    raises) are checked against each run instead (``FlowDataModule``), since a run calls only some of them (``ff data
    validate --model`` reads the contract alone)."""
    for name, attr in vars(Adapter).items():
        base = None if name.startswith("_") else _caller_view(attr)
        own = inspect.getattr_static(cls, name)
        if base is None or own is attr:
            continue
        try:
            override = _caller_view(own)
        except (TypeError, ValueError) as exc:  # a wrapper whose signature cannot be read
            return f"adapter {cls.__name__}: the signature of its {name} cannot be read ({exc})"
        if override is None:
            continue  # a property or a value in place of a method: the attribute checks of the stage catch it
        declare = f"declare it as the Adapter base does, {name}{str(base[2]).replace(chr(39), '')}"
        if base[0] == "classmethod" and override[0] == "method":
            return (f"adapter {cls.__name__} overrides the classmethod {name} with a plain method (ff-core calls it "
                    f"on the class, before any weight loads): add @classmethod and {declare}")  # fmt: skip
        problem = _argument_problem(name, base[1], override[1])
        if problem:
            return f"adapter {cls.__name__} overrides {name}{override[2]} {problem}: {declare}"
    return None


UNDECLARED_INTERFACE = "1.0"
"""The adapter-interface version an adapter that declares none is checked as: the first one, before plugins could
declare it (so a core of another major version refuses it rather than running it unchecked)."""


def declared_interface(cls: type, target: str | None = None) -> str | None:
    """The adapter-interface version ``cls`` declares: ``interface_version`` set on it or on a base class of its own
    top-level package, else ``target`` (its plugin's ``ff_adapter_interface_version`` hook); ``None``: undeclared.

    A base class from another package does not declare for ``cls``: a third-party subclass of ff-sd3's
    ``SD3Adapter`` is not written for the version ff-sd3 targets.

    Args:
        cls: the adapter class.
        target: the plugin hook's version, if any.
    """
    package = cls.__module__.partition(".")[0]
    for klass in cls.__mro__:
        version = vars(klass).get("interface_version")
        if version is not None and klass.__module__.partition(".")[0] == package:
            return version
    return target


def _interface(version: str) -> tuple[int, int] | None:
    parts = version.split(".") if isinstance(version, str) else []
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def interface_problem(target: str | None, who: str, cls: type) -> str | None:
    """Why an adapter that targets adapter-interface version ``target`` cannot run on this ff-core, or ``None``.

    Compatible: the same major version and a minor no newer than :data:`ff_core.ADAPTER_INTERFACE_VERSION` (minor
    versions only add what existing adapters need not implement). ``None`` (undeclared) is checked as
    :data:`UNDECLARED_INTERFACE`.

    Args:
        target: the version the adapter declares (:func:`declared_interface`).
        who: the plugin or dotted path, for the message (``plugin 'sd3' (ff-sd3 0.1.0)``).
        cls: the adapter class, for the message.
    """
    name = f"adapter {cls.__name__} of {who}"
    if target is None:
        target, name = UNDECLARED_INTERFACE, f"{name} (no interface version declared, assumed {UNDECLARED_INTERFACE})"
    if not isinstance(target, str):
        return (f"{name} declares ff adapter interface {target!r}, a {type(target).__name__}; declare it as a "
                f"string 'major.minor' ({str(target)!r}, not {target!r}: 1.10 as a number is 1.1)")  # fmt: skip
    core, wanted = _interface(ADAPTER_INTERFACE_VERSION), _interface(target)
    if wanted is None:
        return f"{name} declares ff adapter interface {target!r}; expected 'major.minor'"
    have = f"ff-core {_core_version()} provides adapter interface {ADAPTER_INTERFACE_VERSION}"
    if wanted[0] != core[0]:
        return (f"{name} targets ff adapter interface {target}, but {have}: a different major version is "
                f"incompatible (install a release of the plugin written for interface {core[0]}.x)")  # fmt: skip
    if wanted[1] > core[1]:
        return (f"{name} targets ff adapter interface {target}, but {have}, an older minor version "
                f"(upgrade ff-core to one providing {target} or later)")  # fmt: skip
    return None


@lru_cache(maxsize=1)
def get_registry() -> PluginRegistry:
    """The process-wide registry of installed plugins (built on first use)."""
    return PluginRegistry()


def get_adapter_class(name: str) -> type[Adapter]:
    return get_registry().adapter_class(name)


def get_reward_class(name: str) -> type[Reward]:
    return get_registry().reward_class(name)


def _core_version() -> str:
    try:
        return md.version(BUILTIN_DISTRIBUTION)
    except md.PackageNotFoundError:
        return "?"
