"""Loss-aware statistics: the calibration sums seen through the gradient of the language-model loss.

With ``d_x = dL / dY_x``, removing experts ``U`` changes the loss by about ``-sum_{e in U} a_e + 1/2 u^T G u``,
``a_e(x) = <d_x, V_e(x)>``; ``d_x`` comes from one ``torch.autograd.grad`` to the routed outputs (no weight
gradient), run from a forward hook on the model. The four sums and the cost: docs/methods.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ...adapters import MoELayer
from ...collect.extensions import StatisticsExtension, register_statistics
from .terms import next_token_loss, routed_atoms

if TYPE_CHECKING:
    from ...collect.layerwise import LayerMajor
    from .metric import LossStatsMetric

LOSS_TENSORS = ("gram_grad", "gram_loss", "gram_fisher", "loss_first_order")
"""Optional :class:`~ompmoe.engine.collect.statistics.LayerStats` fields filled by loss-aware collection."""


class LossAwareError(ValueError):
    """Loss-aware statistics cannot be collected from this forward (no gradient path, no token ids)."""


NEEDS_INPUT_IDS = ("Loss-aware statistics need input_ids (the next-token loss is computed on them); this batch passes "
                   "only inputs_embeds. Pass token ids, or collect without loss_aware.")


class LossGradientRecorder:
    """Hooks that turn each instrumented forward into loss-aware sums with one backward to the routed outputs:
    :meth:`callback` gets each layer's routed pairs, an ``experts`` hook its output tensor, and a model hook
    computes :func:`next_token_loss` and ``d_x`` for every layer at once."""

    def __init__(self, model: nn.Module, layers: list[MoELayer], metric: LossStatsMetric,
                 token_weight: Callable[[], torch.Tensor | None], retain_graph: bool = True) -> None:
        self.model = model
        self.layers = layers
        self.metric = metric
        self.token_weight = token_weight
        self.retain_graph = retain_graph
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._input_ids: torch.Tensor | None = None
        self._in_backward = False
        self._handles: list[Any] = []

    def attach(self) -> None:
        if self._handles:
            return
        self._handles.append(self.model.get_input_embeddings().register_forward_hook(self._embedding_hook))
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.experts.register_forward_hook(partial(self._experts_hook, index)))
        self._handles.append(self.model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._model_hook))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._clear()

    def _clear(self) -> None:
        self._pending, self._outputs, self._input_ids = {}, {}, None

    def callback(self, update: Callable[..., None]) -> Callable[..., None]:
        """``update`` (the statistics callback), then keep the layer's routed atoms ``g F`` (``atoms`` as the block
        summed them, else formed here); silent during the backward (checkpoint recomputes are not counted twice)."""

        def chained(index: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, outputs: torch.Tensor,
                    atoms: torch.Tensor | None = None) -> None:
            if self._in_backward:
                return
            update(index, top_k_index, top_k_weights, outputs, atoms)
            self._pending[index] = routed_atoms(top_k_index, top_k_weights, outputs, atoms)

        return chained

    def _embedding_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        # Frozen weights: make the embeddings a leaf that requires grad so d_x has a path.
        if torch.is_grad_enabled() and not self._in_backward and not output.requires_grad:
            return output.detach().requires_grad_(True)
        return None

    def _experts_hook(self, index: int, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if not self._in_backward and index in self._pending:
            self._outputs[index] = output

    def _model_pre_hook(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self._in_backward:
            return
        self._clear()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise LossAwareError(NEEDS_INPUT_IDS)
        self._input_ids = ids

    def _model_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._in_backward:
            return
        try:
            self._backward(output)
        finally:
            self._clear()

    def _backward(self, output: Any) -> None:
        indices = sorted(self._outputs)
        if not indices:
            return
        tensors = [self._outputs[i] for i in indices]
        if not all(t.requires_grad for t in tensors):
            raise LossAwareError("loss_aware=True needs the forward to run with gradients enabled (the routed "
                                 "outputs have no gradient path): do not wrap the forward in torch.no_grad() "
                                 "(CalibrationModule switches it on when the callback asks), and use non-reentrant "
                                 "activation checkpointing (use_reentrant=False).")
        logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", None)
        if logits is None:
            logits = output[0] if isinstance(output, (tuple, list)) else output
        weight = self.token_weight()
        assert self._input_ids is not None
        loss = next_token_loss(logits, self._input_ids, weight)
        self._in_backward = True
        try:
            grads = torch.autograd.grad(loss, tensors, retain_graph=self.retain_graph, materialize_grads=True)
        finally:
            self._in_backward = False
        self.metric.loss_sum += loss.detach().to(self.metric.loss_sum.device, torch.float64)
        for index, grad in zip(indices, grads):
            top_k_index, atoms = self._pending[index]
            self.metric.update(index, top_k_index, atoms, grad.reshape(atoms.shape[0], -1), weight)


@register_statistics
class LossAwareStatistics(StatisticsExtension):
    """The loss-aware sums: one backward of the next-token loss per batch to the MoE blocks' routed outputs."""

    name: ClassVar[str] = "loss_aware"
    kind: ClassVar[str] = "loss-aware"
    option: ClassVar[str] = "loss_aware=True"
    prefix: ClassVar[str] = "loss"
    tensors: ClassVar[tuple[str, ...]] = LOSS_TENSORS
    signed: ClassVar[tuple[str, ...]] = ("loss_first_order",)
    needs_gradients: ClassVar[bool] = True

    def __init__(self, model: nn.Module, layers: list[MoELayer],
                 token_weight: Callable[[], torch.Tensor | None]) -> None:
        super().__init__(model, layers, token_weight)
        from .metric import LossStatsMetric  # torchmetrics on the first collection only

        self.metric = LossStatsMetric(layers, LOSS_TENSORS)
        self.recorder = LossGradientRecorder(model, layers, self.metric, token_weight)

    def wrap(self, update: Callable[..., None]) -> Callable[..., None]:
        return self.recorder.callback(update)

    def standalone(self) -> None:
        self.recorder.retain_graph = False  # no training step reuses the graph

    def check_layer_by_layer_inputs(self, batches: list[dict[str, torch.Tensor]]) -> None:
        if any(batch.get("input_ids") is None for batch in batches):
            raise LossAwareError(NEEDS_INPUT_IDS)

    def collect_layer_by_layer(self, passes: LayerMajor, stream: str, token_weights: list[torch.Tensor | None],
                               progress: bool | None = None) -> None:
        """The resident pass's sums by a backward down the layers after the forward sweep (:mod:`.layerwise`)."""
        from .layerwise import collect_loss_layer_by_layer

        collect_loss_layer_by_layer(passes, stream, self.metric, self.layers, token_weights, progress)
