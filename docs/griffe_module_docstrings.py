"""A griffe extension for the API pages (mkdocs.yml): a module docstring keeps its examples' indentation.

Python's cleaning of a docstring removes the margin its lines after the first share; in a module docstring whose
lines after the summary are all an indented example (`vit_serve/__init__.py`), that is the example's own
indentation, and Markdown then renders the code as a paragraph. A module's docstring has no margin of its own
(it starts at column 0), so it is taken as written.
"""

from __future__ import annotations

import ast
from typing import Any

import griffe


class ModuleDocstringsAsWritten(griffe.Extension):
    def on_module_instance(self, *, mod: griffe.Module, **kwargs: Any) -> None:
        doc = mod.docstring
        if doc is None or doc.lineno is None:
            return
        try:
            text = ast.literal_eval(doc.source.strip())
        except (ValueError, SyntaxError, OSError):
            return
        first, *rest = text.splitlines() or [""]
        doc.value = "\n".join([first.strip(), *rest]).strip()
