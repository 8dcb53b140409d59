"""Round 10b: torchtitan's own GraphTrainer debug model on its SDPA attention backend
(``graph_trainer_llama3_debugmodel_sdpa``), cut to two transformer blocks, for
``--module round10b_config --config r10b_llama3_2layers`` (torchtitan imports a fully-qualified
module's config function; tests/trainers is on the launcher's path). Why: inductor's CPU
FlexAttention lowering is inference-only (``torch.compile on CPU only supports inference``), so
jit + inductor on CPU needs SDPA; two blocks keep inductor's C++ compile short on 2 cores while
the graph keeps every kind of bucket (embedding, per-block buckets, norm; lm_head eager)."""

from torchtitan.experiments.graph_trainer.llama3.config_registry import (
    graph_trainer_llama3_debugmodel_sdpa,
)


def r10b_llama3_2layers():
    config = graph_trainer_llama3_debugmodel_sdpa()
    model = config.model_spec.model
    model.layers = model.layers[:2]
    if hasattr(model, "n_layers"):
        model.n_layers = 2
    return config
