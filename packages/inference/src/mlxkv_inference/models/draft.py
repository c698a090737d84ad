"""Draft models for speculative decoding: another local model, or the target's first layers.

A layer-skip draft (self-speculation, as in LayerSkip) runs the target's first `num_layers`
decoder layers, then its final norm and head: no weights are copied, and its tokenizer is the
target's by construction. Its KV for the tokens the target has fed is the target's first layers'
KV, so it starts from a copy of those instead of reading the prompt again (`DraftModel`).
"""

from __future__ import annotations

import copy
from typing import Any

from mlxkv_inference.binding import MlxAutoregressiveBinding


def layer_skip_draft(target: MlxAutoregressiveBinding, num_layers: int) -> MlxAutoregressiveBinding:
    """A binding over `target`'s first `num_layers` layers (sharing their weights)."""
    inner: Any = getattr(target.model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list):
        raise ValueError(f"{target.model_id}: cannot find the decoder layers to build a layer-skip draft from")
    if not 1 <= num_layers < len(layers):
        raise ValueError(f"draft layers={num_layers} is out of range; the model has {len(layers)} layers, allowed: [1, {len(layers) - 1}]")
    # Gemma 3's graph takes its global layers' mask from layer `sliding_window_pattern` (the first
    # global one), whatever the layer count: fewer layers fail at the first draft step.
    pattern = getattr(inner, "sliding_window_pattern", None)
    if isinstance(pattern, int) and not pattern <= num_layers < len(layers):
        raise ValueError(f"draft layers={num_layers}: {target.model_id} reads the mask of its first global layer, "
                         f"layer {pattern}; allowed: [{pattern}, {len(layers) - 1}]")
    truncated_inner = copy.copy(inner)
    truncated_inner.layers = layers[:num_layers]
    truncated = copy.copy(target.model)
    truncated.model = truncated_inner
    for holder in (truncated, truncated_inner):  # graphs that size their caches from their args
        args = getattr(holder, "args", None)
        if args is not None and hasattr(args, "num_hidden_layers"):
            holder.args = copy.copy(args)
            holder.args.num_hidden_layers = num_layers
    config = {**target.config, "num_hidden_layers": num_layers}
    # The layers are the target's own modules, already on the target's kernels: bind them as they
    # are. The target's fingerprint stands for their weights and kernels in the draft's identity
    # (a checkpoint keeps the draft's KV under it).
    draft = MlxAutoregressiveBinding(truncated, target.tokenizer, model_id=f"{target.model_id}#layers:{num_layers}",
                                     config=config, kv_scheme=target.kv_scheme, weights_digest=target.config_fingerprint)
    draft.prefix_of = target
    return draft


def check_draft_tokenizer(target: MlxAutoregressiveBinding, draft: MlxAutoregressiveBinding) -> None:
    """A draft must speak the target's tokens: the same vocabulary (its content hash)."""
    if draft.tokenizer.content_hash() != target.tokenizer.content_hash():
        raise ValueError(f"draft model {draft.model_id} has another tokenizer than {target.model_id}; "
                         "speculation needs the same token ids")
