"""GPipe schedule over a Communicator's point-to-point calls: all forwards, then all backwards.

Stage s receives activations (micro_batch_size, seq_len, d_model) from stage s-1 and sends its
output to s+1; in backward it receives the output gradient from s+1 and sends the input gradient
to s-1. Every stage issues its operations in the same micro-batch order, so the schedule cannot
deadlock, and shapes come from the plan, so nothing but tensors crosses the wire.

A device of a stage held by fewer devices than the plan's largest shard group runs several lanes
(modules.control.dist.Topology.my_lanes): their micro-batches one lane after the other, each
from and to that lane's devices of the neighbouring stages; the message of lane i's micro-batch
m has tag FWD_TAG/BWD_TAG + i*M + m, so two lanes between the same two devices never mix.

Every receive of a step is posted when the step starts: gloo's point-to-point is a rendezvous
(data flows once the receiver has posted its buffer), so a receive posted only when needed
costs an extra round trip per message; on a 67 ms link, 4 sequential 128 KB messages took
0.87 s against 0.24 s pre-posted (measured between two namespace hosts).

With --precision bf16/fp16 (modules.device.precision) a stage computes under autocast. Activations
and their gradients cross links as the plan's pipeline_compression says (modules.pipeline.wire:
the compute dtype, bf16, or int8 with one scale per token row); a received message is turned
back into fp32, so every stage's residual stream and backward input stay fp32. The last stage
scales its loss with the step's loss scaling (fp16) before backward, so every stage's gradients
carry the same scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from modules.comm import Communicator, Posted
from modules.control.dist import Topology
from modules.control.protocol import BWD_TAG, FWD_TAG
from modules.device.precision import Precision
from modules.model.decoder import StageModel
from modules.pipeline.wire import PipelineWire

ScaleLoss = Callable[[torch.Tensor], torch.Tensor]
"""The last stage's loss -> what backward runs on (fp16: loss x the current scale)."""


class PipelineStage:
    """Runs this rank's stage of the pipeline for one step of micro-batches."""

    def __init__(self, model: StageModel, topo: Topology, comm: Communicator | None,
                 micro_batch_size: int, precision: Precision | None = None,
                 compression: str = "none") -> None:
        self.model, self.topo = model, topo
        self.comm = comm
        """My pipeline's communicator (peers by device id; None with one stage). The Trainer
        sets it again when a new generation re-forms the groups."""
        spec = model.spec
        self.act_shape = (micro_batch_size, spec.seq_len, spec.d_model)
        self.device = next(model.parameters()).device
        """Where activations and their gradients are received."""
        self.precision = precision or Precision("fp32", self.device)
        self.wire = PipelineWire(compression, self.precision)
        """How activations and their gradients are encoded on the pipeline's links."""
        self.bytes_sent = 0
        """Bytes of the messages this stage sent (activations and gradients, eval included)."""
        self.loss_divisor = 1
        """The last stage divides each micro-batch's loss by (its micro-batches x this): with
        shard groups, the devices of its shard group (FSDP2 then sums gradients, so a step's
        gradient is the mean over the replica's L lanes on every stage, whatever its D)."""
        self.before_backward: Callable[[bool], None] | None = None
        """Called before each micro-batch's backward with whether it is the step's last
        (shard groups: FSDP2's gradient sync; modules.shard)."""

    def _buffer(self) -> torch.Tensor:
        """An empty receive buffer for one micro-batch's message (its encoded size)."""
        return self.wire.buffer(self.act_shape, self.device)

    def _wait(self, posted: Posted, what: str) -> torch.Tensor:
        """The fp32 tensor a posted receive brought."""
        return self.wire.decode(self.comm.wait(posted, what), self.act_shape)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> tuple[Posted, torch.Tensor]:
        """Start sending `t` encoded; keep the returned message alive until the wait."""
        wire = self.wire.encode(t)
        self.bytes_sent += wire.numel() * wire.element_size()
        return self.comm.isend(wire, dst, tag), wire

    def _routes(self, count: int) -> list[tuple[int | None, int | None, int]]:
        """(previous stage's device, next stage's device, tag offset) of each of my
        micro-batches: `count` per lane, lane by lane."""
        topo = self.topo
        return [(prev, nxt, (lane % topo.lanes_per_replica) * count + m)
                for lane, (prev, nxt) in zip(topo.my_lanes, topo.peers, strict=True)
                for m in range(count)]

    def _post_recvs(self, routes: list[tuple[int | None, int | None, int]], backward: bool,
                    ) -> list[Posted]:
        """Post every receive of a step now (activations from the previous stage, or the
        gradients from the next); [] on that pipeline end."""
        if any((nxt if backward else prev) is None for prev, nxt, _ in routes):
            return []
        tag = BWD_TAG if backward else FWD_TAG
        return [self.comm.irecv(self._buffer(), nxt if backward else prev, tag + k)
                for prev, nxt, k in routes]

    def train_step(self, inputs: Sequence[torch.Tensor] | None,
                   targets: Sequence[torch.Tensor] | None, num_micro_batches: int,
                   scale_loss: ScaleLoss | None = None) -> float | None:
        """Forward and backward all micro-batches; gradients accumulate in the model.

        `num_micro_batches` is per lane; `inputs` (token ids, every lane's, lane by lane) are
        needed on the first stage, `targets` on the last. The loss of each micro-batch is scaled
        by 1/(my micro-batches x loss_divisor), so the accumulated gradient is that of the mean
        loss over the step's batch, and `scale_loss` (default: none) scales it before
        backward. Returns that mean loss on the last stage, else None.
        """
        topo, routes = self.topo, self._routes(num_micro_batches)
        acts = self._post_recvs(routes, backward=False)
        grads = self._post_recvs(routes, backward=True)
        saved_in, saved_out, losses = self._forward_all(inputs, targets, acts, routes)
        sends = []
        for m in reversed(range(len(routes))):
            out = saved_out[m]
            if self.before_backward is not None:
                self.before_backward(m == 0)
            if topo.is_last:
                (scale_loss(out) if scale_loss else out).backward()
            else:
                out.backward(self._wait(grads[m], f"gradients of micro-batch {m}"))
            if not topo.is_first:
                prev, _, k = routes[m]
                sends.append(self._send(saved_in[m].grad, prev, BWD_TAG + k))
            saved_out[m] = saved_in[m] = None  # free activations as we go
        for w, _ in sends:
            self.comm.wait(w, "sending gradients")
        if topo.is_last:
            return float(torch.stack(losses).mean())
        return None

    def _forward_all(self, inputs: Sequence[torch.Tensor] | None,
                     targets: Sequence[torch.Tensor] | None, acts: list[Posted],
                     routes: list[tuple[int | None, int | None, int]],
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Forward of every micro-batch (`acts`: the posted receives of its activations):
        (inputs kept for backward, outputs or loss/M to call backward on, the last stage's
        per-micro-batch losses)."""
        topo, model = self.topo, self.model
        M = len(routes)
        saved_in: list[torch.Tensor] = []
        saved_out: list[torch.Tensor] = []
        sends, losses = [], []
        for m in range(M):
            if topo.is_first:
                x = inputs[m]
            else:
                x = self._wait(acts[m], f"activations of micro-batch {m}").requires_grad_()
            with self.precision.autocast():
                out = model(x, targets[m]) if topo.is_last else model(x)
            if topo.is_last:
                losses.append(out.detach().float())
                saved_out.append(out.float() / (M * self.loss_divisor))
            else:
                _, nxt, k = routes[m]
                sends.append(self._send(out, nxt, FWD_TAG + k))
                saved_out.append(out)
            saved_in.append(x)
        for w, _ in sends:
            self.comm.wait(w, "sending activations")
        return saved_in, saved_out, losses

    @torch.no_grad()
    def eval_loss(self, inputs: Sequence[torch.Tensor] | None,
                  targets: Sequence[torch.Tensor] | None, num_micro_batches: int) -> float | None:
        """Forward-only mean loss over the micro-batches (returned on the last stage)."""
        topo, model = self.topo, self.model
        routes = self._routes(num_micro_batches)
        losses, sends = [], []  # sends hold the sent tensors alive until their wait
        for m, (prev, nxt, k) in enumerate(routes):
            if topo.is_first:
                x = inputs[m]
            else:
                x = self.wire.decode(self.comm.recv(self._buffer(), prev, FWD_TAG + k,
                                                    "eval activations"), self.act_shape)
            with self.precision.autocast():
                out = model(x, targets[m]) if topo.is_last else model(x)
            if topo.is_last:
                losses.append(out.float())
            else:
                sends.append(self._send(out, nxt, FWD_TAG + k))
        for w, _ in sends:
            self.comm.wait(w, "sending eval activations")
        return float(torch.stack(losses).mean()) if topo.is_last else None
