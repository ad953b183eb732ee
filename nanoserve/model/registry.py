"""Week 19: which model class runs a checkpoint, by the architecture its config names.

`config.json`'s "architectures" (or a GGUF's `general.architecture`, which week 13's converter
turns into one) picks the family. Four of them are Llama with options on its layers, read from
the config by `ModelConfig` (`nanoserve/model/config.py`); Gemma 3 has its own blocks, and the
mixtures of experts (week 24, `nanoserve/model/moe.py`) their own MLP. Adding a
family is a config reader, perhaps a module of its own, and one line here: nothing above the
model layer knows which family runs.
"""

from __future__ import annotations

from nanoserve.model.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from nanoserve.model.gemma import Gemma3
from nanoserve.model.llama import Llama
from nanoserve.model.moe import Mixtral, MoEModel

MODEL_CLASSES: dict[str, type[Llama]] = {
    "LlamaForCausalLM": Llama,
    "MistralForCausalLM": Llama,  # a sliding window on every layer
    "Qwen2ForCausalLM": Llama,  # biases on q, k and v
    "Qwen3ForCausalLM": Llama,  # q/k norms
    "Gemma3ForCausalLM": Gemma3,
    "MixtralForCausalLM": Mixtral,  # week 24: Mistral's attention, 8 experts, top-2 renormalized
    "Qwen2MoeForCausalLM": MoEModel,  # week 24: Qwen2's attention, many small experts, a shared one
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES), "every architecture the config reads has a class"


def model_class(config: ModelConfig) -> type[Llama]:
    if config.architecture not in MODEL_CLASSES:
        raise ConfigError(f"unsupported architecture {config.architecture!r}: nanoserve runs "
                          f"{', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[config.architecture]


def build_model(config: ModelConfig) -> Llama:
    """The family's model for `config`, its parameters uninitialized (on whatever device is current)."""
    return model_class(config)(config)
