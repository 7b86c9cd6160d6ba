"""saguaro: exact speculative speculative decoding (SSD) for Llama-family models.

The public names load on first use, so that a process which needs one corner of the package
(the SSD draft worker) does not import the engine with it.
"""
from __future__ import annotations

import importlib

_HOMES = {"LLM": "saguaro.llm", "SamplingParams": "saguaro.engine.sampler", "SpeculativeConfig": "saguaro.config",
          "RequestOutput": "saguaro.outputs", "CompletionOutput": "saguaro.outputs",
          "RequestMetrics": "saguaro.outputs", "StructuredOutputs": "saguaro.engine.structured",
          "TokenLogprobs": "saguaro.engine.logprobs"}

__all__ = list(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'saguaro' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
