"""saguaro: exact speculative speculative decoding (SSD) for Llama-family models."""
from saguaro.config import SpeculativeConfig
from saguaro.engine.sampler import SamplingParams
from saguaro.llm import LLM
from saguaro.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
