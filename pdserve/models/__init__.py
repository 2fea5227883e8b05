"""Model registry: HF `architectures[0]` -> pdserve model class."""

from __future__ import annotations

from pdserve.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {architecture!r}; pdserve supports: {supported}") from None
