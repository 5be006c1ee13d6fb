"""Quality: one scorer per engine (transformers, llamacpp, vllm, endpoint) over one shared template (common), the
KL-divergence screen, the offline benchmark data, the paired statistics and the gate (gate)."""
