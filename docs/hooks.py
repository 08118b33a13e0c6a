"""MkDocs hooks: the build fails when a generated part of the docs is stale, or when a
page's markup would print wrong.

The generated tables and pages (docs/generate.py) are committed, so that they read
the same on GitHub and on the site; the first check keeps a build from publishing
tables that no longer match the registries or the committed results. The others
(docs/markup_checks.py) read every page's Markdown and its HTML: an asterisk that
Markdown would pair into emphasis (`θ*_j ... w*`), an emphasis left open, a formula
left unrendered or one that swallowed prose fail the build, naming the page and line.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

_HERE = Path(__file__).parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"fedjax_sim_docs_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_checks = _load("markup_checks")


def on_pre_build(config, **kwargs):
    names = _load("generate").stale()
    if names:
        raise PluginError(f"stale generated docs: {', '.join(names)}; "
                          "run `python docs/generate.py` and commit the result")


def on_page_markdown(markdown, page, **kwargs):
    problems = _checks.markdown_problems(markdown, page.file.src_uri)
    if problems:
        raise PluginError("misread emphasis:\n  " + "\n  ".join(problems))
    return markdown


def on_post_page(output, page, **kwargs):
    problems = _checks.html_problems(output, page.file.src_uri)
    if problems:
        raise PluginError("markup printed wrong:\n  " + "\n  ".join(problems))
    return output
