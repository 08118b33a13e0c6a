"""MkDocs hook: the build fails when a generated part of the docs is stale.

The generated tables and pages (docs/generate.py) are committed, so that they read
the same on GitHub and on the site; this check keeps a build from publishing tables
that no longer match the registries or the committed results.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

_GENERATE = Path(__file__).with_name("generate.py")


def on_pre_build(config, **kwargs):
    spec = importlib.util.spec_from_file_location("fedjax_sim_docs_generate", _GENERATE)
    generate = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = generate  # dataclasses look their module up there
    spec.loader.exec_module(generate)
    names = generate.stale()
    if names:
        raise PluginError(f"stale generated docs: {', '.join(names)}; "
                          "run `python docs/generate.py` and commit the result")
