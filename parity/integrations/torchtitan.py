"""torchtitan config functions with the attention backend chosen, for sweeps' FLASH axis.

torchtitan has no command-line switch for the attention backend: the config function picks it
through ``model_registry(flavor, attn_backend=...)`` (``flex`` by default, ``flex_flash`` =
FlexAttention with the FLASH backend, SM90+). torchtitan's ``--module`` accepts a fully
qualified module, so a sweep selects one of these with::

    --module parity.integrations.torchtitan --config graph_trainer_llama3_8b_flex_flash

Each function is torchtitan's own config function with only ``model_spec`` replaced (what
torchtitan's ``graph_trainer_deepseek_v3_16b_sdpa`` does). Imports torchtitan (lazily, per
function): never imported by parity itself. Checked against torchtitan 0.3.0
(docs/torchtitan.md).
"""

from __future__ import annotations

import importlib

__all__ = ["BACKENDS", "CONFIGS"]

BACKENDS = ("flex", "flex_flash")

# name -> (module of torchtitan's config function, its name, module of model_registry, flavor)
_BASES = {
    "llama3_8b": ("torchtitan.models.llama3.config_registry", "llama3_8b",
                  "torchtitan.models.llama3", "8B"),
    "graph_trainer_llama3_8b": ("torchtitan.experiments.graph_trainer.llama3.config_registry",
                                "graph_trainer_llama3_8b",
                                "torchtitan.experiments.graph_trainer.llama3", "8B"),
    "deepseek_v3_16b": ("torchtitan.models.deepseek_v3.config_registry", "deepseek_v3_16b",
                        "torchtitan.models.deepseek_v3", "16B"),
    "graph_trainer_deepseek_v3_16b": (
        "torchtitan.experiments.graph_trainer.deepseek_v3.config_registry",
        "graph_trainer_deepseek_v3_16b", "torchtitan.experiments.graph_trainer.deepseek_v3",
        "16B"),
}


def _make(base: str, backend: str):
    config_module, config_name, registry_module, flavor = _BASES[base]

    def config_fn():
        config = getattr(importlib.import_module(config_module), config_name)()
        registry = importlib.import_module(registry_module).model_registry
        config.model_spec = registry(flavor, attn_backend=backend)
        return config

    config_fn.__name__ = config_fn.__qualname__ = f"{base}_{backend}"
    config_fn.__doc__ = f"torchtitan's {config_name} with attn_backend={backend!r}."
    return config_fn


CONFIGS = {f"{base}_{backend}": _make(base, backend) for base in _BASES for backend in BACKENDS}
globals().update(CONFIGS)
__all__ += list(CONFIGS)
