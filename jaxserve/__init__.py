"""jaxserve: a JAX/XLA compiled LLM inference engine for TPUs, GPUs and CPUs."""

from jaxserve.engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
