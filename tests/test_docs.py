"""Every code fence of README.md and docs/ is run, by ``tools.doc_fences``.

* ``test_fence_runs``: each python chain and each ``python -m attention_core``/``examples``
  command of the pages, in the env of its backend (``ATTENTION_CORE_TEST_BACKENDS``; the numpy
  env runs the framework-free ones). A failure names the page line that failed.
* Once, in the numpy env: the pages keep the convention (at most five not-runnable fences, each
  with a reason; no fence importing two frameworks; ``continues`` only after a python fence of
  the same framework; shell lines that name real tox envs, ``.ci/run``'s pip installs and
  commands that run), and the parser and the runner, on small pages written here, find what
  they must.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import test_backends
from tests.harness import COLUMNS
from tools import doc_fences
from tools.doc_fences import Job

ROOT = Path(__file__).resolve().parents[1]
DOCS = doc_fences.load(ROOT)

numpy_env = pytest.mark.skipif("numpy" not in test_backends(), reason="run once, in the numpy env")


@pytest.mark.parametrize("job", DOCS.jobs_for(test_backends()), ids=lambda job: job.name)
def test_fence_runs(job: Job) -> None:
    result = doc_fences.run_job(job, ROOT)
    if not result.ok:
        pytest.fail(result.report(), pytrace=False)


# -- the pages keep the convention ------------------------------------------------------------


@numpy_env
def test_pages_keep_the_convention() -> None:
    assert DOCS.fences, "no fences found in README.md and docs/"
    if DOCS.problems:
        pytest.fail("\n".join(DOCS.problems), pytrace=False)


@numpy_env
def test_at_most_five_not_runnable_fences_each_with_a_reason() -> None:
    marked = DOCS.not_runnable
    assert len(marked) <= doc_fences.MAX_NOT_RUNNABLE == 5, [f.location for f in marked]
    assert all(f.not_runnable for f in marked), [f.location for f in marked if not f.not_runnable]


@numpy_env
def test_every_python_fence_is_in_one_job_or_marked() -> None:
    in_jobs = [f for job in DOCS.jobs if not job.command for f in job.fences]
    python = [f for f in DOCS.fences if f.kind == "python" and f.not_runnable is None]
    assert sorted(in_jobs, key=lambda f: (f.page, f.line)) == python


# -- the parser, on pages written here --------------------------------------------------------


def page(*blocks: str) -> str:
    return "\n".join(blocks) + "\n"


def fence(kind: str, *lines: str, indent: str = "") -> str:
    return "\n".join(indent + x if x else x for x in [f"```{kind}", *lines, "```"])


def write_root(tmp_path: Path, text: str, docs: dict[str, str] | None = None,
               tox: str = "[tox]\nenv_list = numpy, torch\n\n[testenv:docs]\n",
               ci: str = 'pip="$work/venv/bin/pip"\n"$work/venv/bin/pip" install -q "$repo[plot]"\n') -> Path:
    (tmp_path / "README.md").write_text(text)
    for name, body in (docs or {}).items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(body)
    (tmp_path / "tox.ini").write_text(tox)
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text(ci)
    return tmp_path


@numpy_env
def test_kinds_lines_and_frameworks() -> None:
    text = page(
        "# Title", "",
        fence("python", "import numpy as np", "x = np.ones(3)"), "",                     # line 3
        fence("python", "import torch"), "",                                            # 8
        fence("python", "import keras"), "",                                            # 12
        fence("py", "from flax import linen as nn"), "",                                # 16
        fence("python", "from backends.mxnet import MultiHeadAttention"), "",           # 20
        fence("python", "from examples.seq2seq_tensorflow import train_seq2seq"), "",   # 24
        fence("python", "from backends import jax as b"), "",                           # 28
        "<!-- runs-in: pytorch -->",
        fence("python", "print(1)"), "",                                                # 33
        fence("bash", "tox"), "",                                                       # 37
        fence("text", "output"), "",                                                    # 41
        fence("", "untagged"), "",                                                      # 45
        fence("python", "import optax  # a comment"),                                   # 49
    )
    fences = doc_fences.parse_page(text, "page.md")
    got = [(f.line, f.kind, f.framework if f.kind == "python" else None) for f in fences]
    assert got == [
        (3, "python", "numpy"), (8, "python", "torch"), (12, "python", "tensorflow"),
        (16, "python", "jax"), (20, "python", "mxnet"), (24, "python", "tensorflow"),
        (28, "python", "jax"), (33, "python", "torch"), (37, "bash", None), (41, "text", None),
        (45, "other", None), (49, "python", "jax"),
    ]
    assert fences[0].code == "import numpy as np\nx = np.ones(3)\n"
    assert fences[7].runs_in == "torch" and not fences[7].imports
    assert all(not f.problems for f in fences)


@numpy_env
def test_indented_and_tilde_fences_are_read_without_their_indentation() -> None:
    text = page('=== "PyTorch"', "",
                fence("python", "import torch", "", "if True:", "    x = 1", indent="    "), "",
                "~~~~python", "print('tilde')", "```", "~~~~")
    first, second = doc_fences.parse_page(text, "tabs.md")
    assert (first.line, first.framework) == (3, "torch")
    assert first.code == "import torch\n\nif True:\n    x = 1\n"
    assert (second.line, second.code) == (10, "print('tilde')\n```\n")


@numpy_env
def test_fence_problems() -> None:
    text = page(
        fence("python", "import torch", "import jax.numpy as jnp"), "",                          # 1
        "<!-- not-runnable -->", fence("python", "x = 1"), "",                                 # 7
        "<!-- continue -->", fence("python", "x = 2"), "",                                     # 12
        "<!-- runs-in: theano -->", fence("python", "x = 3"), "",                              # 17
        "<!-- runs-in: jax -->", fence("python", "import torch"), "",                          # 22
        "```python", "never closed",                                                       # 26
    )
    problems = {f.line: f.problems for f in doc_fences.parse_page(text, "p.md")}
    assert "imports two frameworks (jax, torch): split it" in problems[1]
    assert any("without a reason" in p for p in problems[7])
    assert any("unknown fence marker <!-- continue -->" in p for p in problems[12])
    assert any(p.startswith("runs-in: unknown backend 'theano'") for p in problems[17])
    assert "runs-in jax but imports torch" in problems[22]
    assert "the fence is never closed" in problems[26]


@numpy_env
def test_continues_chains_and_their_rules() -> None:
    text = page(
        "<!-- continues -->", fence("python", "x = 0"), "",                        # 2: nothing before
        fence("python", "import torch", "t = torch.ones(2)"), "",                  # 6
        "<!-- continues -->", "<!-- runs-in: torch -->",
        fence("python", "t = t + 1"), "",                                          # 13: joins 6
        fence("bash", "tox -e numpy"), "",                                         # 17
        "<!-- continues -->", fence("python", "print(t)"), "",                     # 22: joins 6 (after bash)
        "<!-- continues -->", fence("bash", "tox"), "",                            # 27: not python
        "<!-- continues -->", fence("python", "import jax"), "",                   # 32: other framework
        fence("python", "import numpy as np"), "",                                 # 36
        "<!-- continues -->", fence("python", "import mxnet"), "",                 # 41: numpy head
        "<!-- not-runnable: needs a GPU -->", fence("python", "y = 1"), "",        # 46
        "<!-- continues -->", fence("python", "y += 1"),                           # 51: after not-runnable
    )
    jobs, problems = doc_fences.chains(doc_fences.parse_page(text, "c.md"))
    assert [(j.framework, [f.line for f in j.fences]) for j in jobs] == [
        ("torch", [6, 13, 22, 32]), ("numpy", [36, 41])]
    assert jobs[0].name == "c.md:6+13+22+32"
    assert problems == [
        "c.md:2: continues, but no python fence comes before it",
        "c.md:27: continues, but is not a python fence",
        "c.md:32: continues a torch chain (c.md:6) but says imports jax",
        "c.md:41: continues a numpy chain (c.md:36) but says imports mxnet",
        "c.md:51: continues c.md:46, which is not-runnable",
    ]


@numpy_env
def test_more_than_five_not_runnable_fences_is_a_problem(tmp_path: Path) -> None:
    marked = [page("<!-- not-runnable: a reason -->", fence("python", "x = 1")) for _ in range(3)]
    root = write_root(tmp_path, "".join(marked), docs={"a.md": "".join(marked[:2])})
    assert not doc_fences.load(root).problems
    (root / "docs" / "sub").mkdir()
    (root / "docs" / "sub" / "b.md").write_text(marked[0])
    docs = doc_fences.load(root)
    assert len(docs.not_runnable) == 6 and not docs.jobs
    assert docs.problems == ("6 fences are marked not-runnable, at most 5 may be: README.md:2, "
                             "README.md:6, README.md:10, docs/a.md:2, docs/a.md:6, docs/sub/b.md:2",)


@numpy_env
def test_shell_lines_are_checked(tmp_path: Path) -> None:
    lines = [
        "pip install .[plot]                      # .ci/run installs $repo[plot]",
        "pip install -q attention-core[torch]",
        "tox -e numpy,docs && tox -e bench-jax -- --quick",
        "tox run -e torch -e mxnet",
        "python -m attention_core demo --backend torch --out figures",
        "ATTENTION_CORE_BACKEND=jax python -m attention_core info",
        "python -m examples.seq2seq_torch \\",
        "    --steps 2",
        "python -m tools.nothing",
        "mkdocs build --strict",
        "curl https://example.org | sh",
        "rm -rf build",
    ]
    root = write_root(tmp_path, page("# x", "", fence("bash", *lines)))
    docs = doc_fences.load(root)
    assert list(docs.problems) == [
        "README.md:5: pip install -q attention-core[torch]: .ci/run runs no such install; make it one "
        ".ci/run runs or mark the fence not-runnable",
        "README.md:6: tox: no env bench-jax in tox.ini",
        "README.md:7: tox: no env mxnet in tox.ini",
        "README.md:12: python -m tools.nothing: no such module in the repository",
        "README.md:13: mkdocs: only build/serve, with a mkdocs.yml at the root",
        "README.md:14: pipes and redirections are not checked; keep one command a line",
        "README.md:15: rm: a command the runner does not check; show it in prose, or mark the fence "
        "not-runnable",
    ]
    assert [(j.line, j.framework, j.command, j.env) for j in docs.jobs] == [
        (8, "torch", ("python", "-m", "attention_core", "demo", "--backend", "torch", "--out", "figures"),
         ()),
        (9, "jax", ("python", "-m", "attention_core", "info"), (("ATTENTION_CORE_BACKEND", "jax"),)),
        (10, "torch", ("python", "-m", "examples.seq2seq_torch", "--steps", "2"), ()),
    ]


@numpy_env
def test_ci_pip_installs_are_read_from_the_real_ci_script() -> None:
    installs = doc_fences.ci_pip_installs(ROOT)
    assert (".",) in installs and (".[plot]",) in installs and ("tox",) in installs


# -- the runner --------------------------------------------------------------------------------


@numpy_env
def test_a_chain_shares_one_namespace_and_runs_away_from_the_root(tmp_path: Path) -> None:
    (tmp_path / "helper_module.py").write_text("VALUE = 41\n")
    text = page(
        fence("python", "import os", "from helper_module import VALUE", "start = os.getcwd()"), "",
        "<!-- continues -->",
        fence("python", "print(VALUE + 1, start != os.environ['ROOT'], os.environ['MPLBACKEND'])"))
    jobs, _ = doc_fences.chains(doc_fences.parse_page(text, "r.md"))
    result = doc_fences.run_job(Job(jobs[0].framework, jobs[0].fences, env=(("ROOT", str(tmp_path)),)),
                                tmp_path)
    assert result.ok, result.stderr
    assert result.stdout == "42 True Agg\n"


@numpy_env
def test_a_failure_names_the_page_line(tmp_path: Path) -> None:
    text = page(
        "intro", "",
        fence("python", "def f(x):", "    return 1 / x", "", "y = f(1)"), "",             # line 3
        "<!-- continues -->",
        fence("python", "print('second')", "z = f(0)"),                                  # line 11
    )
    jobs, _ = doc_fences.chains(doc_fences.parse_page(text, "docs/fail.md"))
    result = doc_fences.run_job(jobs[0], tmp_path)
    assert result.returncode == 1 and result.stdout == "second\n"
    assert result.failed_at == "docs/fail.md:5"          # the innermost frame in the page
    assert 'File "docs/fail.md", line 13, in <module>' in result.stderr
    assert 'File "docs/fail.md", line 5, in f' in result.stderr
    assert "ZeroDivisionError" in result.stderr
    assert result.report().startswith("docs/fail.md:5: exit status 1 (numpy job docs/fail.md:3+11)")


@numpy_env
def test_a_failure_without_traceback_names_its_fence_and_a_hang_is_stopped(tmp_path: Path) -> None:
    text = page(fence("python", "from __future__ import annotations", "x = 1"), "", "<!-- continues -->",
                fence("python", "import os", "os._exit(3)"), "",
                fence("python", "import time", "time.sleep(60)"))
    jobs, _ = doc_fences.chains(doc_fences.parse_page(text, "q.md"))
    exited = doc_fences.run_job(jobs[0], tmp_path)
    assert (exited.returncode, exited.failed_at) == (3, "q.md:7")
    hung = doc_fences.run_job(jobs[1], tmp_path, timeout=2)
    assert hung.returncode is None and not hung.ok and hung.seconds < 30
    assert hung.report().startswith("q.md:12: timed out")


@numpy_env
def test_a_command_job_runs_the_module(tmp_path: Path) -> None:
    root = write_root(tmp_path, page(fence("bash", "python -m attention_core info  # the backends")))
    (job,) = doc_fences.load(root).jobs
    result = doc_fences.run_job(job, ROOT)
    assert result.ok, result.stderr
    assert "* numpy" in result.stdout
    bad = doc_fences.run_job(Job("numpy", job.fences, ("python", "-m", "attention_core", "nothing"),
                                 line=job.line), ROOT)
    assert bad.returncode == 2 and bad.failed_at == "README.md:2"


@numpy_env
def test_cli_lists_checks_and_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = page(fence("python", "print('numpy fence')"), "", fence("python", "import torch"), "",
                fence("bash", "tox -e nothing"))
    root = write_root(tmp_path, text)
    assert doc_fences.main(["--root", str(root), "--list"]) == 0
    out = capsys.readouterr().out
    assert "README.md:1" in out and "torch      README.md:5" in out and "0 not-runnable" in out
    assert doc_fences.main(["--root", str(root), "--check"]) == 1
    assert "README.md:10: tox: no env nothing in tox.ini" in capsys.readouterr().out
    assert doc_fences.main(["--root", str(root), "--run", "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 jobs passed" in out and "torch" not in out
    # --pages: the jobs of those pages only (CI's newcomer path), and a page without fences refused
    (root / "docs").mkdir()
    (root / "docs" / "other.md").write_text(page(fence("python", "print('other fence')")))
    assert doc_fences.main(["--root", str(root), "--list", "--backend", "numpy",
                            "--pages", "docs/other.md"]) == 0
    jobs = capsys.readouterr().out.split("jobs:")[1]
    assert "docs/other.md:1" in jobs and "README.md" not in jobs
    with pytest.raises(SystemExit):
        doc_fences.main(["--root", str(root), "--list", "--pages", "docs/nothing.md"])
    assert "--pages: no fences in docs/nothing.md" in capsys.readouterr().err


# -- the API reference covers every public name ----------------------------------------------


def _documented(page_text: str) -> dict[str, list[str] | None]:
    """``{module: members or None (all)}`` of the pages' ``::: module`` directives."""
    found: dict[str, list[str] | None] = {}
    for block in page_text.split("\n::: ")[1:]:
        lines = block.splitlines()
        members = next((line.split(":", 1)[1] for line in lines[1:4] if "members:" in line), None)
        names = None if members is None else [m.strip(" []") for m in members.split(",")]
        found[lines[0].strip()] = names
    return found


def _undocumented(package: str, names: list[str]) -> list[str]:
    """The names of ``package``'s ``__all__`` that no API page documents: by a ``:::``
    directive on a module that defines or holds each (whole, or naming it among its members),
    or, for a backend's layer class, by the layer table its page includes."""
    import importlib

    from attention_core.declarations import LAYERS

    api = ROOT / "docs" / "api"
    text = "\n".join(p.read_text() for p in sorted(api.rglob("*.md")))
    directives = _documented("\n" + text)
    table = (ROOT / "docs" / "snippets" / "backend-layers.md").read_text()
    module = importlib.import_module(package)
    missing = []
    for name in names:
        value = getattr(module, name)
        home = getattr(value, "__module__", None) if callable(value) else None
        covered = any(
            (where == home or hasattr(importlib.import_module(where), name))
            and (members is None or name in members)
            for where, members in directives.items() if where.startswith(package))
        if name in LAYERS and package.startswith("backends."):
            covered = f"`{name}`" in table and "--8<-- \"docs/snippets/backend-layers.md\"" in (
                api / "backends" / f"{package.split('.')[1]}.md").read_text()
        if not covered:
            missing.append(name)
    return missing


@pytest.mark.parametrize("package", ["attention_core", *(
    COLUMNS[b].module if b in COLUMNS else f"backends.{b}" for b in test_backends())])
def test_the_api_reference_covers_every_public_name(package: str) -> None:
    import importlib

    names = list(importlib.import_module(package).__all__)
    assert names
    assert not _undocumented(package, names), f"{package}: not in docs/api"


#: What a reader of the docs, the package or its messages cannot follow: files outside the
#: repository, the project's issue numbers, and a "chapter" or "notes" that the page does not name.
OUTSIDE = (r"\bDESIGN\b|OPEN-CORE|STYLE\.md|\.\./shared|\b[Ii]ssues? #?\d+|\bthe chapter\b"
           r"|\bsource (notes|chapter)\b|\bthe notes\b|\bnotes'")


def _outside_references(root: Path) -> list[str]:
    """``path:line: text`` of each line under ``root`` that :data:`OUTSIDE` matches."""
    import re

    pattern = re.compile(OUTSIDE)
    files = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").rglob("*.md"))]
    for package in ("attention_core", "backends", "examples"):
        files += sorted((root / package).rglob("*.py"))
    return [f"{path.relative_to(root)}:{n}: {line.strip()}"
            for path in files for n, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line)]


@numpy_env
def test_docs_and_package_cite_nothing_a_reader_cannot_see(tmp_path: Path) -> None:
    assert _outside_references(ROOT) == []
    # and the check finds each kind, in a page and in a module's message
    (tmp_path / "docs").mkdir()
    for package in ("attention_core", "backends", "examples"):
        (tmp_path / package).mkdir()
    (tmp_path / "README.md").write_text("See DESIGN section 5.\n")
    (tmp_path / "CHANGELOG.md").write_text("Fixed in issue 17.\n")
    (tmp_path / "docs" / "page.md").write_text("As the chapter says.\n")
    (tmp_path / "backends" / "m.py").write_text('raise ValueError("see ../shared/OPEN-CORE.md")\n')
    found = _outside_references(tmp_path)
    assert [line.split(":")[0] for line in found] == [
        "README.md", "CHANGELOG.md", "docs/page.md", "backends/m.py"], found


def _design_rows() -> dict[str, tuple[str, str]]:
    """The Design page's layer table: ``{layer: (made with, called with)}``, as written."""
    rows = {}
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("("):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def _arguments(text: str) -> list[tuple[str, str | None, bool]]:
    """``(name, default or None, keyword-only)`` of each argument of ``(a, b=1, *, c=None)``."""
    inside = text[text.index("(") + 1:text.index(")")]
    found, keyword = [], False
    for part in (p.strip() for p in inside.split(",") if p.strip()):
        if part == "*":
            keyword = True
            continue
        name, _, default = part.partition("=")
        found.append((name, default or None, keyword))
    return found


@numpy_env
def test_the_design_page_states_the_code() -> None:
    """The Design page's backend names, aliases, variable and layer table are the code's."""
    import inspect

    from attention_core import registry
    from backends import numpy as layers

    page = (ROOT / "docs" / "design.md").read_text()
    assert f"`{registry.ENV_VAR}`" in page
    assert all(f"`{name}`" in page for name in registry.BACKENDS)
    aliases = page[page.index("The names\n  `pytorch`"):page.index("- The environment variable")]
    said = [w.strip("`,.") for w in aliases.split() if w.startswith("`")]
    names, meant = said[:len(said) // 2], said[len(said) // 2:]
    assert dict(zip(names, meant, strict=True)) == registry.ALIASES
    rows = _design_rows()
    assert len(rows) == 9
    for name, (made, called) in rows.items():
        layer = getattr(layers, name)
        given = list(inspect.signature(layer).parameters.values())
        for (arg, default, _), real in zip(_arguments(made), given, strict=False):
            assert arg == real.name, (name, arg, real.name)
            assert default is None or default == repr(real.default), (name, arg, real.default)
        if called.startswith("as "):
            called = rows[called.split()[1].strip("`;")][1]
        call = layer.call_signature().parameters
        order = list(call)
        for i, (arg, default, keyword) in enumerate(_arguments(called)):
            assert arg in call, (name, arg)
            assert default is None or default == repr(call[arg].default), (name, arg)
            assert keyword or order[i] == arg, (name, arg, order)


@numpy_env
def test_the_layers_page_is_what_the_declarations_say() -> None:
    """docs/api/layers.md is generated (``python -m tools.layer_reference``): it changes with a
    layer's arguments or docstring, and this test fails until it is written again."""
    from tools import layer_reference

    assert (ROOT / "docs" / "api" / "layers.md").read_text() == layer_reference.page()
    assert layer_reference.main(["--check"]) == 0
    # a changed docstring makes the page out of date
    from attention_core import declarations as D

    saved = D.LAYERS["AddNorm"].__doc__
    try:
        D.LAYERS["AddNorm"].__doc__ = f"{saved}\n\nOne more line."
        assert layer_reference.page() != (ROOT / "docs" / "api" / "layers.md").read_text()
    finally:
        D.LAYERS["AddNorm"].__doc__ = saved


@numpy_env
def test_the_layers_page_lists_every_argument_of_every_layer() -> None:
    import inspect

    from attention_core import declarations as D
    from tools import layer_reference

    text = (ROOT / "docs" / "api" / "layers.md").read_text()
    for name, declared in D.library_layers().items():
        section = layer_reference.layer_section(name)
        assert section in text, name
        for argument in inspect.signature(declared).parameters:
            assert f"| `{argument}` |" in section, (name, argument)


@numpy_env
def test_help_on_a_numpy_layer_shows_its_call_signature() -> None:
    import inspect

    from attention_core import declarations as D
    from backends import numpy as backend

    for name, declared in D.library_layers().items():
        shown = inspect.signature(getattr(backend, name).__call__)
        assert list(shown.parameters) == ["self", *declared.call_signature().parameters,
                                          "training"], name
        assert shown.parameters["training"].kind is inspect.Parameter.KEYWORD_ONLY
