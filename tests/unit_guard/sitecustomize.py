"""The unit tier's guard: records a model load, an engine / browser / database process started, in this process and
(through PYTHONPATH and $TUNER_UNIT_GUARD) in every Python process it starts (`python -m tuner ...`, tuner.child).

tests/conftest.py installs it around each test marked `unit` and fails the test when anything was recorded: a test
that needs a model, a server, Chromium or PostgreSQL belongs to another tier (conftest's tables). Recording, not
raising: the code under test may catch an exception (a failed trial is data), a line in the log it cannot hide.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV = "TUNER_UNIT_GUARD"  # the file each guarded process appends its findings to
BINARIES = {"llama-server": "a llama-server", "llama-perplexity": "llama-perplexity", "llama-quantize":
            "llama-quantize", "chromium": "Chromium", "chrome": "Chromium", "headless_shell": "Chromium",
            "postgres": "PostgreSQL", "initdb": "PostgreSQL", "pg_ctl": "PostgreSQL", "streamlit": "a Streamlit server"}
MODULES = {"vllm": "a vLLM server", "streamlit": "a Streamlit server"}
_log: str | None = None


def record(what: str) -> None:
    if _log:
        with open(_log, "a") as f:
            f.write(f"{what} (pid {os.getpid()})\n")


def engine_of(argv) -> str | None:
    """What a process is, from its command line, when it is one the unit tier must not start (None otherwise)."""
    argv = [os.fsdecode(a) for a in ([argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv or []))]
    if not argv or not argv[0].strip():
        return None
    exe = os.path.basename(argv[0].split()[0])
    if exe in BINARIES:
        return BINARIES[exe]
    if "playwright" in " ".join(argv):
        return "Chromium (Playwright's driver)"
    if exe.startswith("python") and "-m" in argv[:-1]:
        return MODULES.get(argv[argv.index("-m") + 1].split(".")[0])
    if exe.startswith(("python", "sh", "bash")) and len(argv) > 1:  # a script: python .../bin/streamlit run ...
        return BINARIES.get(os.path.basename(argv[1]))
    return None


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen" and _log:
        what = engine_of(args[1] if args[1] is not None else args[0])
        if what:
            record(f"started {what}")


def _guard_from_pretrained(cls_owner: type, kind: str) -> None:
    """Record every `from_pretrained` of this transformers base class (models, tokenizers) before it runs."""
    original = cls_owner.__dict__["from_pretrained"].__func__

    def from_pretrained(cls, *args, **kwargs):
        record(f"loaded a {kind} with {cls.__name__}.from_pretrained({str(args[0]) if args else ''!s})")
        return original(cls, *args, **kwargs)

    cls_owner.from_pretrained = classmethod(from_pretrained)


PATCHES = {
    "transformers.modeling_utils": lambda m: _guard_from_pretrained(m.PreTrainedModel, "model"),
    "transformers.tokenization_utils_base": lambda m: _guard_from_pretrained(m.PreTrainedTokenizerBase, "tokenizer"),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches the transformers classes as they are imported (this guard never imports them itself)."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


def watch_descendants(stop, interval_s: float = 0.2) -> None:
    """Until `stop` (a threading.Event) is set: record every new descendant of this process that is an engine, a
    browser or a database, whoever started it (a shell script's llama-server is not seen by the audit hook); those
    running when the watch starts were started before the test."""
    import psutil

    me = psutil.Process()
    try:  # what runs already was started before this test (a session's browser driver): not this test's
        seen: set[int] = {c.pid for c in me.children(recursive=True)}
    except psutil.Error:
        seen = set()
    while not stop.wait(interval_s):
        try:
            children = me.children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            if child.pid in seen:
                continue
            seen.add(child.pid)
            try:
                what = engine_of(child.cmdline()) or BINARIES.get(child.name())
            except psutil.Error:
                continue
            if what:
                record(f"started {what}, seen running")


_installed = False


def install(log: str | None) -> None:
    """Guard this process from now on, findings appended to `log` (None: stop recording)."""
    global _log, _installed
    _log = log
    if _installed:
        return
    _installed = True
    sys.addaudithook(_audit)
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchAfterImport())


if os.environ.get(ENV):
    install(os.environ[ENV])
    if engine_of(sys.orig_argv):  # this process is itself one (python -m vllm... from a script)
        record(f"started {engine_of(sys.orig_argv)}")
