"""openinfer: an open LLM inference engine."""

from openinfer.huge_pages import request_huge_pages

request_huge_pages()  # before torch allocates anything (see openinfer/huge_pages.py)


from openinfer.llm import LLM
from openinfer.logger import configure_logging
from openinfer.outputs import CompletionOutput, Logprob, RequestOutput
from openinfer.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]

configure_logging()  # openinfer's INFO lines on stderr, as vLLM does (OPENINFER_CONFIGURE_LOGGING=0: off)
