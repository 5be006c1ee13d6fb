"""The runnable `serve.sh` of a server export: the exporter's argv with its machine-bound values made parameters.

An exporter's argv is the exact command tuner launches (or would launch) with the values of the machine the
export was made on: binary names, model paths, the files the preparation steps write, memory sizes resolved there.
`serve_script` writes that argv as a bash script in which each such value is an environment variable (a `Param`)
whose default is the value itself (or, for files the script makes, a path next to the script), checked before
the server starts; `--host`/`--port` are explicit (loopback by default) and an API key is read from the
environment where the engine supports one. Run with every parameter set to the measured value, the script
executes the exporter's argv plus `--host H --port P`, which is what tuner's server engines launch.

Pure: text in, text out.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath

from tuner.config import TrialConfig
from tuner.export.common import Context, Note, comment, header_lines

BIN, FILE, DIR, REF, OUTPUT, VALUE = "bin", "file", "dir", "ref", "output", "value"
LOOPBACK = "127.0.0.1"
DIGEST_FILE = "model.safetensors"  # what a checkpoint directory's sha256 is taken over


@dataclass(frozen=True)
class Param:
    """One value of the argv the user sets from the environment.

    kind: bin (a command's first word: found on PATH unless set), file / dir (must exist; `sha256` checked when
    given: the file's, or a directory's model.safetensors), ref (a name the engine resolves, e.g. a Hugging Face
    repository: not checked), output (a file or directory a preparation step
    writes, then the server reads; default next to the script), value (the token after `flag` in argv)."""

    name: str
    value: str  # the literal in argv / prepare it stands for
    doc: str
    kind: str = FILE
    sha256: str | None = None
    flag: str | None = None  # the flag whose argument this is (VALUE: always; others: in the server's argv)

    def default(self) -> str:
        """The default as a shell word: outputs go next to the script, everything else is the literal."""
        if self.kind == OUTPUT:
            return '"${OUT_DIR}"/' + shlex.quote(PurePath(self.value).name)
        if self.kind in (FILE, DIR) and not PurePath(self.value).is_absolute() and not self.value.startswith("~"):
            return '"${HERE}"/' + shlex.quote(self.value)  # a bare name: next to the script, not the caller's cwd
        return shlex.quote(self.value)


@dataclass(frozen=True)
class Serving:
    """How the target's server takes its address and API key."""

    port: int
    host_flag: str = "--host"
    port_flag: str = "--port"
    api_key_env: str | None = None  # the engine reads the key from this variable (kept off the command line)
    api_key_flag: str | None = None  # else it is passed with this flag
    api_key_why: str = ""  # the upstream source that says so


def _dq(text: str) -> str:
    """`text` safe inside a double-quoted shell word."""
    return "".join("\\" + ch if ch in '"\\$`' else ch for ch in text)


def _ranked(params: Sequence[Param], prefer: str | None) -> list[Param]:
    """Parameters in the order a literal is matched: those named with `prefer` (the command's own, e.g. DRAFT for
    the draft's preparation) first, then later ones first (a draft named like its model is the draft where both
    could match inside a longer word)."""
    ranked = list(reversed(params))
    return sorted(ranked, key=lambda p: not (prefer and p.name.startswith(prefer)))


def shell_word(token: str, params: Sequence[Param], first: bool = False, part: str | None = None,
               prefer: str | None = None) -> str:
    """`token` as a shell word with every parameter's literal replaced by its variable.

    A whole-token match becomes "${NAME}"; a literal inside a longer token (a path in a JSON argument or in
    Python code) is replaced inside a double-quoted word. `part` names an OUTPUT being written by this command:
    it is written to NAME.part first (renamed into place after)."""
    ranked = _ranked(params, prefer)
    for p in ranked if prefer else params:
        if p.kind == VALUE:
            continue
        if p.kind == BIN and not first:
            continue
        if token == p.value:
            return f'"${{{p.name}}}{".part" if p.name == part else ""}"'
    subs = sorted((p for p in ranked if p.kind in (FILE, DIR, REF, OUTPUT) and len(p.value) >= 6 and p.value in token),
                  key=lambda p: -len(p.value))
    if not subs:
        return shlex.quote(token)
    out, i = "", 0
    while i < len(token):
        hit = next((p for p in subs if token.startswith(p.value, i)), None)
        if hit:
            out += f'${{{hit.name}}}{".part" if hit.name == part else ""}'
            i += len(hit.value)
        else:
            out += _dq(token[i])
            i += 1
    return f'"{out}"'


def argv_words(argv: Sequence[str], params: Sequence[Param]) -> list[str]:
    """The server's argv as shell words: a parameter with a `flag` replaces that flag's argument, others their
    literal wherever it appears."""
    words = []
    for i, tok in enumerate(argv):
        prev = argv[i - 1] if i else None
        hit = next((p for p in params if p.flag and p.flag == prev and p.value == tok), None)
        words.append(f'"${{{hit.name}}}"' if hit else shell_word(tok, params, first=i == 0))
    return words


def _lines(words: list[str]) -> str:
    """Words as one command, one option per continued line."""
    out, cur = [], [words[0]]
    for w in words[1:]:
        if w.startswith("-") and not w.startswith('"'):
            out.append(" ".join(cur))
            cur = [w]
        else:
            cur.append(w)
    out.append(" ".join(cur))
    return " \\\n  ".join(out)


def _produced(cmd: Sequence[str], params: Sequence[Param], seen: set[str]) -> Param | None:
    """The OUTPUT a preparation command makes: the first one it names that no earlier command named."""
    for p in params:
        if p.kind == OUTPUT and p.name not in seen and any(p.value in tok for tok in cmd):
            return p
    return None


def _sha_check(p: Param) -> str:
    return (f'{p.name}_SHA256="${{{p.name}_SHA256-{p.sha256}}}"\n'
            f'if [ -n "${p.name}_SHA256" ] && [ "$(sha256_of "${p.name}")" != "${p.name}_SHA256" ]; '
            f'then fail "{p.name}=${p.name} is not the measured file (sha256 differs from '
            f'${p.name}_SHA256): set {p.name}_SHA256= to serve it anyway"; fi\n')


def serve_script(header: str, argv: Sequence[str], serving: Serving, params: Sequence[Param] = (),
                 prepare: Sequence[Sequence[str]] = (), env: Mapping[str, str] | None = None,
                 env_docs: Mapping[str, str] | None = None, derive: Mapping[str, str] | None = None) -> str:
    """The bash script (see the module docstring). `header` is the comment block (already `# `-prefixed);
    `derive` holds variables the script computes where it runs (a shell expression each) unless set."""
    name = "serve.sh"
    doc = ["", "Parameters (environment variables; the default follows `=`):"]
    for p in params:
        default = p.default().replace('"${OUT_DIR}"/', "$OUT_DIR/").replace('"${HERE}"/', "<this script's dir>/")
        doc.append(f"  {p.name}={default}")
        doc.append(f"      {p.doc}" + (f" (measured file's sha256 {p.sha256}, checked; {p.name}_SHA256= skips the "
                                         "check)" if p.sha256 else ""))
    for k, v in {**(env or {}), **(derive or {})}.items():
        doc.append(f"  {k}={shlex.quote(v) if k in (env or {}) else '<computed here>'}")
        if env_docs and env_docs.get(k):
            doc.append(f"      {env_docs[k]}" if k in (env or {}) else f"      sized on this machine: {v}")
    doc.append(f"  HOST={LOOPBACK}  PORT={serving.port}")
    doc.append("      where the server listens: loopback only by default (HOST=0.0.0.0 for every interface)")
    if serving.api_key_env or serving.api_key_flag:
        how = (f"given to the server as ${serving.api_key_env}, not on its command line"
               if serving.api_key_env else f"passed as {serving.api_key_flag}")
        doc.append("  API_KEY (unset)")
        doc.append(f"      when set, clients must send `Authorization: Bearer $API_KEY`; {how}"
                   + (f" ({serving.api_key_why})" if serving.api_key_why else ""))
    else:
        doc.append("  (this server has no API key option: keep HOST on loopback or put a proxy in front)")
    if any(p.kind == OUTPUT for p in params):
        doc.append("  OUT_DIR=<this script's dir>")
        doc.append("      where the preparation steps write the files the server then reads")
    text = "#!/usr/bin/env bash\n" + header + "".join(f"# {line}".rstrip() + "\n" for line in doc)
    text += "set -euo pipefail\n"
    text += 'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
    if any(p.kind == OUTPUT for p in params):
        text += 'OUT_DIR="${OUT_DIR:-$HERE}"\n'
    for p in params:
        text += f'{p.name}="${{{p.name}:-{p.default()}}}"\n'
    text += f'HOST="${{HOST:-{LOOPBACK}}}"\nPORT="${{PORT:-{serving.port}}}"\n'
    text += ("fail() { echo \"" + name + ": $*\" >&2; exit 2; }\n"
             "sha256_of() { if [ -d \"$1\" ]; then sha256sum \"$1/" + DIGEST_FILE + "\"; else sha256sum \"$1\"; "
             "fi | cut -d' ' -f1; }\n")
    for p in params:
        if p.kind == BIN:
            text += (f'command -v "${p.name}" >/dev/null || fail "{p.name}=${p.name} not found: expected '
                     f'{_dq(p.doc)} on PATH or {p.name}=/path/to/it"\n')
        elif p.kind in (FILE, DIR):
            test = "-d" if p.kind == DIR else "-f"
            text += (f'[ {test} "${p.name}" ] || fail "{p.name}=${p.name} is not a '
                     f'{"directory" if p.kind == DIR else "file"}: expected {_dq(p.doc)}"\n')
            if p.sha256:
                text += _sha_check(p)
    seen: set[str] = set()
    for cmd in prepare:
        out = _produced(cmd, params, seen)
        prefer = out.name.split("_")[0] if out else None
        words = [shell_word(t, params, first=i == 0, part=out.name if out else None, prefer=prefer)
                 for i, t in enumerate(cmd)]
        if out is None:
            text += " ".join(words) + "\n"
            continue
        seen.add(out.name)
        text += (f'if [ ! -e "${out.name}" ]; then\n  rm -rf "${out.name}.part"\n  ' + " ".join(words)
                 + f'\n  mv "${out.name}.part" "${out.name}"\nfi\n')
        if out.sha256:
            text += _sha_check(out)
    for k, v in (env or {}).items():
        text += f'export {k}="${{{k}:-{v}}}"\n' if shlex.quote(v) == v else f"export {k}={shlex.quote(v)}\n"
    for k, v in (derive or {}).items():
        text += f'export {k}="${{{k}:-{v}}}"\n'
    if serving.api_key_env:
        text += f'if [ -n "${{API_KEY:-}}" ]; then export {serving.api_key_env}="$API_KEY"; fi\n'
    words = argv_words(argv, params) + [serving.host_flag, '"$HOST"', serving.port_flag, '"$PORT"']
    if serving.api_key_flag:
        words.append(f'${{API_KEY:+{serving.api_key_flag} "$API_KEY"}}')
    return text + "exec " + _lines(words) + "\n"


def export_script(engine: str, config: TrialConfig, ctx: Context, notes: list[Note], argv: Sequence[str],
                  serving: Serving, params: Sequence[Param] = (), prepare: Sequence[Sequence[str]] = (),
                  env: Mapping[str, str] | None = None, env_docs: Mapping[str, str] | None = None,
                  derive: Mapping[str, str] | None = None) -> str:
    """serve.sh for an export: the comment block every file starts with, then `serve_script`."""
    return serve_script(comment(header_lines(engine, config, ctx, notes)), argv, serving, params, prepare, env,
                        env_docs, derive)


def is_local(ref: str) -> bool:
    """A model reference that names a path (checked by the script) rather than a repository (resolved by the
    engine)."""
    return ref.startswith(("/", "./", "../", "~"))


def model_params(ctx: Context, model: str, prepare: Sequence[Sequence[str]], quant: str,
                 draft: str | None) -> list[Param]:
    """MODEL (and DRAFT) for engines that load a checkpoint directory or a Hugging Face repository; with a
    pre-quantizing step (bitsandbytes 8-bit / FP4), MODEL is its source and QUANTIZED what it writes."""
    what = "the model: a checkpoint directory or a Hugging Face repository"
    params = []
    if prepare:  # bnb_prequantize: python -c "...from_pretrained(\"SRC\"..."
        src = prepare[0][-1].split("from_pretrained(", 1)[1].split('"')[1]
        params.append(Param("MODEL", src, what, DIR if is_local(src) else REF, ctx.digests.get("model")))
        params.append(Param("QUANTIZED", model, f"the model quantized as tuner loads {quant}, made from MODEL by "
                                                "the step below when missing", OUTPUT))
    else:
        params.append(Param("MODEL", model, what, DIR if is_local(model) else REF, ctx.digests.get("model")))
    if draft:
        params.append(Param("DRAFT", draft, "the draft model: a checkpoint directory or a Hugging Face repository",
                            DIR if is_local(draft) else REF, ctx.digests.get("draft")))
    return params
