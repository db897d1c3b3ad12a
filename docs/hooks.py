"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

The options reference is written from the options table in code: :func:`options_table`
runs :func:`pytest_gpu.run.options.register` against a recorder of pytest's parser and
renders every option, flag and ini key it declares, with the default and help text the
code gives pytest. A page that contains :data:`PLACEHOLDER` gets the table there, so
``pytest --help``, the ini file and the site can never disagree. The home page is the
README (:data:`README_PLACEHOLDER`), so the README is written once, for GitHub and the site.
tests/project/test_docs.py checks the table against the code the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLACEHOLDER = "<!-- options-table -->"
README_PLACEHOLDER = "<!-- readme -->"  # the home page is the README, its links made the site's


@dataclass
class Entry:
    """One option, flag or ini key as ``register`` declares it."""

    option: str = ""  # "--gpus"; "" for an ini-only key
    ini: str = ""  # "gpus"; "" for a flag without an ini key
    default: str = ""
    help: str = ""
    flag: bool = False
    group: str = ""


@dataclass
class _Group:
    recorder: _Recorder
    title: str

    def addoption(self, *names: str, **kwargs: Any) -> None:
        self.recorder.add_option(self.title, names, kwargs)


@dataclass
class _Recorder:
    """Stands for ``pytest.Parser``: records ``getgroup``, ``addoption`` and ``addini``."""

    entries: dict[str, Entry] = field(default_factory=dict)  # by ini key, or option for flags
    groups: dict[str, str] = field(default_factory=dict)

    def getgroup(self, name: str, description: str = "") -> _Group:
        self.groups[name] = description
        return _Group(self, description or name)

    def add_option(self, group: str, names: tuple[str, ...], kwargs: dict[str, Any]) -> None:
        option = next(n for n in names if n.startswith("--"))
        key = str(kwargs.get("dest") or option.lstrip("-").replace("-", "_"))
        entry = self.entries.setdefault(key, Entry())
        entry.option, entry.group = option, group
        help_text = str(kwargs.get("help", "")).replace("%%", "%")
        if kwargs.get("action") == "store_true":
            entry.flag, entry.default = True, "off"
            entry.help = entry.help or help_text
        elif not entry.help:
            # register appends "(ini: KEY)" for pytest --help; the table has a column for it
            entry.help = help_text.removesuffix(f" (ini: {key})")

    def addini(self, name: str, help: str, type: str | None = None, default: Any = None) -> None:
        entry = self.entries.setdefault(name, Entry())
        entry.ini, entry.help = name, help
        if type == "linelist":
            entry.default = "empty" if not default else "; ".join(default)
        else:
            entry.default = "" if default is None else str(default)

    # pytest.Parser.addoption: options outside a group
    def addoption(self, *names: str, **kwargs: Any) -> None:
        self.add_option("", names, kwargs)


def option_entries() -> list[Entry]:
    """Every option, flag and ini key of :func:`pytest_gpu.run.options.register`, in its order."""
    from pytest_gpu.run import options

    recorder = _Recorder()
    options.register(recorder)  # type: ignore[arg-type]  # the recorder has the parser's methods
    for ini in options.GIVEN_MATTERS:  # registered with the default None, to tell "not given": the default applies
        recorder.entries[ini].default = next(default for _, key, default, _ in options.OPTIONS if key == ini)
    return list(recorder.entries.values())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if text else "—"


def _ini_default(entry: Entry) -> str:
    """An ini list the code fills in when it is empty: its built-in lines, from the code."""
    if entry.ini == "launcher_markers":
        from pytest_gpu.launched.markers import DEFAULT_MAPPING

        return "<br>".join(f"`{line}`" for line in DEFAULT_MAPPING)
    return "empty" if entry.default in ("", "empty") else f"`{_cell(entry.default)}`"


def options_table() -> str:
    """The options reference as a Markdown table."""
    rows = [
        "| option | ini key | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for e in option_entries():
        meaning = _cell(e.help) + (" (a flag: no ini key)" if e.flag and not e.ini else "")
        rows.append(f"| {_code(e.option)} | {_code(e.ini)} | {_ini_default(e)} | {meaning} |")
    return "\n".join(rows) + "\n"


def readme_for_site(readme: str) -> str:
    """The README as a page of the site: its links into ``docs/`` made relative to the site."""
    return readme.replace("](docs/", "](")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: put the generated table, and the README, where a page asks for them."""
    if PLACEHOLDER in markdown:
        markdown = markdown.replace(PLACEHOLDER, options_table())
    if README_PLACEHOLDER in markdown:
        readme = Path(config["config_file_path"]).parent / "README.md"
        markdown = markdown.replace(README_PLACEHOLDER, readme_for_site(readme.read_text(encoding="utf-8")))
    return markdown
