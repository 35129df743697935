"""The code fences of ``README.md`` and ``docs/**/*.md``, parsed, checked and run.

``python -m tools.doc_fences [--root DIR] [--backend B] [--pages P] [--list] [--check] [--run]``; without
``--list``/``--check``/``--run`` it checks and lists. ``tests/test_docs.py`` runs the same jobs
in each backend's tox env.

The convention the pages follow:

* A ```` ```python ```` fence runs in the env of the framework it imports (``torch``,
  ``tensorflow``/``keras``, ``jax``/``flax``/``optax``, ``mxnet``, a ``backends.<name>``
  package or an ``examples.<example>_<name>`` module); a fence importing none of them runs in
  the numpy env. A fence importing two frameworks is an error.
* Each python fence runs on its own: a fresh interpreter, the working directory a new temporary
  one, the repository first on ``PYTHONPATH``. ``<!-- continues -->`` on the line right before
  a fence appends it to the previous python fence of the same page (one script, one namespace);
  the chain runs in the env of its first fence, and a continued fence may import no other
  framework.
* ``<!-- not-runnable: <reason> -->`` right before a fence: not run (python or bash). At most
  :data:`MAX_NOT_RUNNABLE` such fences in all, each with a reason.
* ``<!-- runs-in: <backend> -->`` right before a fence: its env, when the imports do not say
  (also ``keras-jax`` / ``keras-torch``: a Keras fence run under that Keras backend).
* ```` ```text ```` fences hold program output and are not run. ```` ```bash ```` fences hold
  shell commands, checked line by line: ``python -m attention_core ...`` and
  ``python -m examples...`` are run, ``tox`` must name envs of ``tox.ini``, ``pip install``
  must be a command ``.ci/run`` runs, and the few other commands a page may show are checked
  for what they name (see :func:`check_command`).

Marker comments may be stacked directly above a fence, one per line. A failing python fence is
named by its page and line: the chain is one script whose lines map back to the pages, and the
runner rewrites the traceback's lines into ``page:line``.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from attention_core import registry

#: At most this many fences, in all pages, may be marked ``not-runnable``.
MAX_NOT_RUNNABLE = 5

#: Seconds a chain (or a command) may run before it is stopped and counted as failed: a hang,
#: not a slow page. The seq2seq fences, the slowest, train 20 steps (20-40 s each on 2 cores;
#: at 200 steps the torch one took 166 s); under ``pytest -n auto`` they may take twice that.
DEFAULT_TIMEOUT = 600.0

#: Info-string words -> fence kind.
KINDS = {
    "python": "python", "py": "python", "python3": "python",
    "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash",
    "text": "text", "txt": "text", "output": "text",
}

#: Imported top-level modules -> the backend whose env runs the fence (numpy needs no entry).
IMPORT_BACKENDS = {
    **{module: name for name, modules in registry.FRAMEWORKS.items() if name != "numpy"
       for module in modules},
    "optax": "jax",
}

#: Test envs beside the backends' (``tox.ini``) that a ``runs-in`` marker may name: Keras on
#: another framework. Each -> the backend its fences' imports belong to, and its KERAS_BACKEND.
KERAS_ENVS = {"keras-jax": "jax", "keras-torch": "torch"}

#: The marker comments a fence may carry.
MARKERS = ("continues", "not-runnable", "runs-in")

_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<mark>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^<!--\s*(?P<key>[A-Za-z_-]+)\s*(?::(?P<value>.*?))?\s*-->$")
_DOC_PREFIX = "[doc-fence]"
_SCRIPT = "doc_fences_chain.py"


@dataclasses.dataclass(frozen=True)
class Fence:
    """One fenced block of a page.

    Attributes:
        page: The page's path relative to the root, with ``/`` (e.g. ``docs/masks.md``).
        line: The 1-based line of the opening fence.
        kind: ``python``, ``bash``, ``text`` or ``other``.
        info: The info string after the opening backticks (e.g. ``python title="x.py"``).
        code: The fence's content, its indentation removed, ending with a newline when not
            empty.
        imports: The backends the fence's imports name (numpy never appears).
        runs_in: The backend of a ``runs-in`` marker, or None.
        continues: Whether a ``continues`` marker appends it to the previous python fence.
        not_runnable: The reason of a ``not-runnable`` marker ("" when it gives none), or None.
        problems: What is wrong with the fence itself (bad marker, two frameworks, unclosed).
    """

    page: str
    line: int
    kind: str
    info: str
    code: str
    imports: frozenset[str] = frozenset()
    runs_in: str | None = None
    continues: bool = False
    not_runnable: str | None = None
    problems: tuple[str, ...] = ()

    @property
    def location(self) -> str:
        """``page:line`` of the opening fence."""
        return f"{self.page}:{self.line}"

    @property
    def framework(self) -> str:
        """The backend whose env runs the fence on its own: ``runs-in``, else its imports."""
        if self.runs_in is not None:
            return self.runs_in
        return min(self.imports) if self.imports else "numpy"


@dataclasses.dataclass(frozen=True)
class Job:
    """Something the runner executes: a chain of python fences, or one shell command.

    Attributes:
        framework: The backend whose env runs it.
        fences: The python fences of a chain, in order; for a command, its bash fence.
        command: For a command, its words (``python`` first, environment assignments removed);
            empty for a chain.
        env: Environment assignments written before a command (``VAR=value python ...``).
        line: The page line of the command (for a chain, its first fence's line).
    """

    framework: str
    fences: tuple[Fence, ...]
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    line: int = 0

    @property
    def location(self) -> str:
        """``page:line`` of the chain's first fence or of the command's line."""
        return f"{self.fences[0].page}:{self.line or self.fences[0].line}"

    @property
    def name(self) -> str:
        """A short id: the location, then ``+N`` for each continued fence or the command."""
        if self.command:
            return f"{self.location} $ {' '.join(self.command[:4])}"
        extra = "".join(f"+{f.line}" for f in self.fences[1:])
        return f"{self.location}{extra}"


@dataclasses.dataclass(frozen=True)
class Result:
    """What a job's run gave.

    Attributes:
        job: The job.
        returncode: The process's exit status (None when it was stopped at the timeout).
        stdout: Its standard output.
        stderr: Its standard error, script lines rewritten to ``page:line``.
        failed_at: ``page:line`` of the failing line, when it failed and that is known.
        seconds: Wall-clock time of the run.
    """

    job: Job
    returncode: int | None
    stdout: str
    stderr: str
    failed_at: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether the job exited with status 0."""
        return self.returncode == 0

    def report(self, tail: int = 40) -> str:
        """A failure message: where, how, and the last ``tail`` lines of standard error."""
        how = "timed out" if self.returncode is None else f"exit status {self.returncode}"
        where = self.failed_at or self.job.location
        lines = self.stderr.rstrip().splitlines()[-tail:]
        return f"{where}: {how} ({self.job.framework} job {self.job.name})\n" + "\n".join(lines)


# -- parsing ----------------------------------------------------------------------------------


def markdown_pages(root: str | Path) -> list[Path]:
    """The pages whose fences the convention covers: ``README.md`` and ``docs/**/*.md``."""
    base = Path(root)
    pages = [base / "README.md"] if (base / "README.md").is_file() else []
    return pages + sorted((base / "docs").rglob("*.md"))


def imported_backends(code: str) -> frozenset[str]:
    """The backends a fence's imports name (``import torch``, ``from backends.jax import ...``).

    Args:
        code: Python source; when it does not parse, its ``import``/``from`` lines are read.

    Returns:
        The backend names other than numpy.
    """
    modules: list[str] = []
    try:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                modules += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.append(node.module)  # `from backends import torch` names backends.torch
                modules += [f"{node.module}.{alias.name}" for alias in node.names]
    except SyntaxError:
        modules = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", code, flags=re.MULTILINE)
    return frozenset(b for b in map(module_backend, modules) if b and b != "numpy")


def module_backend(module: str) -> str | None:
    """The backend a module belongs to, or None (``keras`` -> tensorflow, ``backends.jax`` -> jax).

    ``examples.<example>_<backend>`` belongs to ``<backend>``.
    """
    parts = module.split(".")
    if parts[0] in IMPORT_BACKENDS:
        return IMPORT_BACKENDS[parts[0]]
    if parts[0] == "backends" and len(parts) > 1 and parts[1] in registry.BACKENDS:
        return parts[1]
    if parts[:2] == ["backends", "keras"]:  # Keras' layers: Keras' own env unless runs-in says
        return "tensorflow"
    if parts[0] == "examples" and len(parts) > 1:
        suffix = parts[1].rsplit("_", 1)[-1]
        return suffix if suffix in registry.BACKENDS else None
    return None


def _markers(lines: Sequence[str], index: int) -> tuple[dict[str, str], list[str]]:
    """The marker comments stacked directly above line ``index``, and what is wrong with them."""
    found: dict[str, str] = {}
    problems: list[str] = []
    j = index - 1
    while j >= 0 and (m := _MARKER.match(lines[j].strip())):
        key, value = m["key"].lower(), (m["value"] or "").strip()
        if key in MARKERS:
            if key in found:
                problems.append(f"two {key} markers")
            found[key] = value
        elif re.match(r"(continu|not.?run|runs?.?in|skip)", key):
            problems.append(f"unknown fence marker <!-- {m['key']} -->; expected one of "
                            f"{', '.join(MARKERS)}")
        j -= 1
    return found, problems


def parse_page(text: str, page: str) -> list[Fence]:
    """Parses one page's fences.

    Args:
        text: The page's Markdown.
        page: Its path relative to the root, as it is to be reported.

    Returns:
        The fences, in page order.
    """
    lines = text.splitlines()
    fences: list[Fence] = []
    i = 0
    while i < len(lines):
        opening = _FENCE_OPEN.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, mark, info = opening["indent"], opening["mark"], opening["info"].strip()
        close = re.compile(rf"^[ \t]*{re.escape(mark[0])}{{{len(mark)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        problems: list[str] = []
        if end is None:
            problems.append("the fence is never closed")
            end = len(lines)
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        code = "\n".join(body) + ("\n" if body else "")
        word = info.lstrip("{").lstrip(".").split(" ", 1)[0].split("}", 1)[0].lower()
        kind = KINDS.get(word, "other")
        markers, marker_problems = _markers(lines, i)
        problems += marker_problems
        runs_in: str | None = None
        if "runs-in" in markers:
            try:
                runs_in = (markers["runs-in"] if markers["runs-in"] in KERAS_ENVS
                           else registry.canonical_name(markers["runs-in"]))
            except ValueError as err:
                problems.append(f"runs-in: {err}")
        imports = imported_backends(code) if kind == "python" else frozenset()
        if len(imports) > 1:
            problems.append(f"imports two frameworks ({', '.join(sorted(imports))}): split it")
        keras_env = runs_in in KERAS_ENVS and imports <= {"tensorflow"}  # `import keras`
        if runs_in and imports and imports != {runs_in} and not keras_env:
            problems.append(f"runs-in {runs_in} but imports {', '.join(sorted(imports))}")
        if "not-runnable" in markers and not markers["not-runnable"]:
            problems.append("not-runnable without a reason (<!-- not-runnable: why -->)")
        fences.append(Fence(
            page=page, line=i + 1, kind=kind, info=info, code=code, imports=imports,
            runs_in=runs_in, continues="continues" in markers,
            not_runnable=markers.get("not-runnable"), problems=tuple(problems)))
        i = end + 1
    return fences


def collect(root: str | Path) -> list[Fence]:
    """Every fence of the root's ``README.md`` and ``docs/**/*.md``, page by page."""
    base = Path(root)
    return [fence for page in markdown_pages(base)
            for fence in parse_page(page.read_text(encoding="utf-8"), page.relative_to(base).as_posix())]


def chains(fences: Iterable[Fence]) -> tuple[list[Job], list[str]]:
    """Groups the runnable python fences into chains (a fence, then those continuing it).

    Args:
        fences: Fences in page order.

    Returns:
        The chains as jobs, and the problems of ``continues`` markers (each ``page:line: why``).
    """
    jobs: list[list[Fence]] = []
    problems: list[str] = []
    last_python: dict[str, Fence] = {}
    chain_of: dict[Fence, int] = {}
    for fence in fences:
        if fence.continues:
            before = last_python.get(fence.page)
            if fence.kind != "python":
                problems.append(f"{fence.location}: continues, but is not a python fence")
            elif before is None:
                problems.append(f"{fence.location}: continues, but no python fence comes before it")
            elif before.not_runnable is not None and fence.not_runnable is None:
                problems.append(f"{fence.location}: continues {before.location}, which is not-runnable")
            elif fence.not_runnable is None:
                chain = jobs[chain_of[before]]
                framework = chain[0].framework
                if (fence.runs_in or fence.imports) and fence.framework != framework:
                    own = f"runs-in {fence.runs_in}" if fence.runs_in else f"imports {fence.framework}"
                    problems.append(f"{fence.location}: continues a {framework} chain "
                                    f"({chain[0].location}) but says {own}")
                chain.append(fence)
                chain_of[fence] = chain_of[before]
        elif fence.kind == "python" and fence.not_runnable is None:
            chain_of[fence] = len(jobs)
            jobs.append([fence])
        if fence.kind == "python":
            last_python[fence.page] = fence
    return [Job(c[0].framework, tuple(c)) for c in jobs], problems


# -- shell fences -----------------------------------------------------------------------------


def tox_envs(root: str | Path) -> set[str]:
    """The env names ``tox.ini`` defines: its ``env_list`` and its ``[testenv:X]`` sections."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(Path(root) / "tox.ini", encoding="utf-8")
    envs = {s.split(":", 1)[1] for s in parser.sections() if s.startswith("testenv:")}
    if parser.has_section("tox"):
        raw = parser.get("tox", "env_list", fallback=parser.get("tox", "envlist", fallback=""))
        envs |= {e.strip() for e in re.split(r"[,\s]+", raw) if e.strip()}
    return envs


#: ``pip install`` options that change how, not what, is installed.
_PIP_QUIET = {"-q", "--quiet", "-qq", "--no-cache-dir", "--disable-pip-version-check"}
_PIP_WITH_VALUE = {"-c", "--constraint", "--index-url", "-i", "--extra-index-url", "--find-links", "-f"}


def pip_install_target(words: Sequence[str]) -> tuple[str, ...]:
    """What a ``pip install`` installs, in a form two spellings can be compared in.

    Args:
        words: The words after ``install``.

    Returns:
        The requirements and remaining options, sorted; quietness and constraint files are
        dropped and ``$repo`` (the checkout in ``.ci/run``) becomes ``.``.
    """
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in _PIP_WITH_VALUE:
            skip = True
        elif word not in _PIP_QUIET and not word.startswith(("--constraint=", "-c=")):
            kept.append(re.sub(r"^\$\{?repo\}?", ".", word))
    return tuple(sorted(kept))


def ci_pip_installs(root: str | Path) -> set[tuple[str, ...]]:
    """The ``pip install`` commands ``.ci/run`` runs, as :func:`pip_install_target` gives them."""
    script = Path(root) / ".ci" / "run"
    found: set[tuple[str, ...]] = set()
    if not script.is_file():
        return found
    for line in script.read_text(encoding="utf-8").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for k, word in enumerate(words[:-1]):
            if (word.endswith("/pip") or word in ("pip", "pip3")) and words[k + 1] == "install":
                found.add(pip_install_target(_until_operator(words[k + 2:])))
            elif word == "-m" and words[k + 1] == "pip" and words[k + 2:k + 3] == ["install"]:
                found.add(pip_install_target(_until_operator(words[k + 3:])))
    return found


def _until_operator(words: Sequence[str]) -> list[str]:
    out: list[str] = []
    for word in words:
        if word in ("&&", "||", ";", "|") or word.startswith((">", "2>")):
            break
        out.append(word)
    return out


def shell_lines(fence: Fence) -> list[tuple[int, str]]:
    r"""A bash fence's commands with their page lines (``\`` continuations joined, comments out)."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for k, raw in enumerate(fence.code.splitlines()):
        if not pending:
            start = fence.line + 1 + k
        text = pending + raw
        if text.rstrip().endswith("\\"):
            pending = text.rstrip()[:-1] + " "
            continue
        pending = ""
        if text.strip() and not text.strip().startswith("#"):
            out.append((start, text.strip()))
    if pending.strip():
        out.append((start, pending.strip()))
    return out


def check_command(
    words: Sequence[str], root: Path, envs: set[str], installs: set[tuple[str, ...]]
) -> tuple[bool, str | None]:
    """Checks one shell command of a page.

    Args:
        words: The command's words, environment assignments removed.
        root: The repository root.
        envs: :func:`tox_envs` of the root.
        installs: :func:`ci_pip_installs` of the root.

    Returns:
        ``(run, problem)``: whether the runner executes the command (``python -m
        attention_core``/``examples``), and what is wrong with it (None when nothing is).
    """
    if not words:
        return False, "an empty command"
    head = words[0]
    if head in ("python", "python3") and len(words) >= 3 and words[1] == "-m":
        module = words[2]
        if module.split(".")[0] in ("attention_core", "examples"):
            return True, None
        if module == "pip":
            return check_command(["pip", *words[3:]], root, envs, installs)
        if module == "tox":
            return check_command(["tox", *words[3:]], root, envs, installs)
        path = root.joinpath(*module.split("."))
        if (path / "__main__.py").is_file() or path.with_suffix(".py").is_file():
            return False, None
        return False, f"python -m {module}: no such module in the repository"
    if head in ("python", "python3") and len(words) >= 2 and words[1].endswith(".py"):
        return False, None if (root / words[1]).is_file() else f"{words[1]}: no such file"
    if head in ("pip", "pip3"):
        if words[1:2] != ["install"]:
            return False, f"pip {' '.join(words[1:2])}: only pip install is checked"
        target = pip_install_target(words[2:])
        if target in installs:
            return False, None
        return False, (f"pip install {' '.join(words[2:])}: .ci/run runs no such install; make it "
                       "one .ci/run runs or mark the fence not-runnable")
    if head == "tox":
        named: list[str] = []
        rest = list(words[1:words.index("--")] if "--" in words else words[1:])
        for k, word in enumerate(rest):
            if word in ("-e", "--env") and k + 1 < len(rest):
                named += rest[k + 1].split(",")
            elif word.startswith(("-e", "--env=")) and len(word) > 2:
                named += word.split("=", 1)[-1].removeprefix("-e").split(",")
        missing = sorted({n for n in named if n} - envs)
        return False, f"tox: no env {', '.join(missing)} in tox.ini" if missing else None
    if head in ("bash", "sh") and len(words) >= 2:
        return False, None if (root / words[1]).is_file() else f"{words[1]}: no such file"
    if head.startswith("./") or head.startswith(".ci/"):
        return False, None if (root / head).is_file() else f"{head}: no such file"
    if head == "mkdocs":
        ok = (root / "mkdocs.yml").is_file() and words[1:2] in (["build"], ["serve"])
        return False, None if ok else "mkdocs: only build/serve, with a mkdocs.yml at the root"
    if head == "cd" or words[:2] == ["git", "clone"]:
        return False, None
    return False, (f"{head}: a command the runner does not check; show it in prose, or mark the "
                   "fence not-runnable")


def shell_jobs(fence: Fence, root: str | Path) -> tuple[list[Job], list[str]]:
    """The commands of a bash fence to run, and the problems of its lines (``page:line: why``)."""
    base = Path(root)
    envs, installs = tox_envs(base), ci_pip_installs(base)
    jobs: list[Job] = []
    problems: list[str] = []
    for line, text in shell_lines(fence):
        where = f"{fence.page}:{line}"
        if text.startswith("$ "):
            problems.append(f"{where}: no prompt ('$ ') in bash fences")
            text = text[2:]
        try:
            words = shlex.split(text, comments=True)
        except ValueError as err:
            problems.append(f"{where}: {err}")
            continue
        if any(w == "|" or w.startswith((">", "<", "2>")) for w in words):
            problems.append(f"{where}: pipes and redirections are not checked; keep one command a line")
            continue
        commands: list[list[str]] = [[]]
        for word in words:
            if word in ("&&", ";"):
                commands.append([])
            else:
                commands[-1].append(word)
        for command in commands:
            env = []
            while command and re.match(r"^[A-Za-z_]\w*=", command[0]):
                key, value = command.pop(0).split("=", 1)
                env.append((key, value))
            run, problem = check_command(command, base, envs, installs)
            if problem:
                problems.append(f"{where}: {problem}")
            if run:
                jobs.append(Job(_command_framework(fence, command, dict(env)), (fence,),
                                tuple(command), tuple(env), line))
    return jobs, problems


def _command_framework(fence: Fence, words: Sequence[str], env: dict[str, str]) -> str:
    if fence.runs_in:
        return fence.runs_in
    named = [words[k + 1] for k, w in enumerate(words[:-1]) if w == "--backend"]
    named += [w.split("=", 1)[1] for w in words if w.startswith("--backend=")]
    if registry.ENV_VAR in env:
        named.append(env[registry.ENV_VAR])
    for name in named:
        try:
            return registry.canonical_name(name)
        except ValueError:
            pass
    return (module_backend(words[2]) if len(words) > 2 else None) or "numpy"


# -- the whole of it --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Docs:
    """The fences of a root, the jobs to run, and what breaks the convention.

    Attributes:
        root: The repository root.
        fences: Every fence of every page.
        jobs: The python chains and shell commands to run.
        problems: Every rule broken, each ``page:line: why``.
    """

    root: Path
    fences: tuple[Fence, ...]
    jobs: tuple[Job, ...]
    problems: tuple[str, ...]

    def jobs_for(self, backends: Iterable[str]) -> list[Job]:
        """The jobs whose env is one of ``backends``."""
        wanted = set(backends)
        return [job for job in self.jobs if job.framework in wanted]

    @property
    def not_runnable(self) -> list[Fence]:
        """The fences marked not-runnable."""
        return [f for f in self.fences if f.not_runnable is not None]


def load(root: str | Path) -> Docs:
    """Parses and checks every page of ``root``.

    Args:
        root: The repository root (it holds ``README.md``, ``docs/``, ``tox.ini``, ``.ci/run``).

    Returns:
        The pages' fences, jobs and problems.
    """
    base = Path(root).resolve()
    fences = collect(base)
    jobs, problems = chains(fences)
    problems = [f"{f.location}: {p}" for f in fences for p in f.problems] + problems
    for fence in fences:
        if fence.kind == "other" and fence.not_runnable is None:
            problems.append(f"{fence.location}: a fence tagged {fence.info or 'nothing'!r} is neither run "
                            "nor output: tag it python, bash or text, or mark it not-runnable")
        if fence.kind == "bash" and fence.not_runnable is None:
            commands, bad = shell_jobs(fence, base)
            jobs += commands
            problems += bad
        if fence.kind != "python" and fence.runs_in is not None and fence.kind != "bash":
            problems.append(f"{fence.location}: runs-in on a {fence.kind} fence, which is not run")
    marked = [f for f in fences if f.not_runnable is not None]
    if len(marked) > MAX_NOT_RUNNABLE:
        problems.append(f"{len(marked)} fences are marked not-runnable, at most {MAX_NOT_RUNNABLE} may be: "
                        + ", ".join(f.location for f in marked))
    def page_order(problem: str) -> tuple[str, int]:
        page, _, line = problem.split(": ", 1)[0].rpartition(":")
        return (page, int(line)) if line.isdigit() else ("", 0)

    return Docs(base, tuple(fences), tuple(jobs), tuple(sorted(problems, key=page_order)))


# -- running ----------------------------------------------------------------------------------


def chain_script(job: Job) -> tuple[str, list[str | None]]:
    """The script a chain runs as, and the ``page:line`` of each of its lines (1-based, index 0 unused).

    Each continued fence is preceded by a comment and a line writing ``[doc-fence] page:line``
    to standard error, so a failure that leaves no traceback is still placed (the first fence
    gets neither: it may begin with ``from __future__ import``).
    """
    lines: list[str] = []
    where: list[str | None] = [None]
    for k, fence in enumerate(job.fences):
        note = f"{_DOC_PREFIX} {fence.location}\n"
        header = [f"# ---- {fence.location} ----", f"__import__('sys').stderr.write({note!r})"] if k else []
        lines += header
        where += [fence.location] * len(header)
        for n, text in enumerate(fence.code.splitlines()):
            lines.append(text)
            where.append(f"{fence.page}:{fence.line + 1 + n}")
    return "\n".join(lines) + "\n", where


def job_environment(job: Job, root: Path) -> dict[str, str]:
    """The environment of a job: this process's, the root first on ``PYTHONPATH``, ``MPLBACKEND=Agg``.

    For a tensorflow job, ``KERAS_BACKEND`` defaults to ``tensorflow``; a command's own
    assignments come last.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env["MPLBACKEND"] = "Agg"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if job.framework == "tensorflow":
        env.setdefault("KERAS_BACKEND", "tensorflow")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if job.framework in KERAS_ENVS:
        env["KERAS_BACKEND"] = KERAS_ENVS[job.framework]
    env.update(job.env)
    return env


def run_job(job: Job, root: str | Path, timeout: float = DEFAULT_TIMEOUT) -> Result:
    """Runs a job in a fresh interpreter (:data:`sys.executable`) in a new temporary directory.

    Args:
        job: A chain or a command of :func:`load`.
        root: The repository root, put first on ``PYTHONPATH``.
        timeout: Seconds before the job's process group is killed.

    Returns:
        What the run gave; for a failing chain, ``failed_at`` is the page line of the innermost
        traceback frame in the pages (else the fence that started last).
    """
    base = Path(root).resolve()
    with tempfile.TemporaryDirectory(prefix="doc-fences-") as work:
        where: list[str | None] = []
        if job.command:
            argv = [sys.executable, *job.command[1:]]
        else:
            script, where = chain_script(job)
            Path(work, _SCRIPT).write_text(script, encoding="utf-8")
            argv = [sys.executable, _SCRIPT]
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=work, env=job_environment(job, base), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            code = None
        seconds = time.perf_counter() - start
    stderr, failed_at = _place(stderr, where, job) if code != 0 else (stderr, None)
    if code is None:
        stderr += f"\n{failed_at or job.location}: stopped after {timeout:g} s"
    return Result(job, code, stdout, stderr, failed_at, seconds)


def _place(stderr: str, where: Sequence[str | None], job: Job) -> tuple[str, str]:
    """Rewrites the script's traceback lines to page lines; returns them and the failing place."""
    if job.command:
        return stderr, job.location
    failed_at: str | None = None

    def page_line(m: re.Match[str]) -> str:
        nonlocal failed_at
        number = int(m["line"])
        place = where[number] if 0 < number < len(where) else None
        if place is None:
            return m[0]
        failed_at = place
        page, line = place.rsplit(":", 1)
        return f'File "{page}", line {line}'

    pattern = rf'File "[^"]*{re.escape(_SCRIPT)}", line (?P<line>\d+)'
    stderr = re.sub(pattern, page_line, stderr)
    if failed_at is None:
        started = re.findall(rf"^{re.escape(_DOC_PREFIX)} (\S+)$", stderr, flags=re.MULTILINE)
        failed_at = started[-1] if started else job.location
    return stderr, failed_at


# -- command line -----------------------------------------------------------------------------


def _describe(fence: Fence) -> str:
    notes = []
    if fence.kind == "python":
        notes.append(fence.framework)
    if fence.continues:
        notes.append("continues")
    if fence.runs_in:
        notes.append(f"runs-in {fence.runs_in}")
    if fence.not_runnable is not None:
        notes.append(f"not-runnable: {fence.not_runnable}")
    return f"{fence.location:<28} {fence.kind:<7} {', '.join(notes)}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tools.doc_fences``: lists, checks or runs the fences of the pages.

    Returns:
        0 when every check passed and every job run succeeded, else 1.
    """
    parser = argparse.ArgumentParser(prog="python -m tools.doc_fences", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    parser.add_argument("--backend", help="only jobs of these backends (comma list); default: all")
    parser.add_argument("--list", action="store_true", help="list the fences and the jobs")
    parser.add_argument("--check", action="store_true", help="report the convention's broken rules")
    parser.add_argument("--run", action="store_true", help="run the jobs (of --backend)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per job")
    parser.add_argument("--pages", help="only jobs of these pages (comma list of paths from the "
                        "root, e.g. docs/getting-started.md); default: every page")
    args = parser.parse_args(argv)
    docs = load(args.root)
    backends = ([b.strip() if b.strip() in KERAS_ENVS else registry.canonical_name(b)
                 for b in args.backend.split(",") if b.strip()]
                if args.backend else [*registry.BACKENDS, *KERAS_ENVS])
    jobs = docs.jobs_for(backends)
    if args.pages:
        pages = {p.strip() for p in args.pages.split(",") if p.strip()}
        unknown = pages - {fence.page for fence in docs.fences}
        if unknown:
            parser.error(f"--pages: no fences in {', '.join(sorted(unknown))}")
        jobs = [job for job in jobs if job.fences[0].page in pages]
    if not (args.list or args.check or args.run):
        args.list = args.check = True
    status = 0
    if args.list:
        for fence in docs.fences:
            print(_describe(fence))
        print(f"\n{len(docs.fences)} fences in {len(markdown_pages(docs.root))} pages; "
              f"{len(docs.not_runnable)} not-runnable (at most {MAX_NOT_RUNNABLE}); jobs:")
        for job in jobs:
            print(f"  {job.framework:<10} {job.name}")
    if args.check:
        for problem in docs.problems:
            print(f"problem: {problem}")
        print(f"{len(docs.problems)} problems")
        status |= bool(docs.problems)
    if args.run:
        failed = 0
        for job in jobs:
            result = run_job(job, docs.root, args.timeout)
            verdict = "ok  " if result.ok else "FAIL"
            print(f"{verdict} {result.seconds:6.1f} s  {job.framework:<10} {job.name}", flush=True)
            if not result.ok:
                failed += 1
                print("    " + result.report().replace("\n", "\n    "), flush=True)
        print(f"{len(jobs) - failed} of {len(jobs)} jobs passed")
        status |= bool(failed)
    return status


if __name__ == "__main__":
    sys.exit(main())
