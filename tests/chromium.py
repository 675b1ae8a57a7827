"""The headless Chromium that the browser tests drive (test_browser, test_site):
Debian's package at /usr/bin/chromium (`.ci/run` installs it), and its flags."""

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
