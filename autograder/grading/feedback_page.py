"""The feedback page runs nothing and loads nothing from elsewhere, whatever the learner's notebook holds.

nbgrader renders feedback with nbconvert's HTMLExporter, whose template passes the learner's markdown,
HTML and outputs through as they are. FeedbackPage sanitizes the rendered page instead: only the
elements and attributes a notebook page needs are kept, links go to http, https, mailto or within the
page, images are data: URLs (nbconvert embeds a PNG output as one), and a Content-Security-Policy meta
forbids every script and every load from elsewhere. The template's own MathJax goes with the scripts,
so formulas show as their TeX source. nbgrader_config.py makes it GenerateFeedback's exporter, for plain
`nbgrader generate_feedback` and for `python -m autograder grade`, which runs that command.
"""

import re

from bs4 import BeautifulSoup
from bs4.element import PreformattedString, Tag
from nbconvert.exporters import HTMLExporter

# No script, frame, object, form or connection; inline styles and embedded images and fonts only.
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; font-src data:; "
                           "base-uri 'none'; form-action 'none'")

# What nbconvert's templates and rendered markdown use; any other element goes, with what it holds.
ELEMENTS = {
    "html", "head", "title", "style", "body", "main", "section", "article", "header", "footer", "nav", "aside",
    "div", "span", "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "a", "img", "pre", "code", "blockquote",
    "em", "strong", "b", "i", "u", "s", "del", "ins", "sub", "sup", "small", "mark", "kbd", "samp", "var",
    "abbr", "cite", "q", "dfn", "ul", "ol", "li", "dl", "dt", "dd", "table", "thead", "tbody", "tfoot", "tr",
    "th", "td", "caption", "colgroup", "col", "details", "summary", "figure", "figcaption",
}
ATTRIBUTES = {"class", "id", "name", "title", "alt", "lang", "dir", "style", "tabindex", "type", "colspan",
              "rowspan", "scope", "align", "width", "height", "start", "open"}
URL_ATTRIBUTES = {"href", "src"}
LINK_SCHEMES = {"http", "https", "mailto"}
SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.\-]*):")
IGNORED_IN_URLS = re.compile(r"[\t\n\r]")
AROUND_URLS = "".join(chr(c) for c in range(0x21))  # C0 controls and space


def scheme_of(url: str) -> str | None:
    """The URL's scheme as a browser reads it (tabs and newlines anywhere ignored, controls around it
    stripped), lower-cased; None for a relative URL."""
    match = SCHEME.match(IGNORED_IN_URLS.sub("", url).strip(AROUND_URLS))
    return match.group(1).lower() if match else None


def url_allowed(element: str, attribute: str, url: str) -> bool:
    """A link may lead to the web, to mail or within the page; an image is loaded only from its own data."""
    if (element, attribute) == ("a", "href"):
        return scheme_of(url) in LINK_SCHEMES | {None}
    if (element, attribute) == ("img", "src"):
        return scheme_of(url) == "data"
    return False


def safe_page(html: str) -> str:
    """The page with only allowed elements, attributes and URLs, no comments, and the CSP first in its head."""
    soup = BeautifulSoup(html, "html.parser")
    for node in soup.find_all(string=lambda s: isinstance(s, PreformattedString)):
        node.extract()  # comments, doctype, CDATA, processing instructions
    head = soup.head
    for element in soup.find_all(True):
        if element.decomposed:
            continue  # inside an element already removed
        # The template's CSS is in the head; a style elsewhere is the learner's and could restyle the verdicts.
        in_head = head is not None and element.find_parent("head") is head
        if element.name not in ELEMENTS or (element.name == "style" and not in_head):
            element.decompose()
            continue
        for attribute, value in list(element.attrs.items()):
            if attribute in URL_ATTRIBUTES:
                allowed = url_allowed(element.name, attribute, value)
            else:
                allowed = attribute in ATTRIBUTES
            if not allowed:
                del element[attribute]
    if head is None:
        head = soup.new_tag("head")
        (soup.html or soup).insert(0, head)
    head.insert(0, soup.new_tag("meta", attrs={"http-equiv": "Content-Security-Policy",
                                               "content": CONTENT_SECURITY_POLICY}))
    head.insert(0, soup.new_tag("meta", attrs={"charset": "utf-8"}))
    return "<!DOCTYPE html>\n" + str(soup)


class FeedbackPage(HTMLExporter):
    """nbconvert's HTML export, sanitized after rendering (see safe_page)."""

    def from_notebook_node(self, nb, resources=None, **kw):
        html, resources = super().from_notebook_node(nb, resources, **kw)
        return safe_page(html), resources
