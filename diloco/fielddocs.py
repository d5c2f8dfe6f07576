"""The docstring under each field of a dataclass, read from its source: the one place a setting is explained.

The command line's options take their help from here (`diloco.cli.options`) where the explanation of a field
serves a user of the command as well as a user of the class, so that a setting's help exists once.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, whitespace collapsed} for the fields of `cls` that have one (a string literal on
    the line after the field, as PEP 257 calls an attribute docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
