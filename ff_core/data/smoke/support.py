"""Which catalogue aliases this installation serves: an alias is served when an installed adapter of its name realises
its profile under the alias's checkpoint variant, checked against that adapter's own contract (never assumed).

"Realises" is what ``ff data validate --model`` would say about the profile's rows: one placeholder record per input
form of the profile (the outputs with their rates) must pass :func:`~ff_core.data.records.validation.record_errors`
against the contract, so the check is the loader's, not a second rule set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ff_core.contracts import MediaType, PipelineIOContract
from ff_core.data.records import MediaItem, Record
from ff_core.data.records.validation import record_errors
from ff_core.data.smoke.catalogue import ALIASES, PROFILES, Alias, Profile, SmokeError, lookup


@dataclass(frozen=True)
class Support:
    """Whether one alias is served here.

    Attributes:
        alias: the catalogue entry.
        contract: the adapter's contract for the alias's variant (``None`` when unserved).
        reason: why it is not served (``None`` when served).
        adapter_class: the installed adapter class (``None`` when it is not installed).
    """

    alias: Alias
    contract: PipelineIOContract | None = None
    reason: str | None = None
    adapter_class: type | None = None

    @property
    def served(self) -> bool:
        return self.reason is None


def _placeholder(profile: Profile, form_index: int) -> Record:
    """A demonstration record of the profile's form ``form_index``, with placeholder paths (nothing is read: an
    unreadable image header is left to decoding by the validation)."""
    outputs = tuple(MediaItem(o.type, Path(f"output{i}"), fps=1.0 if o.type is MediaType.VIDEO else None,
                              sample_rate=1 if o.type is MediaType.AUDIO else None)
                    for i, o in enumerate(profile.outputs))  # fmt: skip
    inputs = tuple(MediaItem(item.type, Path(f"input{i}"), slot=item.slot, origin=f"input.media[{i}]")
                   for i, item in enumerate(profile.forms[form_index]))  # fmt: skip
    return Record(Path(profile.name), form_index + 1, "a placeholder prompt", inputs=inputs,
                  supervision="demonstration", candidates=(outputs,), schema="v2")


def realises(contract: PipelineIOContract, profile: Profile) -> str | None:
    """Why a pipeline of ``contract`` cannot train on ``profile``'s rows (the first problem), or ``None``."""
    for index in range(len(profile.forms)):
        errors = record_errors(_placeholder(profile, index), contract)
        if errors:
            form = ", ".join(i.slot or i.type.value for i in profile.forms[index]) or "prompt only"
            return f"its contract refuses the profile's rows ({form}): {errors[0].field}: {errors[0].reason}"
    return None


def support(alias: Alias, adapters: dict[str, type] | None = None) -> Support:
    """Whether ``alias`` is served by the installed adapters.

    Args:
        alias: a catalogue entry.
        adapters: adapter name -> class (default: the registry's, :func:`ff_core.plugins.get_registry`).
    """
    if adapters is None:
        from ff_core.plugins import get_registry

        adapters = {name: info.cls for name, info in get_registry().adapters().items()}
    cls = adapters.get(alias.adapter)
    if cls is None:
        return Support(alias, reason=f"adapter {alias.adapter!r} is not installed (installed adapters: "
                                     f"{', '.join(sorted(adapters)) or 'none'})")  # fmt: skip
    if alias.variant is None:
        contract = cls.resolve_contract(None)
    else:
        variants = getattr(cls, "io_contract_variants", {}) or {}
        if alias.variant not in variants:
            return Support(alias, reason=f"adapter {alias.adapter!r} has no {alias.variant!r} checkpoint variant "
                                         f"(its variants: {', '.join(sorted(variants)) or 'none'})",
                           adapter_class=cls)  # fmt: skip
        contract = variants[alias.variant]
    problem = realises(contract, PROFILES[alias.profile])
    if problem:
        return Support(alias, reason=f"adapter {alias.adapter!r}: {problem}", adapter_class=cls)
    return Support(alias, contract=contract, adapter_class=cls)


def support_table(adapters: dict[str, type] | None = None) -> dict[str, Support]:
    """Every alias of the catalogue with whether it is served here, in catalogue order."""
    return {name: support(alias, adapters) for name, alias in ALIASES.items()}


def served_alias(name: str, adapters: dict[str, type] | None = None) -> Support:
    """The served alias ``name`` means: the alias itself, or a canonical profile's first served alias.

    Raises:
        SmokeError: an unknown name, or nothing installed serves it (naming the adapter it needs and why).
    """
    _, aliases = lookup(name)
    found = [support(a, adapters) for a in aliases]
    for entry in found:
        if entry.served:
            return entry
    if len(found) == 1:
        raise SmokeError(f"profile {name!r} is not served here: {found[0].reason}")
    reasons = "; ".join(f"{s.alias.name}: {s.reason}" for s in found)
    raise SmokeError(f"profile {name!r} is not served here by any of its aliases ({reasons})")
