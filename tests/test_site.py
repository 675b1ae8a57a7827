"""The course website (`make site`), built afresh and read as a reader reads it.

Builds the site with scripts/build_site.py into a temporary folder (once per
test session, shared by pytest-xdist's workers), then checks it:
- without a browser: it builds without a Sphinx warning; no page, style sheet
  or script loads anything from outside the site (fonts, scripts, MathJax are
  local); every internal link and anchor resolves (each page is fetched from a
  loopback HTTP server); every notebook has its page, with a download of the
  notebook and of its learner copy; the API reference has every public name of
  ``jacutil.__all__`` with its signature and docstring, and no docstring shows
  a reStructuredText slip;
- in headless Chromium (Debian's, with Playwright, as tests/test_browser.py):
  from the landing page to every notebook in order by the "next" links, each
  page's figures drawn, its math typeset, no error output, no console error,
  no failed request and no request outside 127.0.0.1; search finds
  ``chunked_jacobian``; a solution opens when clicked. Screenshots go to
  build/screenshots/site/.
Without Chromium or playwright the browser tests are skipped with a reason.
"""

import dataclasses
import fcntl
import functools
import http.server
import inspect
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

import nbformat
import pytest

from tests.chromium import CHROMIUM, CHROMIUM_FLAGS

ROOT = Path(__file__).resolve().parent.parent
BOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
SCREENSHOTS = ROOT / "build" / "screenshots" / "site"
# Attributes that make a browser fetch something (a link <a href> does not).
LOADS = {
    "script": ["src"],
    "link": ["href"],
    "img": ["src", "srcset"],
    "source": ["src", "srcset"],
    "iframe": ["src"],
    "embed": ["src"],
    "object": ["data"],
    "video": ["src", "poster"],
    "audio": ["src"],
    "track": ["src"],
}
CSS_URL = re.compile(r"""(?:url\(\s*['"]?|@import\s+['"])([^'")\s]+)""")

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.skipif(
        sync_playwright is None,
        reason="needs playwright: pip install playwright (`make test` installs it)",
    ),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason="needs Debian's Chromium at /usr/bin/chromium: run "
        "`apt-get install -y chromium` as root (.ci/run does)",
    ),
]


def in_browser(test):
    for mark in BROWSER_MARKS:
        test = mark(test)
    return test


def is_external(url):
    return (
        url.startswith("//")
        or bool(urlsplit(url).scheme)
        and not url.startswith(("data:", "blob:", "about:"))
    )


# -- the site, built once ----------------------------------------------------


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """(folder, seconds to build, Sphinx's output): one build for all workers."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out, log = shared / "site", shared / "site-build.log"
    with open(shared / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not log.exists():
            start = time.perf_counter()
            run = subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "build_site.py"), "--out", out],
                capture_output=True,
                text=True,
            )
            seconds = time.perf_counter() - start
            log.write_text(f"{run.returncode}\n{seconds:.1f}\n{run.stdout}{run.stderr}")
        status, seconds, output = log.read_text().split("\n", 2)
    assert status == "0", f"make site failed:\n{output}"
    return out, float(seconds), output


@dataclasses.dataclass
class Served:
    url: str  # http://127.0.0.1:PORT/
    errors: list  # "404: /path" for every answer >= 400, as the server saw it


@pytest.fixture(scope="module")
def server(site):
    """The built site on a free loopback port."""
    handler = functools.partial(Handler, directory=str(site[0]))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.errors = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield Served(f"http://127.0.0.1:{httpd.server_address[1]}/", httpd.errors)
    httpd.shutdown()
    httpd.server_close()


class Handler(http.server.SimpleHTTPRequestHandler):
    """Quiet, but keeps every error answer (a browser's own requests, such as
    /favicon.ico, never reach Playwright's events)."""

    def log_request(self, code="-", size="-"):
        if int(code) >= 400:
            self.server.errors.append(f"{int(code)}: {self.path}")

    def log_message(self, *args):
        pass


class Page(HTMLParser):
    """What one HTML page loads, links to and names (ids)."""

    def __init__(self, text):
        super().__init__()
        self.loads, self.links, self.ids, self.styles = [], [], set(), []
        self._in_style = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        for name in LOADS.get(tag, []):
            for value in (attrs.get(name) or "").split(","):
                if value.strip():
                    self.loads.append(value.split()[0])
        if attrs.get("style"):
            self.styles.append(attrs["style"])
        self._in_style = tag == "style"

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)

    def handle_endtag(self, tag):
        self._in_style = False


def pages(folder):
    """The site's pages (not the theme's templates copied into _static/)."""
    return sorted(p for p in folder.rglob("*.html") if "_static" not in p.parts)


def book_page(folder, book):
    return folder / "notebooks" / f"{book.stem}.html"


# -- without a browser -------------------------------------------------------


def test_site_builds_without_warnings(site):
    out, seconds, output = site
    print(f"site built in {seconds:.0f} s")
    assert "WARNING" not in output and "ERROR" not in output, output
    assert (out / "index.html").exists()
    assert (out / "search.html").exists() and (out / "searchindex.js").exists()


def test_nothing_is_loaded_from_outside_the_site(site):
    out = site[0]
    found = []
    for path in pages(out):
        page = Page(path.read_text())
        urls = page.loads + [u for s in page.styles for u in CSS_URL.findall(s)]
        found += [(path.relative_to(out), u) for u in urls if is_external(u)]
        for url in urls:
            if not is_external(url) and not url.startswith(("data:", "#")):
                target = (path.parent / urldefrag(url)[0].split("?")[0]).resolve()
                assert target.exists(), f"{path.name} loads {url}: missing"
    for css in out.rglob("*.css"):
        found += [
            (css.relative_to(out), u)
            for u in CSS_URL.findall(css.read_text(errors="replace"))
            if is_external(u)
        ]
    assert not found, f"loaded from outside the site: {found[:20]}"


def test_every_internal_link_resolves(site, server):
    """Crawl from the landing page: every <a href> inside the site answers 200,
    and every #anchor names an element of its page."""
    seen, todo, broken, ids, anchors = (
        set(),
        [urljoin(server.url, "index.html")],
        [],
        {},
        [],
    )
    while todo:
        url = todo.pop()
        if url in seen:
            continue
        seen.add(url)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = response.read()
                kind = response.headers.get_content_type()
        except urllib.error.HTTPError as error:
            broken.append((url, error.code))
            continue
        if kind != "text/html":
            continue
        page = Page(body.decode())
        ids[url] = page.ids
        for href in page.links:
            if is_external(href) or href.startswith(("mailto:", "javascript:")):
                continue
            target, anchor = urldefrag(urljoin(url, href))
            target = target.split("?")[0]
            todo.append(target)
            if anchor:
                anchors.append((target, unquote(anchor), url))
    for target, anchor, source in anchors:
        if target in ids and anchor not in ids[target]:
            broken.append(
                (f"{target}#{anchor}", f"no such anchor, linked from {source}")
            )
    assert not broken, broken
    for book in BOOKS:
        assert urljoin(server.url, f"notebooks/{book.stem}.html") in seen, book.stem


def test_every_notebook_has_its_page_and_downloads(site):
    out = site[0]
    for book in BOOKS:
        page = book_page(out, book)
        assert page.exists(), f"no page for {book.name}"
        links = Page(page.read_text()).links
        downloads = {
            Path(h).name: (page.parent / h).resolve()
            for h in links
            if "_downloads" in h
        }
        full, learner = book.name, f"{book.stem}-learner.ipynb"
        assert set(downloads) >= {full, learner}, f"{book.stem}: {sorted(downloads)}"
        assert downloads[full].read_bytes() == book.read_bytes()
        copy = nbformat.read(downloads[learner], as_version=4)
        code = [c for c in copy.cells if c.cell_type == "code"]
        assert not any(c.outputs for c in code), f"{learner} has outputs"
        assert not any("solution" in c.metadata.get("tags", []) for c in code)


def test_api_reference_documents_every_public_name(site):
    import jacutil

    api = (site[0] / "api.html").read_text()
    for name in jacutil.__all__:
        obj = getattr(jacutil, name)
        if inspect.ismodule(obj):
            if obj.__name__.startswith("jacutil."):
                assert f'id="module-jacutil.{name}"' in api, (
                    f"jacutil.{name} is not documented"
                )
            continue
        if not (getattr(obj, "__module__", "") or "").startswith("jacutil"):
            continue  # tf, keras: TensorFlow's, re-exported
        entry = re.search(
            rf'<dt class="sig[^"]*" id="jacutil\.{name}">(.*?)</dt>\s*<dd>(.*?)</dd>',
            api,
            re.S,
        )
        assert entry, f"jacutil.{name} is not in the API reference"
        signature, body = entry.groups()
        assert "sig-paren" in signature, f"jacutil.{name}: no signature"
        assert words(first_sentence(obj)) in words(body), (
            f"jacutil.{name}: its docstring is not shown"
        )


def first_sentence(obj):
    """The docstring's first sentence as it reads: roles and quotes dropped."""
    text = (inspect.getdoc(obj) or "").split("\n\n")[0].split(". ")[0]
    text = re.sub(r":\w+:`~?([^`]*)`", lambda m: m[1], text)
    return text


def words(html):
    """Letters and digits only: markup, quotes and spacing do not count."""
    return re.sub(r"\W", "", unescape(re.sub(r"<[^>]+>", "", html)))


def test_docstrings_render_without_markup_errors(site):
    """A docstring's markup slip (an unpaired ``*``) shows as a red mark that
    links nowhere; name each docstring that has one."""
    api = (site[0] / "api.html").read_text()
    slips = []
    for entry in re.finditer(r'id="(jacutil[\w.]*)">(.*?)</dd>', api, re.S):
        for mark in re.findall(r'class="problematic"[^>]*>([^<]*)<', entry[2]):
            slips.append(f"{entry[1]}: {mark!r}")
    assert not slips, (
        "docstrings with reStructuredText errors (escape `*` as `\\*` or quote it "
        f"in ``...``): {slips}"
    )


# -- in the browser ----------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            # No name resolves but 127.0.0.1: nothing leaves the machine, and
            # no request interception (which would hide /favicon.ico requests).
            args=[
                *CHROMIUM_FLAGS,
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            ],
        )
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    """A page that records console errors, failed and outside requests, 4xx/5xx."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.problems = problems = []

    def request(r):
        if not r.url.startswith((server.url, "data:", "blob:", "about:")):
            problems.append(f"request outside the site: {r.url}")

    def console(message):
        if message.type == "error":
            problems.append(f"console: {message.text}")

    tab.on("request", request)
    tab.on("console", console)
    tab.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    tab.on("requestfailed", lambda r: problems.append(f"failed: {r.url} {r.failure}"))
    tab.on(
        "response",
        lambda r: r.status >= 400 and problems.append(f"{r.status}: {r.url}"),
    )
    tab.served_from = len(server.errors)
    yield tab
    context.close()


def trouble(tab, server):
    """What went wrong since the page opened, in the browser or at the server."""
    return tab.problems + server.errors[tab.served_from :]


def expected(book):
    """What a notebook's page shows from its stored outputs."""
    nb = nbformat.read(book, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    raising = [c for c in code if "raises-exception" in c.metadata.get("tags", [])]
    return {
        "figures": sum(
            "image/png" in o.get("data", {}) for c in code for o in c.outputs
        ),
        # an error output only where the notebook says it raises on purpose
        "errors": sum(o.output_type == "error" for c in raising for o in c.outputs),
        "solutions": sum("solution" in c.metadata.get("tags", []) for c in code),
        "title": next(
            m[1]
            for c in nb.cells
            if c.cell_type == "markdown"
            for m in [re.search(r"^# (.+)$", c.source, re.M)]
            if m
        ),
    }


def shoot(tab, name):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


def wait_for_math(tab):
    """MathJax (local) typesets every formula of the page."""
    if tab.locator(".math").count():
        tab.wait_for_function(
            "document.querySelectorAll('mjx-container').length >= "
            "document.querySelectorAll('.math').length",
            timeout=20_000,
        )


@in_browser
def test_reader_walks_every_notebook_in_order(page, server):
    page.goto(urljoin(server.url, "index.html"))
    page.wait_for_load_state("load")
    shoot(page, "index")
    linked = page.eval_on_selector_all(
        "article a[href*='notebooks/']", "as => as.map(a => a.href.split('#')[0])"
    )
    for book in BOOKS:
        assert urljoin(server.url, f"notebooks/{book.stem}.html") in linked, book.stem

    page.locator(f"article a[href$='notebooks/{BOOKS[0].stem}.html']").first.click()
    for number, book in enumerate(BOOKS):
        want = expected(book)
        page.wait_for_url(urljoin(server.url, f"notebooks/{book.stem}.html"))
        title = page.locator("article h1").first.inner_text()
        assert re.sub(r"\W", "", want["title"].replace("`", "")) in re.sub(
            r"\W", "", title
        ), title
        wait_for_math(page)
        figures = page.locator("article .cell_output img")
        sizes = figures.evaluate_all(
            "imgs => imgs.map(i => i.complete ? i.naturalWidth : -1)"
        )
        assert len(sizes) == want["figures"], f"{book.stem}: figures {sizes}"
        assert all(w > 0 for w in sizes), f"{book.stem}: a figure is not drawn {sizes}"
        assert page.locator("article .output.traceback").count() == want["errors"]
        assert not page.locator("article .output.stderr").count()
        assert page.locator("details:has(.cell_input)").count() == want["solutions"]
        shoot(page, book.stem)
        if want["figures"]:
            figures.first.scroll_into_view_if_needed()
            shoot(page, f"{book.stem}-figure")
        if number + 1 < len(BOOKS):
            page.locator("a.right-next").click()
        assert not trouble(page, server)


@in_browser
def test_search_finds_chunked_jacobian(page, server):
    page.goto(urljoin(server.url, "search.html?q=chunked_jacobian"))
    results = page.locator("#search-results ul.search li")
    results.first.wait_for(timeout=20_000)
    hrefs = results.locator("a").evaluate_all("as => as.map(a => a.href)")
    assert any("api.html" in h for h in hrefs), hrefs
    assert any("notebooks/" in h for h in hrefs), hrefs
    shoot(page, "search")
    assert not trouble(page, server)


@in_browser
def test_a_solution_opens_when_clicked(page, server):
    book = next(b for b in BOOKS if expected(b)["solutions"])
    page.goto(urljoin(server.url, f"notebooks/{book.stem}.html"))
    solution = page.locator("details:has(.cell_input)").first
    code = solution.locator(".cell_input")
    assert not code.is_visible()
    solution.locator("summary").click()
    code.wait_for(state="visible")
    assert solution.evaluate("d => d.open")
    assert "Hide solution" in solution.locator("summary").inner_text()
    solution.scroll_into_view_if_needed()
    shoot(page, "solution-open")
    assert not trouble(page, server)
