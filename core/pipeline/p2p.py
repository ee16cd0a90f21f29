"""Point-to-point communication between adjacent pipeline stages.

Every message is one activation (forward direction, to the next stage) or one activation gradient
(backward direction, to the previous stage) of a fixed shape, ``[micro_batch, seq, hidden]`` with
the sequence divided by cp (and by tp under sequence parallelism), in the model's dtype. Because
the shape is known from the config, no shapes travel on the wire.

Neighbours wrap around (the last stage's next is the first stage): under interleaving, chunk v
on the last rank feeds chunk v + 1 on the first rank.

All transfers go through :meth:`P2PCommunicator.exchange`, one batch of ``isend``/``irecv``
(``torch.distributed.batch_isend_irecv``: one fused group under NCCL, plain async ops under
gloo). Inside a batch the ops are posted in a fixed order, forward-direction messages before
backward-direction ones, and they carry the direction as their tag, so with two stages, where
"previous" and "next" are the same rank, an activation can never be matched to a gradient.
The blocking helpers (``send_forward``, ``send_forward_recv_backward`` ...) are Megatron's
vocabulary on top of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from plugtron.core.parallel import comm

FORWARD_TAG = 0  # activations, sent to the next stage
BACKWARD_TAG = 1  # activation gradients, sent to the previous stage


def activation_shape(config, parallel) -> tuple[int, int, int]:
    """``[micro_batch, seq, hidden]`` of the tensors that cross a stage boundary."""
    seq = config.model.seq_length // parallel.cp_size
    if config.parallel.sequence_parallel and parallel.tp_size > 1:
        seq //= parallel.tp_size
    return (config.training.micro_batch_size, seq, config.model.hidden_size)


@dataclass
class Exchange:
    """One posted batch: its requests per op and the tensors it receives into.

    ``wait(role)`` completes one op (``"send_next"``, ``"recv_prev"``, ``"send_prev"``,
    ``"recv_next"``); ``wait()`` all of them. A completed send drops its buffer. Under gloo a
    send's request only reports completion through ``wait``, even once the peer has the data.
    """

    works: dict = field(default_factory=dict)  # role -> list of requests
    buffers: dict = field(default_factory=dict)  # role -> tensor sent or received into

    @property
    def from_prev(self) -> torch.Tensor | None:
        return self.buffers.get("recv_prev")

    @property
    def from_next(self) -> torch.Tensor | None:
        return self.buffers.get("recv_next")

    @property
    def activation(self) -> torch.Tensor:
        """What an exchange that asked ``recv_prev`` received."""
        return self._received("recv_prev")

    @property
    def gradient(self) -> torch.Tensor:
        """What an exchange that asked ``recv_next`` received."""
        return self._received("recv_next")

    def _received(self, role: str) -> torch.Tensor:
        tensor = self.buffers.get(role)
        if tensor is None:
            raise RuntimeError(f"this exchange posted no {role}")
        return tensor

    def wait(self, *roles: str) -> Exchange:
        for role in roles or tuple(self.works):
            for work in self.works.pop(role, ()):
                work.wait()
            if role.startswith("send"):
                self.buffers.pop(role, None)
        return self


class P2PCommunicator:
    """Sends and receives between this rank and its pipeline neighbours."""

    def __init__(self, parallel, tensor_shape, dtype: torch.dtype, device):
        self.group = parallel.pp_group
        self.prev_rank = parallel.pp_prev_rank
        self.next_rank = parallel.pp_next_rank
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        backend = dist.get_backend(self.group) if self.group is not None else None
        #: Whether a posted receive blocks nothing else (gloo: each op is independent). Under
        #: NCCL a batch is a stream-ordered group, so receives must stay in the batch of the step
        #: whose send they pair with.
        self.receives_run_ahead = backend != "nccl"
        if backend == "nccl":
            # NCCL creates a communicator on a group's first call, which all members must join;
            # later batches touch only two ranks of the group.
            comm.all_reduce(torch.zeros(1, device=self.device), self.group)

    @classmethod
    def from_config(cls, config, parallel, dtype: torch.dtype, device) -> P2PCommunicator:
        return cls(parallel, activation_shape(config, parallel), dtype, device)

    def new_buffer(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)

    def _check(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(f"p2p {what}: expected {self.tensor_shape} {self.dtype}, got "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        return tensor.detach().contiguous()

    def exchange(self, send_next: torch.Tensor | None = None,
                 send_prev: torch.Tensor | None = None, recv_prev: bool = False,
                 recv_next: bool = False) -> Exchange:
        """Post one batch without waiting: an activation to the next stage, a gradient to the
        previous one, and receives from either. ``Exchange.wait()`` completes it; the received
        tensors are ``from_prev`` (an activation) and ``from_next`` (a gradient)."""
        out = Exchange()
        ops = []
        # Forward-direction messages first, then backward ones: with two stages the peer posts
        # its matching ops in the same order.
        for role, tensor, peer, tag in (("send_next", send_next, self.next_rank, FORWARD_TAG),
                                        ("recv_prev", recv_prev, self.prev_rank, FORWARD_TAG),
                                        ("send_prev", send_prev, self.prev_rank, BACKWARD_TAG),
                                        ("recv_next", recv_next, self.next_rank, BACKWARD_TAG)):
            if tensor is None or tensor is False:
                continue
            op: Callable[..., object]
            if role.startswith("send"):
                assert isinstance(tensor, torch.Tensor)  # True only ever asks to receive
                buffer = self._check(tensor, role.replace("_", " to the ") + " stage")
                op = dist.isend
            else:
                buffer, op = self.new_buffer(), dist.irecv
            out.buffers[role] = buffer
            ops.append((role, dist.P2POp(op, buffer, peer, self.group, tag)))
        if not ops:
            return out
        works = list(dist.batch_isend_irecv([op for _, op in ops]))
        for index, (role, _) in enumerate(ops):
            # gloo returns one request per op; NCCL one for the fused group, shared by all.
            out.works[role] = [works[index]] if len(works) == len(ops) else works
        return out

    # Megatron's blocking vocabulary -----------------------------------------------------

    def send_forward(self, output: torch.Tensor) -> None:
        self.exchange(send_next=output).wait()

    def recv_forward(self) -> torch.Tensor:
        return self.exchange(recv_prev=True).wait().activation

    def send_backward(self, input_grad: torch.Tensor) -> None:
        self.exchange(send_prev=input_grad).wait()

    def recv_backward(self) -> torch.Tensor:
        return self.exchange(recv_next=True).wait().gradient

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor:
        return self.exchange(send_next=output, recv_next=True).wait().gradient

    def send_backward_recv_forward(self, input_grad: torch.Tensor) -> torch.Tensor:
        return self.exchange(send_prev=input_grad, recv_prev=True).wait().activation

    def send_forward_recv_forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.exchange(send_next=output, recv_prev=True).wait().activation

    def send_backward_recv_backward(self, input_grad: torch.Tensor) -> torch.Tensor:
        return self.exchange(send_prev=input_grad, recv_next=True).wait().gradient
