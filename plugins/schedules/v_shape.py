"""What the V-shape schedules (zbv, dualpipev) share: the placement they declare and the layout
they need."""

from __future__ import annotations

from plugtron.api import V_SHAPE, ActionListSchedule, ConfigError, hookimpl


class VShapeSchedule(ActionListSchedule):
    """An action-list schedule on the V-shape placement: two chunks per rank, pp 2 or more.
    Subclasses name themselves (``name``) and implement ``v_actions``."""

    name = "a V-shape schedule"

    @hookimpl
    def pipeline_placement(self):
        return V_SHAPE

    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches):
        if num_chunks != 2:
            raise ConfigError(f"{self.name} places two model chunks per pipeline rank in a V; "
                              f"got --vp {num_chunks}")
        if pp_size < 2:
            raise ConfigError(f"{self.name} needs --pp 2 or more")
        return self.v_actions(pp_rank, pp_size, num_microbatches)

    def v_actions(self, pp_rank: int, pp_size: int, num_microbatches: int):
        raise NotImplementedError
