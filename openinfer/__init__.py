"""openinfer: an open LLM inference engine."""

from openinfer.llm import LLM
from openinfer.outputs import CompletionOutput, Logprob, RequestOutput
from openinfer.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
