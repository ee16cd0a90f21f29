"""plugtron-moe: the mixture-of-experts layer type ``E`` for plugtron.

Public for third parties: :class:`plugtron_moe.dispatcher.TokenDispatcher` (the dispatch/combine
contract a token dispatcher implements), :class:`plugtron_moe.dispatcher.Dispatched`, and
:func:`plugtron_moe.testing.assert_dispatcher_matches` (the check a dispatcher passes).
Everything else is this plugin's own. docs/moe.md describes the flags, the contract, expert
parallel layouts and the HF mapping.
"""

from .dispatcher import Dispatched, TokenDispatcher

__all__ = ["Dispatched", "TokenDispatcher"]
