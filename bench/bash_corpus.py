"""The `shell` tool against bash itself on a third-party corpus of bash spec cases: the Oils
project's spec tests (github.com/oils-for-unix/oils, ``spec/*.test.sh``), which are not in
this repository.

Each case's code runs twice in the same image, in a directory of its own: through `shell`
(the official MCP client, a session of its own, against `sbx up`), and as a script run by
a fresh bash 5.2 (``bash FILE </dev/null 2>&1``, in reference sessions of its own). Output (stdout
and stderr as one stream) and exit status must be the same. A case that differs is
skipped when bash does not run the script to its end (``exit`` at the top level, ``set -e``,
a fatal error, a syntax error...; asked in a second run with a last line that says so): the
session's shell goes on after such a call by design, so it cannot end as a script does.
Oils' own expectations are not used: bash is the reference.

Prints how many agree, how many differ (each with a one-line reason class) and how many
were skipped. Figures only; nothing is asserted.

The corpus: ``--corpus DIR`` (a checkout of oils, or its ``spec`` directory), else the
pinned commit's tarball, downloaded once into ``--cache`` (this needs github.com). Only
files whose ``## compare_shells:`` line names bash (any version) are read, minus those about interactive
shells and Oils' own languages; ``--files`` narrows them (globs), ``--every N`` takes every
N-th case, ``--limit`` caps them.

    .venv/bin/python bench/bash_corpus.py --corpus /path/to/oils [--files 'arith*' ...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import fnmatch
import io
import re
import sys
import tarfile
import tempfile
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.agents import start_stack, stop_stack
from tests.e2e import bash_cases
from tests.e2e.agent import Agent

COMMIT = "15de8fd779569e6e3a9f5fcbfc00e7df0ebe0380"
TARBALL = "https://codeload.github.com/oils-for-unix/oils/tar.gz/{commit}"
CACHE = Path.home() / ".cache" / "sbx-bench" / "oils"

EXCLUDED = (
    "ysh-*", "hay*", "ble-*", "interactive*", "prompt*", "builtin-history*", "builtin-completion*",
    "builtin-fc*", "builtin-bind*", "sh-usage*", "*-osh*", "osh-*", "toysh*", "zsh-*", "nix-idioms*",
)  # fmt: skip
"""Interactive shells (prompts, history, completion), Oils' own languages and behaviour,
other shells' idioms, and the shell's command line."""

END = "<<corpus: end of the script>>"
TIMEOUT = 30
WHERE = "/tmp/corpus"
HELPERS = "/tmp/oils-spec"
"""Where the corpus's helper programs (``spec/bin``: argv.py, printenv.py...) go in each
sandbox; ``$REPO_ROOT/spec/bin`` and the ``PATH`` point there, ``$SH`` is bash."""


@dataclass(frozen=True)
class Spec:
    file: str
    name: str
    code: str


def parse(path: Path) -> list[Spec]:
    """The cases of one spec file: each ``#### name`` and its code (the lines before its
    first ``## `` line)."""
    specs, name, code, in_code = [], None, [], False
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("#### "):
            if name is not None:
                specs.append(Spec(path.name, name, "\n".join(code).strip("\n")))
            name, code, in_code = line[5:].strip(), [], True
        elif name is not None and in_code:
            if line.startswith("## "):
                in_code = False
            else:
                code.append(line)
    if name is not None:
        specs.append(Spec(path.name, name, "\n".join(code).strip("\n")))
    return [s for s in specs if s.code]


def corpus(root: Path, patterns: list[str]) -> tuple[list[Spec], Path]:
    spec = root / "spec" if (root / "spec").is_dir() else root
    specs = []
    for path in sorted(spec.glob("*.test.sh")):
        head = path.read_text(errors="replace")[:2000]
        shells = re.search(r"^## compare_shells:(.*)$", head, re.M)
        if not shells or not any(s.startswith("bash") for s in shells.group(1).split()):
            continue
        if any(fnmatch.fnmatch(path.name, p) for p in EXCLUDED):
            continue
        if patterns and not any(fnmatch.fnmatch(path.name, p) for p in patterns):
            continue
        specs.extend(parse(path))
    return specs, spec / "bin"


def download(commit: str, cache: Path) -> Path:
    """The pinned commit's ``spec`` directory, from the cache or from GitHub."""
    root = cache / commit
    if not (root / "spec").is_dir():
        with urllib.request.urlopen(TARBALL.format(commit=commit), timeout=300) as answer:
            data = answer.read()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = [m for m in tar.getmembers() if "/spec/" in m.name and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name.split("/", 1)[1]
            root.mkdir(parents=True, exist_ok=True)
            tar.extractall(root, members=members, filter="data")
    return root


def helpers_command(bin_dir: Path) -> str:
    """A shell command that puts the corpus's helpers in place and sets the variables its
    cases expect (python2 programs run as python3)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(bin_dir.iterdir()) if bin_dir.is_dir() else []:
            if path.is_file():
                data = path.read_bytes().replace(b"#!/usr/bin/env python2", b"#!/usr/bin/env python3")
                info = tarfile.TarInfo(path.name)
                info.size, info.mode = len(data), 0o755
                tar.addfile(info, io.BytesIO(data))
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return (
        f"mkdir -p {HELPERS}/spec/bin && printf %s {encoded} | base64 -d | tar -xz -C {HELPERS}/spec/bin; "
        f"export SH=bash REPO_ROOT={HELPERS} PATH={HELPERS}/spec/bin:$PATH"
    )


def reference_command(i: int, code: str, marked: bool) -> str:
    """The case as a script run by a fresh bash; ``marked``: with a last line that says
    the script reached its end."""
    path = f"/tmp/sbx-ref/{i}/command"
    script = code + (f"\nprintf '\\n%s\\n' '{END}'\n" if marked else "")
    encoded = base64.b64encode(script.encode()).decode()
    return (
        f"mkdir -p {path.rsplit('/', 1)[0]} {WHERE}/{i}/tmp && cd {WHERE}/{i} && "
        f"export TMP={WHERE}/{i}/tmp && "
        f"printf %s {encoded} | base64 -d >| {path} && "
        f"( timeout {TIMEOUT} bash {path} </dev/null 2>&1 | cat; exit ${{PIPESTATUS[0]}} )"
    )


def reference_result(text: str, i: int) -> tuple[str, str]:
    """(output, status) of a reference run."""
    output, _, status = bash_cases.split(text.replace(f"/tmp/sbx-ref/{i}/command", bash_cases.SCRIPT_PATH))
    return output, status


def reason(case: Spec, ours: tuple[str, str], theirs: tuple[str, str]) -> str:
    """A one-line class for a difference."""
    (out, status), (ref, ref_status) = ours, theirs
    if "timed out after" in out:
        return "timed out in the session"
    if any(mark in out and mark not in ref for mark in ("__sbx", "/.sbx/")):
        return "the session's machinery shows"
    if out == ref:
        return f"exit status only ({status} vs bash {ref_status})"

    def messages(text: str) -> str:
        return "\n".join(line for line in text.splitlines() if bash_cases.SCRIPT_PATH not in line)

    if messages(out) == messages(ref):
        return "an error message's text"
    if re.sub(r"\d+", "N", out) == re.sub(r"\d+", "N", ref):
        return "numbers only (process ids, times)"
    if "$0" in case.code or "BASH_SOURCE" in case.code:
        return "$0 / BASH_SOURCE: the call is sourced, not run as a file"
    if re.search(r"\b(trap|EXIT|RETURN)\b", case.code):
        return "traps (EXIT/RETURN at the top level)"
    if re.search(r"\balias\b|expand_aliases", case.code):
        return "aliases"
    if re.search(r"set -x|xtrace|PS4", case.code):
        return "xtrace"
    return "output"


async def run(url: str, key: str, specs: list[Spec], bin_dir: Path, parallel: int) -> list[tuple]:
    setup = helpers_command(bin_dir)
    # One reference session per worker (a session runs one call at a time): taking one
    # is also what bounds the cases run at once.
    references: asyncio.Queue[Agent] = asyncio.Queue()
    for n in range(parallel):
        reference = Agent(url, key, f"corpus-reference-{n}")
        ok, text = await reference.call("shell", command=setup)
        if not ok:
            raise RuntimeError(text)
        references.put_nowait(reference)
    done = [0]

    async def one(i: int, case: Spec) -> tuple:
        reference = await references.get()
        try:
            return await compare(i, case, reference)
        finally:
            references.put_nowait(reference)
            done[0] += 1
            if done[0] % 50 == 0:
                print(f"  {done[0]}/{len(specs)} cases run", flush=True)

    async def compare(i: int, case: Spec, reference: Agent) -> tuple:
        ours = Agent(url, key, f"corpus-{i}")
        try:
            here = f"mkdir -p {WHERE}/{i}/tmp && cd {WHERE}/{i} && export TMP={WHERE}/{i}/tmp"
            ok, text = await ours.call("shell", command=f"{setup}; {here}")
            if not ok:
                return case, "error", text
            _, text = await ours.call("shell", command=case.code, timeout=TIMEOUT)
            out, _, status = bash_cases.split(text)
            _, ref_text = await reference.call(
                "shell", command=reference_command(i, case.code, False), timeout=120
            )
            if (out, status) == reference_result(ref_text, i):
                return case, "agree", ""
            # Different: does bash run the script to its end? (Asked apart: the last line
            # would run the case's traps.)
            _, marked = await reference.call(
                "shell", command=reference_command(i, case.code, True), timeout=120
            )
        except Exception as exc:  # a call that failed outright is reported, not fatal
            return case, "error", f"{type(exc).__name__}: {exc}"
        finally:
            await ours.call("clear_session")
        if any(note in t for t in (ref_text, marked) for note in ("[timed out after", "[a new shell:")):
            return case, "error", "the reference run: " + ref_text[-300:]
        if f"\n{END}\n" not in "\n" + marked.replace("\r", ""):
            return case, "skipped", ""
        theirs = reference_result(ref_text, i)
        return case, "differ", reason(case, (out, status), theirs), (out, status), theirs

    return await asyncio.gather(*(one(i, c) for i, c in enumerate(specs)))


def report(results: list[tuple], verbose: bool) -> None:
    counts = Counter(r[1] for r in results)
    print(f"\nbash corpus (oils spec tests @ {COMMIT[:10]}): {len(results)} cases")
    print(f"  agree with bash: {counts['agree']}")
    print(f"  differ:          {counts['differ']}")
    print(
        f"  skipped (differ, and bash ends the script early: exit, set -e, fatal errors): {counts['skipped']}"
    )
    if counts["error"]:
        print(f"  calls that failed: {counts['error']}")
    classes = Counter(r[2] for r in results if r[1] == "differ")
    if classes:
        print("\ndifferences by reason:")
        for why, n in classes.most_common():
            print(f"  {n:4}  {why}")
        print("\ndiffering cases:")
    for r in results:
        if r[1] == "differ":
            case = r[0]
            print(f"  {case.file} #### {case.name}: {r[2]}")
            if verbose:
                print(f"      shell: {r[3]!r}\n      bash:  {r[4]!r}")
        elif r[1] == "error":
            print(f"  {r[0].file} #### {r[0].name}: call failed: {r[2][:200]}")


async def main(args: argparse.Namespace) -> None:
    root = args.corpus or download(args.commit, args.cache)
    specs, bin_dir = corpus(root, args.files)
    specs = specs[:: args.every]
    specs = specs[: args.limit] if args.limit else specs
    if not specs:
        raise SystemExit(f"no cases found under {root}")
    print(f"{len(specs)} cases from {len({s.file for s in specs})} files")
    state = Path(tempfile.mkdtemp(prefix="sbx-bench-corpus-")) / "state"
    proc, base = start_stack(state, pool=args.parallel + 2)
    try:
        key = (state / "api-key").read_text().strip()
        results = await run(base, key, specs, bin_dir, args.parallel)
    finally:
        stop_stack(proc, state)
    report(results, args.verbose)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, help="an oils checkout or its spec directory")
    parser.add_argument("--commit", default=COMMIT, help="the oils commit to download (without --corpus)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--files", nargs="*", default=[], help="spec file globs, e.g. 'arith*'")
    parser.add_argument("--every", type=int, default=1, help="take every n-th case (a spread over all files)")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=6)
    parser.add_argument("--verbose", action="store_true", help="print both outputs of each difference")
    asyncio.run(main(parser.parse_args()))
