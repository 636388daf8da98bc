"""Loss-aware sums of a model bigger than memory, one decoder layer at a time.

After layer by layer's forward sweep (which kept each layer's input, :meth:`~ompmoe.engine.collect.layerwise.LayerMajor.
keep_inputs`), the next-token loss's gradient at the last layer's output goes down the layers in reverse: each layer is
read again and recomputed from its kept input with gradients on, as activation checkpointing recomputes a layer, and
one ``torch.autograd.grad`` per batch gives the gradient at its MoE blocks' routed outputs (``d_x``) and at its input
(handed to the layer below). With the routed atoms of that recompute, these are the resident pass's sums
(:class:`~.statistics.LossGradientRecorder`): the same products of the same tensors, memory holding one layer's graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...adapters import MoELayer
from ...collect.collector import expose_expert_outputs
from ...collect.layerwise import moe_blocks_by_layer
from .terms import next_token_loss, routed_atoms

if TYPE_CHECKING:
    from ...collect.layerwise import LayerMajor
    from .metric import LossStatsMetric


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


@contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters without gradients meanwhile: the backward computes no weight gradient and the
    forward keeps nothing for one (as the resident pass freezes them)."""
    thawed = [parameter for parameter in module.parameters() if parameter.requires_grad]
    for parameter in thawed:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in thawed:
            parameter.requires_grad_(True)


class _RoutedCapture:
    """One recomputed layer's routed pairs ``(top_k_index, atoms)`` and experts outputs, per MoE block index."""

    def __init__(self, layers: list[MoELayer], blocks: list[int]) -> None:
        self.layers, self.blocks = layers, blocks
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @contextmanager
    def active(self) -> Iterator[None]:
        def pairs(position: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, outputs: torch.Tensor,
                  atoms: torch.Tensor | None = None) -> None:
            self.pairs[self.blocks[position]] = routed_atoms(top_k_index, top_k_weights, outputs, atoms)

        def output(index: int, module: nn.Module, args: Any, result: torch.Tensor) -> None:
            self.outputs[index] = result

        handles = [self.layers[index].experts.register_forward_hook(
            lambda module, args, result, index=index: output(index, module, args, result)) for index in self.blocks]
        try:
            with expose_expert_outputs([self.layers[index] for index in self.blocks], pairs):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def clear(self) -> None:
        self.pairs, self.outputs = {}, {}


def collect_loss_layer_by_layer(passes: LayerMajor, stream: str, metric: LossStatsMetric, layers: list[MoELayer],
                                token_weights: list[torch.Tensor | None], progress: bool | None = None) -> None:
    """Add stream ``stream``'s loss-aware sums to ``metric``, from the top layer down to the lowest MoE block's, after
    the forward sweep (``passes.kept[stream]`` holds the layers' inputs, consumed here)."""
    blocks = moe_blocks_by_layer(passes.prefix, layers)
    lowest, device, hidden_device = min(blocks), passes.device, passes.hidden_device
    weights = [None if weight is None else weight.reshape(-1).to(metric.loss_sum.device, torch.float64)
               for weight in token_weights]
    grads: list[torch.Tensor] = []
    with frozen(passes.model), torch.enable_grad():  # the loss, and its gradient at the last layer's output
        for position, inputs in enumerate(passes.inputs[stream]):
            final = passes.hidden[stream][position].to(device).detach().requires_grad_(True)
            passes.hidden[stream][position] = None  # type: ignore[call-overload]  # its gradient takes its place
            loss = next_token_loss(passes.head_logits(inputs, final), inputs["input_ids"], weights[position])
            (grad,) = torch.autograd.grad(loss, final)
            metric.loss_sum += loss.detach().to(metric.loss_sum.device, torch.float64)
            grads.append(grad.to(hidden_device))
    passes.empty_head()
    state_grads: list[torch.Tensor | None] = [None] * len(grads)  # at the carried state the last carrier handed on
    order = range(len(passes.layers) - 1, lowest - 1, -1)
    with closing(passes.each_layer(progress, "ompmoe loss-aware statistics (layer by layer)", order)) as sweep:
        for index, layer in sweep:
            kept = passes.take_kept(stream, index)
            capture = _RoutedCapture(layers, blocks.get(index, []))
            carries = passes.carried[index] is not None  # takes the state the last carrier handed on, hands its own
            with frozen(layer), capture.active(), torch.enable_grad():
                for position in range(len(kept)):
                    hidden, state = kept[position]
                    kept[position] = None  # type: ignore[call-overload]  # each input freed once used
                    hidden = hidden.to(device).detach().requires_grad_(True)
                    through_state = carries and index > 0 and _differentiable(state)  # Zaya's router state
                    if through_state:
                        state = state.to(device).detach().requires_grad_(True)
                    args, kwargs = passes.call(stream, index, position, hidden, state)
                    output = layer(*args, **kwargs)
                    outputs = [output[0] if isinstance(output, tuple) else output]
                    upstream = [grads[position].to(device)]
                    handed = output[1] if carries and isinstance(output, tuple) else None
                    if _differentiable(handed) and handed.requires_grad and state_grads[position] is not None:
                        outputs.append(handed)
                        upstream.append(state_grads[position].to(device))  # type: ignore[union-attr]
                    below = [hidden, *([state] if through_state else [])] if index > lowest else []
                    wanted = [capture.outputs[block] for block in capture.blocks] + below
                    found = torch.autograd.grad(outputs, wanted, grad_outputs=upstream, materialize_grads=True)
                    for block, grad in zip(capture.blocks, found):
                        top_k_index, atoms = capture.pairs[block]
                        metric.update(block, top_k_index, atoms, grad.reshape(atoms.shape[0], -1), weights[position])
                    if below:
                        found = found[len(capture.blocks):]
                        grads[position] = found[0].to(hidden_device)
                        if carries:  # the state it took came from the carrier below (a layer between passes it on)
                            state_grads[position] = found[1].to(hidden_device) if through_state else None
                    capture.clear()
    passes.kept.pop(stream, None)


__all__ = ["collect_loss_layer_by_layer", "frozen"]
