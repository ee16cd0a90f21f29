"""The contract's version, and the old names it still answers to.

A plugin can require the contract it was written for (``plugtron.api.require_contract(3)`` at
import: a plugtron whose contract is older refuses it with a message, instead of failing later
on a missing name). A change to the contract keeps the previous names working for one contract
version with a :class:`PlugtronDeprecationWarning` that names the replacement; ``plugtron
plugins check`` reports every use it saw while importing a plugin, and docs/migration.md lists
each change.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

from plugtron.core.errors import PluginError

#: 1: the first hooks; 2: plugtron.api and typed option sections; 3: the core calls loss_func,
#: public optimizer protocol, plugin-declared flag aliases.
CONTRACT_VERSION = 3


class PlugtronDeprecationWarning(DeprecationWarning):
    """A plugin used a name the contract replaced; it still works for one more version."""


@dataclass(frozen=True)
class DeprecatedUse:
    module: str  # where the use was seen (the plugin's module)
    message: str


#: Every deprecated use seen in this process, in order (``plugins check`` reads them).
USES: list[DeprecatedUse] = []


def deprecated(message: str, module: str, stacklevel: int = 3) -> None:
    """Record and warn once per (module, message): ``message`` says what was used, its
    replacement and the contract version that removes it."""
    use = DeprecatedUse(module, message)
    if use in USES:
        return
    USES.append(use)
    warnings.warn(message, PlugtronDeprecationWarning, stacklevel=stacklevel)


def uses_in(module_prefix: str) -> list[str]:
    """The deprecated uses recorded in ``module_prefix`` or its submodules."""
    return [u.message for u in USES
            if u.module == module_prefix or u.module.startswith(module_prefix + ".")]


def require_contract(version: int) -> None:
    """Refuse to go on under a plugtron whose contract is older than ``version`` (call it at the
    top of a plugin module)."""
    if version > CONTRACT_VERSION:
        caller = sys._getframe(1).f_globals.get("__name__", "a plugin")
        raise PluginError(f"{caller} needs plugtron's plugin contract {version}; this plugtron "
                          f"has contract {CONTRACT_VERSION}: upgrade plugtron")


def show_deprecations() -> None:
    """Make deprecations visible (Python hides DeprecationWarning outside ``__main__``): the
    CLI and each rank call it once."""
    warnings.filterwarnings("default", category=PlugtronDeprecationWarning)
