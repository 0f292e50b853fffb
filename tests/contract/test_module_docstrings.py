"""Short module docstrings, and every ``[Note: ...]`` the sources name is written somewhere.

Issue 27: a module docstring says in a few lines what the module holds and
why; the long explanations are notes beside the code they explain (a ``#``
comment block headed ``# [Note: title]``), or a docstring line ``[Note:
title]``, or, for an essay across modules, a heading or line of the package
README. This test keeps both halves: every module of ``packages/*/src`` has a
docstring of at most ``MAX_LINES`` lines, and every note named in a source
file (in code, comments or docstrings, the title possibly wrapped over a line
break) is defined by one of those three forms, in any package's sources or in
the referring package's README. Read with ``ast`` and regular expressions;
nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 16

# A reference: the title may wrap, the next line starting with spaces and maybe ``#`` or ``#:``.
_WRAP = re.compile(r"\n[ \t]*(?:#:?[ \t]?)?")
_REFERENCE = re.compile(r"\[Note:\s+([^\]\[]{1,200}?)\]")
# A definition: the whole line (after a ``#`` for a comment, or the quotes opening a
# docstring) is the header, maybe closed by a full stop.
_SOURCE_DEFINITION = re.compile(r'^[ \t]*(?:#[ \t]*|r?""")?\[Note:\s+([^\]\[]+?)\]\.?[ \t]*$', re.MULTILINE)
# In a README: a heading that is a note header, or a line that is only one.
_README_DEFINITION = re.compile(r"^(?:#+[ \t]+)?`?\[Note:\s+([^\]\[]+?)\]`?[ \t]*$", re.MULTILINE)


def _title(text: str) -> str:
    return " ".join(text.split())


def package_sources() -> dict[Path, list[Path]]:
    """Package directory (``packages/<name>``) -> its modules under ``src``."""
    found: dict[Path, list[Path]] = {}
    for package in sorted((ROOT / "packages").iterdir()):
        modules = sorted((package / "src").rglob("*.py"))
        if modules:
            found[package] = modules
    return found


def _version_only(tree: ast.Module) -> bool:
    return bool(tree.body) and all(
        isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__version__"]
        for node in tree.body
    )


def docstring_problem(source: str) -> str | None:
    """Why ``source``'s module docstring breaks the rule, or None.

    A module holding nothing but ``__version__ = ...`` (hatch's version file,
    ``__about__.py``) needs no docstring: its one line says it all.
    """
    tree = ast.parse(source)
    doc = ast.get_docstring(tree, clean=False)
    if doc is None and _version_only(tree):
        return None
    if doc is None:
        return "no module docstring: add a few lines saying what the module holds and why"
    lines = len(doc.strip("\n").splitlines())
    if lines > MAX_LINES:
        return (
            f"module docstring of {lines} lines (at most {MAX_LINES}): move its [Note: ...] sections "
            "beside the code they explain as '# [Note: title]' comment blocks"
        )
    return None


def references(text: str) -> set[str]:
    """The note titles ``text`` names, a title wrapped over a comment or docstring line break included."""
    return {_title(match) for match in _REFERENCE.findall(_WRAP.sub(" ", text))}


def source_definitions(text: str) -> set[str]:
    return {_title(match) for match in _SOURCE_DEFINITION.findall(text)}


def readme_definitions(text: str) -> set[str]:
    return {_title(match) for match in _README_DEFINITION.findall(text)}


def dangling_references() -> list[str]:
    """``path: [Note: title]`` for every note named in the sources and defined nowhere."""
    sources = package_sources()
    texts = {path: path.read_text() for modules in sources.values() for path in modules}
    defined: set[str] = set()
    for text in texts.values():
        defined |= source_definitions(text)
    out = []
    for package, modules in sources.items():
        readme = package / "README.md"
        local = defined | (readme_definitions(readme.read_text()) if readme.exists() else set())
        for path in modules:
            for title in sorted(references(texts[path]) - local):
                out.append(f"{path.relative_to(ROOT)}: [Note: {title}]")
    return out


def test_the_reference_reader_joins_wrapped_titles() -> None:
    """A title wrapped in a comment or a docstring is one reference; a definition is a line of its own."""
    source = (
        '"""Summary ([Note: first\n    part wrapped]).\n\n[Note: in a docstring]\ntext\n"""\n'
        "# see [Note: decisions\n#   that hold] here\n"
        "    # [Note: a comment block]\n"
        "x = 1  # [Note: inline]\n"
        "#: see [Note: the\n#: wrapped one]\n"
        'def f():\n    """[Note: a docstring header].\n\n    text\n    """\n'
    )
    assert references(source) == {
        "first part wrapped",
        "in a docstring",
        "decisions that hold",
        "a comment block",
        "inline",
        "the wrapped one",
        "a docstring header",
    }
    assert source_definitions(source) == {"in a docstring", "a comment block", "a docstring header"}
    readme = "### [Note: the hook sequence]\nSee [Note: elsewhere] in `x.py`.\n[Note: a line]\n"
    assert readme_definitions(readme) == {"the hook sequence", "a line"}


def test_the_docstring_rule_sees_long_and_missing_docstrings() -> None:
    assert docstring_problem('"""One line."""\n') is None
    assert docstring_problem("x = 1\n") is not None
    assert docstring_problem('__version__ = "0.1.0"\n') is None
    long = '"""' + "\n".join(f"line {i}" for i in range(MAX_LINES + 1)) + '\n"""\n'
    assert "17 lines" in (docstring_problem(long) or "")


def test_every_module_has_a_short_docstring() -> None:
    offenders = []
    for modules in package_sources().values():
        for path in modules:
            problem = docstring_problem(path.read_text())
            if problem:
                offenders.append(f"{path.relative_to(ROOT)}: {problem}")
    print("\n".join(offenders))
    assert not offenders, "modules breaking the docstring rule:\n" + "\n".join(offenders)


def test_every_referenced_note_is_defined() -> None:
    dangling = dangling_references()
    print("\n".join(dangling))
    assert not dangling, (
        "notes referenced but defined nowhere (define each as a '# [Note: title]' comment block beside "
        "its code, or point the reference at the right title):\n" + "\n".join(dangling)
    )
