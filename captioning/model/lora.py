"""LoRA adapters of a keras-hub backbone (``Backbone.enable_lora``: Keras' ``Dense`` and ``EinsumDense`` with
``lora_kernel_a`` and ``lora_kernel_b``), merged into the weights they adapt for an export.

A LoRA-adapted layer computes with ``kernel + (alpha / rank) · a @ b`` (Keras' ``kernel`` property); merging
writes that sum into the layer's own kernel, turns LoRA off and deletes the two adapters, so the layer computes
with one kernel as before fine-tuning and a SavedModel holds no adapter (``captioning export --merge-lora``). The
adapters alone are keras-hub's ``Backbone.save_lora_weights`` file (``captioning export --format lora``), which
``Backbone.load_lora_weights`` reads into the preset the model started from.
"""

from __future__ import annotations

# what a refusal of a model without adapters says trains them
TRAINED_BY = ("they are trained by model.decoder: vlm with model.vlm_trainable: lora, or prefix_lm with "
              "model.lm_lora_rank")


def adapted_layers(root) -> list:
    """The layers of ``root`` (a Keras model or layer) whose LoRA is on, in keras-hub's order (``_flatten_layers``,
    which also reaches the layers keras-hub keeps in plain lists)."""
    return [layer for layer in root._flatten_layers(include_self=False) if getattr(layer, "lora_enabled", False)]


def merge(root) -> int:
    """Each LoRA-adapted layer of ``root`` with its adapters folded into its kernel (module docstring); the number
    of layers merged."""
    layers = adapted_layers(root)
    for layer in layers:
        merged = layer.kernel  # Keras' sum: the kernel plus the scaled product of the adapters
        layer.lora_enabled = False
        layer._kernel.assign(merged)  # the layer's own kernel (Keras' attribute behind its kernel property)
        del layer.lora_kernel_a  # Keras untracks a deleted variable: no checkpoint or SavedModel holds it
        del layer.lora_kernel_b
    return len(layers)
