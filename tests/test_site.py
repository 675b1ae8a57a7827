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
The pages show what JupyterLab shows: a progress bar (a tqdm.auto widget) as
its final text, a warning printed on stderr in a warning box, each figure with
alt text from the ``Finding:`` lines its cell printed, and no nbval plumbing.
Those are checked on the real notebooks and on a made-up one, built into a
site of its own (``--notebooks``), that has each case, a warning included
(no stored notebook prints one today). Every page has the licences and
"Report a problem with this page"; every notebook page links Colab and Binder.
Without Chromium or playwright the browser tests are skipped with a reason.
"""

import base64
import contextlib
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
import tomllib
import urllib.error
import urllib.request
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

import nbformat
import pytest
import yaml

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


def built(tmp_path_factory, name, *args):
    """(folder, seconds to build, Sphinx's output) of build_site.py run once
    per test session into NAME, shared by pytest-xdist's workers."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out, log = shared / name, shared / f"{name}-build.log"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not log.exists():
            start = time.perf_counter()
            run = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "build_site.py"),
                    "--out",
                    out,
                    *[a(shared) if callable(a) else a for a in args],
                ],
                capture_output=True,
                text=True,
            )
            seconds = time.perf_counter() - start
            log.write_text(f"{run.returncode}\n{seconds:.1f}\n{run.stdout}{run.stderr}")
        status, seconds, output = log.read_text().split("\n", 2)
    assert status == "0", f"make site failed:\n{output}"
    return out, float(seconds), output


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """(folder, seconds to build, Sphinx's output): one build for all workers."""
    return built(tmp_path_factory, "site")


@pytest.fixture(scope="session")
def made_up_site(tmp_path_factory):
    """A site of one made-up notebook (``made_up_notebook``) that has a case of
    everything a page must show as JupyterLab does."""
    return built(tmp_path_factory, "made-up-site", "--notebooks", made_up_notebook)


@dataclasses.dataclass
class Served:
    url: str  # http://127.0.0.1:PORT/
    errors: list  # "404: /path" for every answer >= 400, as the server saw it


@contextlib.contextmanager
def serving(folder):
    """A built site on a free loopback port."""
    handler = functools.partial(Handler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.errors = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield Served(f"http://127.0.0.1:{httpd.server_address[1]}/", httpd.errors)
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(site):
    """The built site on a free loopback port."""
    with serving(site[0]) as served:
        yield served


@pytest.fixture(scope="module")
def made_up_server(made_up_site):
    with serving(made_up_site[0]) as served:
        yield served


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
        solved = f"{book.stem}-solutions.ipynb"
        found = sorted(downloads)
        assert set(downloads) >= {full, learner, solved}, f"{book.stem}: {found}"
        assert downloads[solved].read_bytes() == (
            book.parent / "solutions" / book.name
        ).read_bytes()
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


# -- as JupyterLab shows it: progress bars, warnings, figures, no nbval -------

PNG = base64.b64encode(  # a 1 x 1 PNG, a figure that draws
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c63f8cfc0f01f0005000201a5e3e5d2"
        "0000000049454e44ae426082"
    )
).decode()
MADE_UP_WARNING = (
    "WARNING:tensorflow:5 out of the last 5 calls to <function f at 0x7f> "
    "triggered tf.function retracing."
)
MADE_UP_FINDING = "the made-up line rises from 0 to 3 over 4 steps"
MADE_UP_FALLBACK = "The square below has no finding line."
MADE_UP_PROGRESS = "chunks: 100%|██████████| 8/8 [00:01<00:00, 7.90it/s]"


def made_up_notebook(folder):
    """99-made-up.ipynb in ``folder``: a nbval comment and tag, a progress-bar
    widget with its state, a text progress bar and a warning on stderr, a figure
    with its Finding: line and one without."""
    view = "application/vnd.jupyter.widget-view+json"

    def model(name, **state):
        return {"model_name": name, "state": state}

    state = {
        "bar": model(
            "HBoxModel",
            children=["IPY_MODEL_left", "IPY_MODEL_progress", "IPY_MODEL_right"],
        ),
        "left": model("HTMLModel", value="chunks: 100%"),
        "progress": model("FloatProgressModel", value=8.0, max=8.0),
        "right": model(
            "HTMLModel", value="\u20078/8\u2007[00:01&lt;00:00,\u20077.90it/s]"
        ),
    }
    new = nbformat.v4
    cells = [
        new.new_markdown_cell("# A made-up notebook\n\nEvery case a page shows."),
        new.new_code_cell(
            "# NBVAL_IGNORE_OUTPUT\nprint('measured')",
            metadata={"tags": ["nbval-ignore-output"]},
            outputs=[new.new_output("stream", name="stdout", text="measured\n")],
        ),
        new.new_code_cell(
            "for chunk in tqdm(chunks, desc='chunks'): pass",
            outputs=[
                new.new_output(
                    "display_data",
                    data={
                        view: {
                            "model_id": "bar",
                            "version_major": 2,
                            "version_minor": 0,
                        },
                        "text/plain": "chunks:   0%|          | 0/8 [00:00<?, ?it/s]",
                    },
                )
            ],
        ),
        new.new_code_cell(
            "f(1); f(2)",
            outputs=[
                new.new_output("stream", name="stderr", text=MADE_UP_WARNING + "\n"),
                new.new_output(
                    "stream",
                    name="stderr",
                    text="\r  0%|          | 0/4\r100%|##########| 4/4 [00:00<00:00]\n",
                ),
            ],
        ),
        new.new_code_cell(
            "plt.plot([0, 1, 2, 3])",
            outputs=[
                new.new_output(
                    "stream", name="stdout", text=f"Finding: {MADE_UP_FINDING}\n"
                ),
                new.new_output("display_data", data={"image/png": PNG}),
            ],
        ),
        new.new_markdown_cell(f"A square. {MADE_UP_FALLBACK}"),
        new.new_code_cell(
            "plt.fill([0, 1, 1, 0], [0, 0, 1, 1])",
            outputs=[new.new_output("display_data", data={"image/png": PNG})],
        ),
    ]
    nb = new.new_notebook(cells=cells)
    nb.metadata["widgets"] = {
        "application/vnd.jupyter.widget-state+json": {
            "state": state,
            "version_major": 2,
            "version_minor": 0,
        }
    }
    path = Path(folder) / "99-made-up.ipynb"
    nbformat.write(nb, path)
    return str(path)


def images(html):
    """``[(src, alt)]`` of a page's figures (the notebook's image outputs)."""
    return re.findall(r'<img alt="([^"]*)" src="([^"]*_images/[^"]*)"', html)


def is_a_path(alt):
    return bool(re.search(r"\.(png|jpe?g|svg)\b|_images/|[0-9a-f]{32}", alt)) or not alt


def stored_findings(book):
    """``[[finding, ...]]`` per figure cell of a stored notebook."""
    nb = nbformat.read(book, as_version=4)
    found = []
    for cell in nb.cells:
        if cell.cell_type == "code" and any(
            "image/png" in o.get("data", {}) for o in cell.outputs
        ):
            text = "".join(o.get("text", "") for o in cell.outputs if "text" in o)
            found.append(
                [
                    line.strip().removeprefix("Finding:").strip()
                    for line in text.splitlines()
                    if line.strip().startswith("Finding:")
                ]
            )
    return found


def test_every_figure_has_alt_text_from_its_findings(site):
    out = site[0]
    for book in BOOKS:
        html = book_page(out, book).read_text()
        shown = [unescape(alt) for alt, _ in images(html)]
        findings = stored_findings(book)
        assert len(shown) == sum(  # one <img> per image output
            "image/png" in o.get("data", {})
            for c in nbformat.read(book, as_version=4).cells
            if c.cell_type == "code"
            for o in c.outputs
        ), f"{book.stem}: {shown}"
        for alt in shown:
            assert not is_a_path(alt), f"{book.stem}: a figure's alt text is {alt!r}"
            assert alt.startswith("Figure"), alt
        per_cell = iter(shown)
        for cell_findings in findings:
            alt = next(per_cell)
            for finding in cell_findings:
                assert words(finding) in words(alt), (
                    f"{book.stem}: alt {alt!r} lacks the cell's finding {finding!r}"
                )


def widget_texts(book):
    """``[(left, right)]``: each progress bar's final label and count, from the
    widget state stored in the notebook."""
    nb = nbformat.read(book, as_version=4)
    state = (
        nb.metadata.get("widgets", {})
        .get("application/vnd.jupyter.widget-state+json", {})
        .get("state", {})
    )
    found = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(
                "application/vnd.jupyter.widget-view+json"
            )
            if view:
                assert view["model_id"] in state, (
                    f"{book.stem}: a progress bar without its stored state"
                )
                children = state[view["model_id"]]["state"]["children"]
                labels = [
                    unescape(state[c.removeprefix("IPY_MODEL_")]["state"]["value"])
                    .replace("\u2007", " ")
                    .strip()
                    for c in children
                    if "HTML" in state[c.removeprefix("IPY_MODEL_")]["model_name"]
                ]
                found.append((labels[0], labels[-1]))
    return found


def progress_texts(html):
    return [
        unescape(re.sub(r"<[^>]+>", "", t))
        for t in re.findall(r'class="output-progress"><pre>(.*?)</pre>', html, re.S)
    ]


def test_progress_bars_show_their_final_text(site):
    out = site[0]
    with_bars = [b for b in BOOKS if widget_texts(b)]
    assert with_bars, "no notebook stores a progress bar"
    for book in BOOKS:
        html = book_page(out, book).read_text()
        shown, stored = progress_texts(html), widget_texts(book)
        assert len(shown) == len(stored), f"{book.stem}: {shown}"
        for text, (left, right) in zip(shown, stored, strict=True):
            assert text.startswith(f"{left}|") and text.endswith(f"| {right}"), text
            assert re.search(r"\|█+ *\|", text), text
        assert "widget-view+json" not in html, f"{book.stem}: a live widget"


def test_no_nbval_plumbing_on_any_page(site):
    out = site[0]
    for path in pages(out):
        html = path.read_text()
        assert "NBVAL" not in html, f"{path.relative_to(out)} shows an NBVAL marker"
        if "notebooks" in path.parts:
            assert "nbval" not in html.lower(), (
                f"{path.relative_to(out)} shows an nbval tag"
            )


def test_stderr_is_shown_in_warning_boxes(site):
    """Every cell that printed a warning on stderr has a warning box (today no
    stored notebook does: the made-up notebook's test sees one)."""
    out = site[0]
    for book in BOOKS:
        html = book_page(out, book).read_text()
        assert 'class="output stderr' not in html, f"{book.stem}: raw stderr"
        warned = 0
        for cell in nbformat.read(book, as_version=4).cells:
            text = "".join(
                o.get("text", "")
                for o in cell.get("outputs", [])
                if o.get("name") == "stderr"
            )
            lines = [ln.split("\r")[-1] for ln in text.splitlines()]
            warned += any(ln.strip() and not re.search(r"\d+%\|", ln) for ln in lines)
        boxes = html.count('class="admonition warning output-warning"')
        assert boxes >= warned and (boxes == 0) == (warned == 0), (book.stem, boxes)


def test_made_up_notebook_shows_as_in_jupyterlab(made_up_site):
    out = made_up_site[0]
    html = (out / "notebooks" / "99-made-up.html").read_text()
    # the progress bar: its final text from the widget state, not its first
    assert progress_texts(html)[0] == MADE_UP_PROGRESS
    # a text progress bar on stderr: its last state, not a warning
    assert progress_texts(html)[1] == "100%|##########| 4/4 [00:00<00:00]"
    assert "0/8" not in html and "0/4" not in html
    # the warning: in a warning box, once
    boxes = re.findall(
        r'<div class="admonition warning output-warning"[^>]*>(.*?)</div>', html, re.S
    )
    assert len(boxes) == 1 and MADE_UP_WARNING in unescape(boxes[0]), boxes
    # figures: alt text from the Finding: line, else the markdown above
    alts = [unescape(alt) for alt, _ in images(html)]
    assert alts == [f"Figure: {MADE_UP_FINDING}.", f"Figure: {MADE_UP_FALLBACK}"]
    # no nbval plumbing
    assert "nbval" not in html.lower()
    assert "measured" in html  # the cell itself is shown


def repository():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"]


def footer(html):
    found = re.search(r'<div class="page-footer">(.*?)</div>', html, re.S)
    return found[1] if found else ""


def test_every_page_has_the_licences_and_a_problem_link(site):
    out = site[0]
    issue = f"{repository()}/issues/new?template=problem.yml&title="
    for path in pages(out):
        name = path.stem  # 01-nested-loop, api, index
        text = footer(path.read_text())
        page = Page(text)
        plain = re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", "", text)))
        where = path.relative_to(out)
        assert "Text and notebooks: CC BY 4.0 · Code: MIT" in plain, (where, plain)
        assert "https://creativecommons.org/licenses/by/4.0/" in page.links, where
        licence = [h for h in page.links if h.endswith("LICENSE.txt")]
        assert licence and (path.parent / licence[0]).resolve().is_file(), where
        reports = [unescape(h) for h in page.links if h.startswith(issue)]
        assert reports, f"{where}: no 'Report a problem with this page'"
        title = unquote(urlsplit(reports[0]).query.split("title=")[1].split("&")[0])
        assert name in title, (where, title)
        assert "Report a problem with this page" in plain, where
    assert (out / "LICENSE.txt").read_text() == (ROOT / "LICENSE").read_text()


def test_every_notebook_page_opens_in_colab_and_binder(site):
    out = site[0]
    owner_repo = urlsplit(repository()).path.strip("/")
    for book in BOOKS:
        html = book_page(out, book).read_text()
        links = Page(html).links
        colab = (
            f"https://colab.research.google.com/github/{owner_repo}/blob/main/"
            f"notebooks/{book.name}"
        )
        binder = f"https://mybinder.org/v2/gh/{owner_repo}/HEAD?labpath=notebooks/{book.name}"
        assert colab in links, f"{book.stem}: no Open in Colab link"
        assert binder in links, f"{book.stem}: no Launch on Binder link"
        for url, text in [(colab, "Open in Colab"), (binder, "Launch on Binder")]:
            anchor = re.search(rf'href="{re.escape(url)}"[^>]*>(.*?)</a>', html, re.S)
            assert anchor and anchor[1].strip() == text, (book.stem, anchor)


def test_issue_form_asks_for_the_notebook_and_the_cell():
    folder = ROOT / ".github" / "ISSUE_TEMPLATE"
    form = yaml.safe_load((folder / "problem.yml").read_text())
    assert form["name"] == "Report a problem with this page"
    fields = {f.get("id"): f for f in form["body"] if f.get("id")}
    assert {"notebook", "cell", "expected", "happened", "versions"} <= set(fields)
    notebook = fields["notebook"]
    assert notebook["type"] == "dropdown"
    options = notebook["attributes"]["options"]
    missing = [b.stem for b in BOOKS if b.stem not in options]
    assert not missing, f"problem.yml's notebook list lacks {missing}"
    assert len(options) == len(set(options))
    for name in ["notebook", "cell", "expected", "happened"]:
        assert fields[name]["validations"]["required"] is True, name
    assert "device_summary()" in fields["versions"]["attributes"]["description"]
    config = yaml.safe_load((folder / "config.yml").read_text())
    assert isinstance(config["blank_issues_enabled"], bool)
    for link in config.get("contact_links", []):
        assert {"name", "url", "about"} <= set(link)


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


@contextlib.contextmanager
def watched_tab(browser, server):
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


@pytest.fixture
def page(browser, server):
    with watched_tab(browser, server) as tab:
        yield tab


@pytest.fixture
def made_up_page(browser, made_up_server):
    with watched_tab(browser, made_up_server) as tab:
        yield tab


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
        "solutions": sum(
            "solution" in c.metadata.get("tags", [])
            for c in nbformat.read(
                book.parent / "solutions" / book.name, as_version=4
            ).cells
        ),
        "progress": sum(
            "application/vnd.jupyter.widget-view+json" in o.get("data", {})
            for c in code
            for o in c.outputs
        ),
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
        alts = figures.evaluate_all("imgs => imgs.map(i => i.alt)")
        assert not [a for a in alts if is_a_path(a)], f"{book.stem}: alt {alts}"
        assert page.locator("article .output.traceback").count() == want["errors"]
        # stderr: only in warning boxes (or as a progress bar's final text)
        assert not page.locator("article .output.stderr").count()
        bars = page.locator("article .output-progress")
        assert bars.count() == want["progress"], f"{book.stem}: progress bars"
        for i in range(bars.count()):
            assert bars.nth(i).is_visible()
            assert re.search(r"100%\|█+\| (\d+)/\1 ", bars.nth(i).inner_text())
        assert "NBVAL" not in page.locator("body").inner_text()
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


SHOW_ALT = """img => {
    const label = document.createElement('p');
    label.className = 'alt-shown';
    label.textContent = 'alt text: ' + img.alt;
    label.style.cssText = 'border: 2px dashed #c33; padding: 4px 8px; ' +
        'font: 14px sans-serif; background: #fff8e0; color: #222;';
    img.after(label);
}"""


@in_browser
def test_figures_progress_bars_and_no_markers_as_seen(page, server):
    """Screenshots for a reader's eye: a figure with its alt text shown under it
    (the page does not show alt text; this test writes it there), a progress
    bar's final text, and a notebook's once-marked cell without its marker."""
    book = next(b for b in BOOKS if stored_findings(b) and any(stored_findings(b)))
    page.goto(urljoin(server.url, f"notebooks/{book.stem}.html"))
    wait_for_math(page)
    figure = page.locator("article .cell_output img").first
    alt = figure.get_attribute("alt")
    assert alt and not is_a_path(alt), alt
    figure.evaluate(SHOW_ALT)
    figure.scroll_into_view_if_needed()
    page.locator(".alt-shown").scroll_into_view_if_needed()
    shoot(page, f"{book.stem}-figure-alt")

    book = next(b for b in BOOKS if widget_texts(b))
    page.goto(urljoin(server.url, f"notebooks/{book.stem}.html"))
    bar = page.locator("article .output-progress").first
    bar.scroll_into_view_if_needed()
    page.evaluate("window.scrollBy(0, 150)")
    assert bar.is_visible() and "100%" in bar.inner_text()
    shoot(page, f"{book.stem}-progress")

    book = next(b for b in BOOKS if b.stem.startswith("01"))
    nb = nbformat.read(book, as_version=4)
    marked = [
        i
        for i, c in enumerate(c for c in nb.cells if c.cell_type == "code")
        if "NBVAL" in c.source
        or any(t.startswith("nbval") for t in c.metadata.get("tags", []))
    ]
    page.goto(urljoin(server.url, f"notebooks/{book.stem}.html"))
    if marked:
        cell = page.locator("article .cell_input").nth(marked[0])
        cell.scroll_into_view_if_needed()
        page.evaluate("window.scrollBy(0, -120)")
    assert "NBVAL" not in page.locator("body").inner_text()
    assert not page.locator("[class*=nbval]").count()
    shoot(page, f"{book.stem}-no-nbval")
    footer = page.locator(".page-footer")
    footer.scroll_into_view_if_needed()
    assert "Report a problem with this page" in footer.inner_text()
    shoot(page, f"{book.stem}-footer")
    assert not trouble(page, server)


@in_browser
def test_a_warning_is_styled_as_a_warning(made_up_page, made_up_server):
    page = made_up_page
    page.goto(urljoin(made_up_server.url, "notebooks/99-made-up.html"))
    box = page.locator("article .output-warning")
    assert box.count() == 1
    assert box.is_visible()
    assert box.locator(".admonition-title").inner_text().startswith("Warning")
    assert "triggered tf.function retracing" in box.inner_text()
    # the theme's warning colour, as a warning admonition of the theme has it
    colours = box.evaluate(
        """box => {
        const probe = document.createElement('div');
        probe.style.color = 'var(--pst-color-warning)';
        document.body.append(probe);
        const warning = getComputedStyle(probe).color;
        probe.remove();
        const style = getComputedStyle(box);
        return {warning, border: style.borderLeftColor,
                plain: getComputedStyle(
                    document.querySelector('.output.stream, .cell_output')
                ).borderLeftColor};
        }"""
    )
    assert colours["border"] == colours["warning"], colours
    assert colours["border"] != colours["plain"], colours
    # the progress bar and the figures of the made-up page, as the real ones
    assert page.locator(".output-progress").first.inner_text() == MADE_UP_PROGRESS
    alts = page.locator("article .cell_output img").evaluate_all(
        "imgs => imgs.map(i => i.alt)"
    )
    assert alts == [f"Figure: {MADE_UP_FINDING}.", f"Figure: {MADE_UP_FALLBACK}"]
    assert "NBVAL" not in page.locator("body").inner_text()
    box.scroll_into_view_if_needed()
    shoot(page, "made-up-warning")
    assert not trouble(page, made_up_server)
