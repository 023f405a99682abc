"""The shared Jinja2 page templates: autoescaping, strictness, a second report extending the base,
and the templates shipped as package data."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import jinja2
import pytest

from trt_diffusion import report_templates as pages

ROOT = Path(__file__).resolve().parents[2]


def test_values_are_escaped_in_text_and_attributes():
    template = pages.environment().from_string(
        '{% import "macros.html.j2" as m %}{{ m.cell(value, css_class="x", title=title) }}'
    )
    text = template.render(value="<b>&", title='" onmouseover="alert(1)')
    assert text == '<td class="x" title="&#34; onmouseover=&#34;alert(1)">&lt;b&gt;&amp;</td>'


def test_an_undefined_name_fails_the_render():
    with pytest.raises(jinja2.UndefinedError):
        pages.environment().from_string("{{ missing }}").render()


def test_another_report_extends_the_base_and_shares_its_styles():
    template = pages.environment().from_string(
        '{% extends "base.html.j2" %}{% block title %}Preflight report{% endblock %}'
        "{% block content %}<p>{{ note }}</p>{% endblock %}"
    )
    text = template.render(passed=False, note="<queue full>")
    assert "<title>Preflight report: FAIL</title>" in text
    assert '<h1>Preflight report: <span class="fail">FAIL</span></h1>' in text
    assert (pages.TEMPLATES / "styles.css").read_text().strip() in text
    assert "<p>&lt;queue full&gt;</p>" in text


def test_every_template_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["trt_diffusion"]
    package = ROOT / "trt_diffusion"
    files = [path.relative_to(package).as_posix() for path in pages.TEMPLATES.iterdir() if path.is_file()]
    assert {"base.html.j2", "macros.html.j2", "styles.css", "parity.html.j2"} <= {Path(f).name for f in files}
    for name in files:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in shipped), f"{name} is not package data"
