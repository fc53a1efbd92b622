"""The side-by-side benchmark: vLLM's own OpenAI server against the gateway (bench/README.md).

Run its scripts as modules from the repository root (``python -m bench.run``). It talks to
the servers over HTTP only and never imports ``gateway``.
"""
