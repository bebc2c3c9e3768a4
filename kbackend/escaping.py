"""User-supplied text made inert where kbackend shows it: the one escaping helper per boundary.

A name a user gives (a model or data path, a device profile's ``device``, a compiled metric's
name, an output folder) reaches three renderers that each read some characters as commands:

- markdown reports (``markdown_text``): a newline could start a heading, ``<...>`` is raw HTML,
  ``|`` ends a table cell, ``[...](...)``, ``*``, `` ` `` format. Control characters and newlines
  become spaces; HTML's ``& < >`` become entities; the punctuation of links, code, emphasis
  and tables is backslash-escaped.
- the console (``console_text``): rich reads ``[...]`` as markup (``[red]``, ``[link=...]``);
  ``rich.markup.escape`` makes it literal. Control characters (a terminal's escape sequences,
  a carriage return that overwrites the line) become spaces too.
- plot titles and labels (``plot_text``): matplotlib reads text between two ``$`` as mathtext
  (``$\\frac{...}$``; a malformed one raises while the figure is saved); ``\\$`` is a dollar.

Apply each at its boundary, to the user's part only: kbackend's own formatting stays as it is.
"""

from __future__ import annotations

import re
from typing import Any

from rich.markup import escape

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
# The markdown punctuation that could link, embed, format code or emphasis, or end a table cell
# (CommonMark backslash escapes). ``_`` and ``~`` are left: GitHub's markdown ignores them inside
# words (B_crit), and at worst they emphasize; ``( )`` and ``!`` act only after an escaped ``]``.
_MARKDOWN = re.compile(r"([\\`*\[\]#|])")


def one_line(value: Any) -> str:
    """``value`` as text on one line: control characters and line breaks as single spaces."""
    return _CONTROL.sub(" ", str(value))


def markdown_text(value: Any) -> str:
    """``value`` as literal text inside markdown (a table cell, a heading, a list item)."""
    text = "".join(_HTML.get(char, char) for char in one_line(value))
    return _MARKDOWN.sub(r"\\\1", text)


def console_text(value: Any) -> str:
    """``value`` as literal text in a line printed through rich (no markup)."""
    return escape(one_line(value))


def plot_text(value: Any) -> str:
    """``value`` as literal text in a matplotlib title or label (no mathtext)."""
    return one_line(value).replace("$", r"\$")
