"""Per-step bookkeeping without host syncs or per-step object collectives: the token weight of
added losses stays a tensor, and the pipeline's report keys are agreed once and cached."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from plugtron.core.training import aux_losses
from plugtron.core.training import loop as training


def test_added_loss_weight_is_never_read_on_the_host():
    # A meta tensor has no value: any float()/item() on it raises, so this passes only if the
    # microbatch's token count stays a tensor up to the step's report.
    aux_losses.take()
    aux_losses.note_microbatch({"loss_mask": torch.ones(2, 4, device="meta")})
    hidden = torch.zeros(3, device="meta", requires_grad=True)
    loss = (hidden * 2).sum()
    out = aux_losses.add_loss(hidden * 1, "z", loss)
    out.sum().backward()
    taken = aux_losses.take()
    assert taken["z"].device.type == "meta" and hidden.grad.shape == (3,)
    aux_losses.note_microbatch({"loss_mask": torch.ones(2, 4)})  # leave a real one behind


def test_pipeline_report_keys_are_gathered_once_and_again_on_change(monkeypatch):
    gathers = []

    def all_gather_object(out, obj, group=None):
        gathers.append(list(obj))
        out[:] = [obj, [("added", "stage0 aux")]]  # the other stage's keys

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    parallel = SimpleNamespace(pp_size=2, pp_group=None, dp_cp_group=None)
    report = {"lm loss": torch.tensor([6.0, 3.0]), "num_tokens": torch.tensor(3.0)}
    cache = {}
    for _ in range(3):
        out = training.reduce_reports([report], parallel, {}, cache)
    assert len(gathers) == 1
    assert out == {"lm loss": 2.0, "stage0 aux": 0.0}
    out = training.reduce_reports([{**report, "acc": 0.5}], parallel, {}, cache)
    assert len(gathers) == 2 and out["acc"] == 0.5
    training.reduce_reports([{**report, "acc": 0.5}], parallel, {}, cache)
    assert len(gathers) == 2
