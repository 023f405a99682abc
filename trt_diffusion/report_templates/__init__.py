"""HTML pages from the Jinja2 templates shipped in `report_templates/templates/` (package data).

`base.html.j2` is the page every report extends (document skeleton, the shared `styles.css`, a header with
the verdict); `macros.html.j2` holds the pieces reports share (verdict badge, table cells). Each report has
its own template (`parity.html.j2`, `preflight.html.j2`) and
passes plain values in: formatting and judging stay in Python, the templates only lay them out.

Autoescaping is always on: prompts, variant ids and failure reasons come from users and reach the page
only escaped.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "templates"


@cache
def environment():
    """The one Jinja2 environment: autoescaped, strict about undefined names, templates from TEMPLATES."""
    import jinja2  # only the commands that write a page pay for the import

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a misspelt variable fails the render instead of vanishing
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render_page(template: str, **context: Any) -> str:
    """Render `template` (a file name in TEMPLATES) with `context`."""
    return environment().get_template(template).render(**context)
