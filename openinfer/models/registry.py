"""Maps a checkpoint's `architectures[0]` to the class that implements it."""

from __future__ import annotations

from openinfer.models.base import CausalLM
from openinfer.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from openinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from openinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
from openinfer.models.gemma2 import Gemma2ForCausalLM
from openinfer.models.gpt_oss import GptOssForCausalLM
from openinfer.models.llama import LlamaForCausalLM
from openinfer.models.mixtral import MixtralForCausalLM
from openinfer.models.qwen2 import Qwen2ForCausalLM
from openinfer.models.qwen3 import Qwen3ForCausalLM
from openinfer.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama with a sliding window on every layer
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "DeepseekV41ForCausalLM": DeepseekV41ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {supported}"
        ) from None
