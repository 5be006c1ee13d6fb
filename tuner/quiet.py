"""Library chatter kept off a tuner process's output (the terminal, or a child's log): the one home, used by the
command line and by `tuner.child`."""

from __future__ import annotations


def quiet_libraries() -> None:
    """Keep library chatter (CUDA-only extension load failures on CPU, deprecation notices) off the terminal;
    set TRANSFORMERS_VERBOSITY=info to see it again."""
    import logging
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("torchao", "torch.utils._pytree", "datasets", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
