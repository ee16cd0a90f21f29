"""Schedule ``gpipe``: every forward, then every backward (the baseline).

It keeps all ``M`` microbatches' activations (``M x vp`` chunks under interleaving) until the
backwards start; its bubble equals 1F1B's. With ``--vp`` the forwards go chunk by chunk and the
backwards in the reverse chunk order.
"""

from __future__ import annotations

from plugtron.api import Action, ActionListSchedule, hookimpl


class GPipe(ActionListSchedule):
    @hookimpl
    def schedule_actions(self, num_chunks, num_microbatches):
        forwards = [Action("F", mb, c) for c in range(num_chunks)
                    for mb in range(num_microbatches)]
        backwards = [Action("B", mb, c) for c in reversed(range(num_chunks))
                     for mb in range(num_microbatches)]
        return forwards + backwards
