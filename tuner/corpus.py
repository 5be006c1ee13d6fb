"""Real English text available offline on every machine: the Python reference manual shipped with CPython
(`pydoc_data.topics`). Used for benchmark prompts and GPTQ calibration; never random token ids."""

from __future__ import annotations

import re
from functools import lru_cache


@lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    """Prose paragraphs (code blocks and short lines dropped), in a fixed order."""
    from pydoc_data.topics import topics

    out: list[str] = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            lines = [ln.strip() for ln in block.splitlines()]
            if not lines or any(ln.startswith((">>>", "...", "|", "+", "*", "=")) for ln in lines[:1]):
                continue
            text = " ".join(ln for ln in lines if ln)
            letters = sum(c.isalpha() or c == " " for c in text)
            if len(text) >= 200 and letters / len(text) > 0.85:
                out.append(text)
    return tuple(out)
