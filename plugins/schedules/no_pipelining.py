"""Schedule ``no-pipelining``: all microbatches forward then backward, one at a time, on a
single pipeline stage (gradient accumulation)."""

from __future__ import annotations

from plugtron.api import (
    Action,
    ConfigError,
    hookimpl,
    schedule_backward_step,
    schedule_forward_step,
    sync_context,
)


class NoPipelining:
    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches, config):
        if pp_size != 1 or num_chunks != 1:
            raise ConfigError(f"schedule 'no-pipelining' runs one pipeline stage; got --pp "
                              f"{pp_size}, --vp {num_chunks}: use --schedule 1f1b or auto")
        actions = []
        for mb in range(num_microbatches):
            actions += [Action("F", mb), Action("B", mb)]
        return actions

    @hookimpl
    def forward_backward(self, forward_step_func, data_iterator, model, num_microbatches,
                         forward_only, config, loss_scale):
        chunk = model[0]
        reports = []
        for mb in range(num_microbatches):
            with sync_context(chunk, mb == num_microbatches - 1):
                loss = schedule_forward_step(forward_step_func, data_iterator, chunk, None,
                                                   True, forward_only, reports)
                if not forward_only:
                    schedule_backward_step(loss, None, None, loss_scale)
        return reports
