"""OpenAI-compatible gateway: one vLLM engine, many LoRA adapters, routed per request."""

__version__ = "0.1.0"
