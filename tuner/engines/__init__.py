"""Serving engines behind one small contract (`tuner.engines.base.Engine`), found through one lazy registry
(`tuner.engines.registry`: engine name -> its backend).

An engine that runs in-process (transformers continuous batching, assisted generation) and one driven over the
OpenAI-compatible HTTP API (llama.cpp's server, vLLM, a running endpoint) plug into the same load generator and
metrics.
"""
