"""The docs a new user reads first stay short, current and sourced.

- **One page each.** docs/performance.md and docs/gpu.md hold the figures and facts that hold
  for today's code, at most 400 lines each; superseded figures go to CHANGELOG.md under the
  day of the change, the run-by-run GPU record to docs/gpu/.
- **The README's figures have a source.** A *figure* is a number with a unit of measurement:
  a percentage (``0.3%``, ``+0.08%``), a time (``1.1 ms``, ``20-24 us``), a bandwidth
  (``549 GB/s``), and, written with a decimal point, a ratio (``1.40x``, ``4.1-5.2x``) or a bit
  count (``4.53 bits``). Whole-number ratios and bit counts are left out on purpose: in the
  README they are format names (``4 bits``), shapes (``2 x 2``) or round approximations
  (``about 7x fewer bytes``), not measurements. Commands and flags (inline code, code blocks:
  ``--loss 0.01%``) are not figures. Each figure of a README paragraph (or list item) must be
  stated, with its unit, in docs/performance.md, docs/convergence.md, docs/gpu.md (with its
  record under docs/gpu/), or in a doc that the same paragraph links or names
  (``docs/hybrid.md``). A range passes where the doc states it, or states each end with the
  same unit in one paragraph (``4.1x`` ... ``5.2x`` for ``4.1-5.2x``); nothing is rounded or
  converted. So a README figure that no doc states, or one left behind when a doc's figure
  changed, fails here; that the doc's figure measures the same thing is the reader's check.
- **No word about how the project was made.** No line of README.md, docs/*.md, benchmarks/ or
  lowbitcc/ names a round of work: "session" as a word (any case, plural too), "round of
  work", or "stop" with a number (the rounds' old names); nor an issue by its number: "issue"
  or "issues" with a number (``issue 48``, ``Issue 37's``, ``issues 16 and 17``, ``issue-47``,
  ``issue #47``, ``issue47_goals``, the number also on the next line) or a bare ``#47``
  (``(#47)``; not ``name#1`` nor a format's ``#018x``). The verb is not a number's name:
  ``issues 2 kernels`` (a number then what is counted, `COUNTED`) passes. Say what it was (the
  feature, the goal, the change) and, where history matters, its date. Dates say when;
  CHANGELOG.md (not under docs/) is the history and is not checked, nor is docs/gpu/ (the
  run-by-run record, verbatim). The tests (but this file, whose examples break it) keep the
  first half of the issue rule, "issue" with a number: their "session" is pytest's fixture
  scope and a bare ``#7`` a call's number.
- **docs/architecture.md draws the code as it is.** Every file it names as code (in backticks
  or a code block) exists: a path from the repository root (``lowbitcc/buffers.py``,
  ``tests/...``), from the package (``backend/reductions.py``, ``codec/csrc/...``) or from the
  codec (``csrc/cpu_codec.cpp``); a bare name (``cli.py``) or folder (``perf/``) in a row of the
  module table, in the folder the row names (``lowbitcc/tools/``) or in ``lowbitcc/``. Names in
  a paragraph that begins "Deleted" are the exception: they must be gone. And the backend row
  names every module of ``lowbitcc/backend/``. Bare names outside the module table
  (``stats.py``, named as what the package avoids) are prose, not checked.
- **No page names a setting that is gone.** Every ``LOCO_*`` variable README.md and docs/*.md
  name is a `LocoConfig` setting, but in a paragraph that says what was "Deleted".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 400
SOURCES = ("docs/performance.md", "docs/convergence.md", "docs/gpu.md")

_NUM = r"\d+(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.,/+-])[+]?(?P<lo>-?{_NUM})(?:-(?P<hi>{_NUM}))?"
    r"(?:(?P<tight>%|x)|\s?(?P<unit>ms|us|µs|GB/s|bits))(?![\w/])")
"""A number or a range of two, then its unit; `%` and `x` written against the number."""

CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
DOC_REF = re.compile(r"\bdocs/[\w./-]+\.md\b")
ROUND_OF_WORK = re.compile(r"\bsessions?\b|\bround of work\b|\bstop \d+\b", re.I)
COUNTED = ("kernels?", "calls?", "launch(?:es)?", "cop(?:y|ies)", "uploads?", "allocations?",
           "collectives?", "operations?", "messages?", "transfers?", "jobs?", "reads?", "writes?",
           "all-reduces?")
"""What the verb "issue(s)" counts: ``issues 2 kernels`` names no issue."""
ISSUE_NUMBER = re.compile(
    rf"\bissues?[\s_-]*#?\d+(?!\d)(?!\s+(?:{'|'.join(COUNTED)})\b)|(?<![\w&#])#\d+\b", re.I)
"""An issue named by its number (see the module docstring); may span a line break."""
ISSUE_WORD = re.compile(ISSUE_NUMBER.pattern.split("|(?<!")[0], re.I)
"""`ISSUE_NUMBER`'s first half: "issue" or "issues" with a number (what the tests keep)."""
TEXT_SUFFIXES = {".py", ".sh", ".md", ".cu", ".cuh", ".cpp", ".h", ".hpp", ".txt", ".toml"}


def _figures(text: str) -> list[tuple[str, str | None, str]]:
    """(low, high or None, unit) of every figure in `text`, code spans left out."""
    found = []
    for m in FIGURE.finditer(CODE.sub(" ", text)):
        unit = m["tight"] or m["unit"]
        found.append((m["lo"], m["hi"], "us" if unit == "µs" else unit))
    return found


def _is_measure(lo: str, hi: str | None, unit: str) -> bool:
    """Whether a README figure is one the rule covers (see the module docstring)."""
    if unit in ("x", "bits"):
        return "." in lo or (hi is not None and "." in hi)
    return True


def _stated(text: str) -> tuple[set, list[set]]:
    """The figures `text` states whole, and per paragraph (or table) the numbers it states with
    their units: single figures and the ends of ranges."""
    whole, per_block = set(), []
    for _, block in _blocks(text):
        ends = set()
        for lo, hi, unit in _figures(block):
            whole.add((lo, hi, unit))
            ends.add((lo, unit))
            if hi is not None:
                ends.add((hi, unit))
        per_block.append(ends)
    return whole, per_block


def _blocks(text: str) -> list[tuple[int, str]]:
    """Paragraphs and list items of a markdown text with their first line, code blocks out."""
    blocks, start, lines = [], 0, []
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        new = not line.strip() or re.match(r"\s{0,2}[-*] |#", line) or in_fence
        if new and lines:
            blocks.append((start, "\n".join(lines)))
            lines = []
        if line.strip() and not in_fence:
            if not lines:
                start = number
            lines.append(line)
    if lines:
        blocks.append((start, "\n".join(lines)))
    return blocks


def _source_text(paths) -> str:
    parts = []
    for rel in paths:
        path = ROOT / rel
        if path.is_file():
            parts.append(path.read_text())
    return "\n".join(parts)


@pytest.mark.parametrize("doc", ["docs/performance.md", "docs/gpu.md"])
def test_the_figure_pages_are_one_page_each(doc):
    lines = (ROOT / doc).read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"{doc}: {len(lines)} lines, at most {MAX_LINES}"


def test_the_figure_rule_reads_figures_as_the_docstring_says():
    figs = _figures("worst +0.08% (every 0.3%), 4.53 bits, 4 bits, 2 x 2, about 7x, 1.40x, "
                    "4.1-5.2x, 20-24 us, 1.1 ms, 549 GB/s, `--loss 0.01%`, 3.3 MiB")
    covered = [f for f in figs if _is_measure(*f)]
    assert covered == [("0.08", None, "%"), ("0.3", None, "%"), ("4.53", None, "bits"),
                       ("1.40", None, "x"), ("4.1", "5.2", "x"), ("20", "24", "us"),
                       ("1.1", None, "ms"), ("549", None, "GB/s")]
    whole, blocks = _stated("3.82x and 3.26x; 0.95-0.97x; **5.2x**\n\n1.15 ms\n")
    assert ("3.26", None, "x") in whole and ("0.95", "0.97", "x") in whole
    assert {("0.97", "x"), ("5.2", "x")} <= blocks[0] and ("0.9", "x") not in blocks[0]
    assert _stated_in("3.26-5.2x", whole, blocks) and not _stated_in("1.1 ms", whole, blocks)
    # the ends of a range must be stated in one paragraph of the doc
    assert not _stated_in("3.26-1.15 ms", whole, blocks)


def _stated_in(figure: str, whole: set, blocks: list[set]) -> bool:
    """Whether one figure (as the README writes it) is stated in the doc text read into
    `whole` and `blocks`: whole, or for a range both ends in one paragraph."""
    ((lo, hi, unit),) = _figures(figure)
    if (lo, hi, unit) in whole:
        return True
    return hi is not None and any((lo, unit) in ends and (hi, unit) in ends for ends in blocks)


def test_every_figure_of_the_readme_is_stated_in_a_doc():
    base = _stated(_source_text(
        [*SOURCES, *(p.relative_to(ROOT) for p in sorted((ROOT / "docs" / "gpu").glob("*.md")))]))
    missing = []
    for line, block in _blocks(README.read_text()):
        linked = sorted(set(DOC_REF.findall(block)))
        whole, blocks = base
        if linked:
            extra_whole, extra_blocks = _stated(_source_text(linked))
            whole, blocks = whole | extra_whole, blocks + extra_blocks
        for lo, hi, unit in _figures(block):
            if not _is_measure(lo, hi, unit):
                continue
            shown = f"{lo}-{hi}" if hi else lo
            shown += unit if unit in ("%", "x") else f" {unit}"
            if not _stated_in(shown, whole, blocks):
                missing.append(f"README.md:{line} (paragraph): {shown} (docs searched: "
                               f"{', '.join([*SOURCES, 'docs/gpu/', *linked])})")
    assert not missing, "README figures no doc states:\n" + "\n".join(missing)


def _checked_files():
    yield README
    yield from sorted((ROOT / "docs").glob("*.md"))
    for folder in ("benchmarks", "lowbitcc"):
        yield from _text_files(folder)


def _text_files(folder: str):
    for path in sorted((ROOT / folder).rglob("*")):
        if (path.is_file() and path.suffix in TEXT_SUFFIXES
                and "__pycache__" not in path.parts and "build" not in path.parts):
            yield path


def test_the_issue_rule_reads_issue_numbers_as_the_docstring_says():
    named = ("issue 48", "(Issue 37's candidates)", "issues 16 and 17", "issue-47", "issue #47",
             "benchmarks/issue47_goals.py", "the host time issue\n47 aims at", "fixed (#47)",
             "see #12.", "the goals of issue 47's table")
    not_named = ("a planned call issues 2 kernels of its own", "may issue 3 calls", "issue 1 launch",
                 "keys name, name#1, name#2", "f'{x:#018x}'", "cuda_issue.py", "issue order",
                 "the issue's bar", "&#160;")
    assert [s for s in named if not ISSUE_NUMBER.search(s)] == []
    assert [s for s in not_named if ISSUE_NUMBER.search(s)] == []


def test_no_line_names_a_round_of_work_or_an_issue_number():
    hits = []
    for path in _checked_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if ROUND_OF_WORK.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
        for m in ISSUE_NUMBER.finditer(text):
            number = text.count("\n", 0, m.start()) + 1
            hits.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}")
    assert not hits, ("lines that name a round of work or an issue by its number (say the date, "
                      "or what the issue was, instead):\n" + "\n".join(hits))


def test_no_test_names_an_issue_by_its_number():
    assert ISSUE_WORD.search("the hierarchical schedule (issue 49)")
    assert not ISSUE_WORD.search("call #7 and a session-scoped fixture")
    hits = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
            for path in _text_files("tests") if path != Path(__file__)
            for text in [path.read_text()] for m in ISSUE_WORD.finditer(text)]
    assert not hits, "tests that name an issue by its number:\n" + "\n".join(hits)


ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "lowbitcc"
FILE_NAME = re.compile(
    r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|cpp|cu|cuh|h|hpp|toml|md|sh|txt))(?![\w/])")
"""A file named in code; ``../`` paths (outside the repository) are left out."""
BRACES = re.compile(r"([\w/-]+/)\{([^}]*)\}")
FENCED = re.compile(r"```.*?```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")


def _code_names(text: str) -> list[str]:
    """File names written in code in `text` (``dir/{a, b, ...}`` read as ``dir/a dir/b``)."""
    code = [m.group(0) for m in FENCED.finditer(text)]
    code += INLINE.findall(FENCED.sub(" ", text))
    names = []
    for part in code:
        part = BRACES.sub(lambda m: " ".join(m[1] + n.strip() for n in m[2].split(",")), part)
        names += FILE_NAME.findall(part)
    return names


def _resolve(name: str) -> Path | None:
    """Where a path with a folder lies: from the root, the package, or the codec."""
    first = name.split("/", 1)[0]
    for base in (ROOT, PACKAGE, PACKAGE / "codec"):
        if (base / first).is_dir():
            return base / name
    return None


def _module_rows(text: str) -> list[str]:
    """The rows of the module table (``| layer | modules | owns |``), header and rule out."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| layer | modules |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def _row_folder(row: str) -> Path:
    named = re.search(r"`(lowbitcc/[\w/]+/)`", row)
    return ROOT / named[1] if named else PACKAGE


def _architecture_problems(text: str) -> list[str]:
    problems = []
    deleted = [block for _, block in _blocks(text) if block.startswith("Deleted")]
    for block in deleted:
        for name in _code_names(block):
            path = _resolve(name)
            if path is not None and path.exists():
                problems.append(f"{name}: listed as deleted, but it exists")
    rest = text
    for block in deleted:
        rest = rest.replace(block, " ")
    for name in _code_names(rest):
        if "/" not in name:
            continue  # bare names: the module table's rows, below
        path = _resolve(name)
        if path is None or not path.exists():
            problems.append(f"{name}: no such file")
    for row in _module_rows(text):
        folder = _row_folder(row)
        layer = row.split("|")[1].strip()
        bare = [n for n in _code_names(row) if "/" not in n]
        bare += [span for span in INLINE.findall(row) if re.fullmatch(r"\w+/", span)]
        for name in bare:
            if not ((folder / name).exists() or (PACKAGE / name).exists()):
                problems.append(f"{name} (row {layer}): not in {folder.relative_to(ROOT)}/ "
                                f"nor lowbitcc/")
        if layer == "backend":
            named = {Path(n).name for n in _code_names(row)
                     if "/" not in n or n.startswith(("backend/", "lowbitcc/backend/"))}
            for module in sorted((PACKAGE / "backend").glob("*.py")):
                if module.name not in named:
                    problems.append(f"backend/{module.name}: not named in the backend row")
    return problems


def test_the_architecture_rule_reads_names_as_the_docstring_says():
    names = _code_names("`backend/a.py` and `x.py`, not ../shared/b.md or `../shared/c.md`\n"
                        "```\n  csrc/{d.cuh, ...}  (tests/e.py::test_f)\n```\n`lowbitcc.g`")
    assert sorted(names) == ["backend/a.py", "csrc/d.cuh", "tests/e.py", "x.py"]
    assert _resolve("backend/a.py") == PACKAGE / "backend" / "a.py"
    assert _resolve("csrc/d.cuh") == PACKAGE / "codec" / "csrc" / "d.cuh"
    assert _resolve("tests/e.py") == ROOT / "tests" / "e.py"
    assert _resolve("nowhere/f.py") is None


def test_architecture_names_only_files_that_exist_and_every_backend_module():
    problems = _architecture_problems(ARCHITECTURE.read_text())
    assert not problems, "docs/architecture.md against the tree:\n" + "\n".join(problems)


def test_every_environment_variable_the_docs_name_exists():
    """Every ``LOCO_*`` variable that README.md and the pages of docs/ name is a `LocoConfig`
    setting, so that no page tells a user to set a switch that is gone. A paragraph that says
    what was deleted names it on purpose; docs/gpu/ keeps the records of runs as they were."""
    import dataclasses

    from lowbitcc.config import ENV_PREFIX, LocoConfig

    known = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(LocoConfig)}
    unknown = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for paragraph in page.read_text().split("\n\n"):
            if "Deleted" in paragraph:
                continue
            unknown += [f"{page.name}: {name}" for name in re.findall(r"LOCO_[A-Z0-9_]+", paragraph)
                        if name not in known]
    assert not unknown, unknown
