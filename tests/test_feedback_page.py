"""The feedback page runs nothing and loads nothing from elsewhere (autograder/grading/feedback_page.py).

Unit tests feed safe_page single attacks; the slow tests grade a notebook whose markdown and outputs
hold them, with plain nbgrader and with the batch grader, and read every tag and attribute of the page
with Python's own HTML parser. An honest notebook's page keeps its plot and its text.
"""

import copy
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from autograder import ROOT
from autograder.grading import batch as grade
from autograder.grading.feedback_page import safe_page
from autograder.grading.submission import nbgrader_cmd, register
from conftest import SAMPLES

ASSIGNMENT = "01_online_softmax"
NOTEBOOK = f"{ASSIGNMENT}.ipynb"
HONEST = json.loads((SAMPLES / "submitted" / "alt_correct" / ASSIGNMENT / NOTEBOOK).read_text())
ATTACKS = "\n\n".join([
    "[a javascript link](javascript:alert(1))",
    "[a vbscript link](vbscript:msgbox(1))",
    '<img src="http://beacon.example/track.png?who=me">',
    "[a data link](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    r"$\href{javascript:alert(1)}{a formula link}$",
    "<script>document.title = 'owned'</script>",
    '<b onmouseover="alert(1)">hover here</b>',
    '<iframe src="https://evil.example/"></iframe>',
])
OUTPUT_ATTACK = ("from IPython.display import HTML, display\n"
                 "display(HTML('<script>alert(1)</script><img src=x onerror=alert(1)>'\n"
                 "             '<a href=\"javascript:alert(1)\">out</a>'))")
PLOT = "import matplotlib.pyplot as plt\nplt.plot([0, 1, 2], [2, 0, 1])\nplt.show()"
ACTIVE_SCHEMES = re.compile(r"^(javascript|vbscript):")


class Tags(HTMLParser):
    """Every start tag of a page with its attributes, as Python's HTML parser reads them."""

    def __init__(self, html: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {name: value or "" for name, value in attrs}))

    def handle_data(self, data):
        self.text.append(data)


def _url(value: str) -> str:
    """A URL as a browser reads its scheme: tabs, newlines and surrounding controls ignored."""
    return re.sub(r"[\t\n\r]", "", value).strip("".join(chr(c) for c in range(0x21))).lower()


def problems(html: str) -> list[str]:
    """What in the page could run or load something from elsewhere; empty for a safe page."""
    found = []
    for tag, attrs in Tags(html).tags:
        if tag in ("script", "iframe", "object", "embed", "frame", "link", "base"):
            found.append(f"a <{tag}> element")
        for name, value in attrs.items():
            if name.startswith("on"):
                found.append(f"an {name} attribute on <{tag}>")
            if ACTIVE_SCHEMES.match(_url(value)):
                found.append(f"{name}={value!r} on <{tag}>")
            if name == "src" and not _url(value).startswith("data:"):
                found.append(f"a remote src {value!r} on <{tag}>")
            if name == "href" and _url(value).startswith("data:"):
                found.append(f"a data: link on <{tag}>")
    return found


def csp(html: str) -> str:
    metas = [attrs for tag, attrs in Tags(html).tags
             if tag == "meta" and attrs.get("http-equiv", "").lower() == "content-security-policy"]
    return metas[0]["content"] if metas else ""


@pytest.mark.parametrize("attack", [
    '<a href="java&#x09;script:alert(1)">x</a>', '<a href=" JAVASCRIPT:alert(1)">x</a>',
    '<a href="&#0;javascript:alert(1)">x</a>', '<img src="//evil.example/x.png">', '<img src=x onerror=alert(1)>',
    '<svg><script>alert(1)</script></svg>', '<a href="data:text/html,<script>alert(1)</script>">x</a>',
    '<object data="https://evil.example/x.swf"></object>',
    '<meta http-equiv="refresh" content="0;url=javascript:alert(1)">',
    '<form action="https://evil.example"><button formaction="javascript:alert(1)">x</button></form>',
])
def test_an_attack_leaves_nothing_active(attack):
    page = safe_page(f"<html><head><title>t</title></head><body>{attack}</body></html>")
    assert not problems(page), page
    assert "default-src 'none'" in csp(page) and "script-src" not in csp(page)  # scripts fall back to 'none'


def test_what_a_page_needs_is_kept():
    """Links to the web and within the page, embedded images, the head's CSS and the text stay."""
    html = ('<html><head><style>p {color: red}</style></head><body><h1 id="top">Title</h1>'
            '<a href="https://example.org/doc">doc</a><a href="#top">up</a>'
            '<img src="data:image/png;base64,iVBORw0KGgo=" alt="plot"></body></html>')
    tags = Tags(safe_page(html)).tags
    assert ("a", {"href": "https://example.org/doc"}) in tags and ("a", {"href": "#top"}) in tags
    assert ("img", {"src": "data:image/png;base64,iVBORw0KGgo=", "alt": "plot"}) in tags
    assert "p {color: red}" in safe_page(html) and "Title" in safe_page(html)


def _notebook(*cells: dict) -> str:
    nb = copy.deepcopy(HONEST)
    nb["cells"][2:2] = cells
    return json.dumps(nb)


def _markdown(text: str) -> dict:
    return {"cell_type": "markdown", "id": "learner-markdown", "metadata": {}, "source": text}


def _code(source: str, cell_id: str) -> dict:
    return {"cell_type": "code", "id": cell_id, "metadata": {}, "source": source, "outputs": [],
            "execution_count": None}


SUBMISSIONS = {"attacker": _notebook(_markdown(ATTACKS), _code(OUTPUT_ATTACK, "learner-output")),
               "plotter": _notebook(_code(PLOT, "learner-plot"))}


def _submit(folder: Path) -> None:
    for student, notebook in SUBMISSIONS.items():
        (folder / student / ASSIGNMENT).mkdir(parents=True)
        (folder / student / ASSIGNMENT / NOTEBOOK).write_text(notebook)


@pytest.fixture(scope="module")
def plain_pages(tmp_path_factory):
    """Feedback pages of `nbgrader autograde` and `nbgrader generate_feedback` run from the course root."""
    course = tmp_path_factory.mktemp("plain")
    _submit(course / "submitted")
    (course / "templates").mkdir()
    db = register(ASSIGNMENT, course / "templates")
    folders = {kind: course / kind for kind in ("submitted", "autograded", "feedback")}
    for command in ("autograde", "generate_feedback"):
        run = subprocess.run(nbgrader_cmd(command, ASSIGNMENT, "--force", db=db, folders=folders),
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
    return {s: (course / "feedback" / s / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text() for s in SUBMISSIONS}


@pytest.mark.slow
def test_plain_nbgrader_feedback_runs_and_loads_nothing(plain_pages):
    page = plain_pages["attacker"]
    assert "hover here" in "".join(Tags(page).text), "the learner's markdown should be on the page"
    assert not problems(page)
    assert "default-src 'none'" in csp(page)


@pytest.mark.slow
def test_an_honest_page_keeps_its_plot_and_text(plain_pages):
    page = plain_pages["plotter"]
    images = [a["src"] for t, a in Tags(page).tags if t == "img"]
    assert any(src.startswith("data:image/png;base64,") for src in images), "the plot should be on the page"
    first_heading = next(c["source"] for c in HONEST["cells"] if c["cell_type"] == "markdown")
    first_heading = "".join(first_heading).splitlines()[0].lstrip("# ").strip()
    assert first_heading in "".join(Tags(page).text)


@pytest.mark.slow
def test_the_batch_grader_feedback_runs_and_loads_nothing(tmp_path):
    """`python -m autograder grade` runs the same generate_feedback, so its pages are sanitized too."""
    _submit(tmp_path / "submitted")
    shutil.rmtree(tmp_path / "submitted" / "plotter")
    grade.grade(tmp_path / "submitted", tmp_path / "out", jobs=1, progress=False)
    page = (tmp_path / "out" / "feedback" / "attacker" / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text()
    assert "hover here" in "".join(Tags(page).text)
    assert not problems(page)
    assert "default-src 'none'" in csp(page)
