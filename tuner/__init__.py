"""tuner: find the fastest way to serve an LLM under a latency target and a quality budget.

Importing this package is cheap: torch, transformers and friends load only when a command needs them.
"""

from __future__ import annotations

__version__ = "0.1.0"

from tuner.config import TrialConfig  # noqa: E402  (pure dataclass, no heavy imports)
from tuner.errors import TunerError  # noqa: E402

__all__ = ["TrialConfig", "TunerError", "__version__"]
