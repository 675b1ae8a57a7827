"""Heading anchors as JupyterLab makes them, for the course website.

In JupyterLab `## TensorFlow words` is `#TensorFlow-words` (spaces become
hyphens, case kept), and the notebooks link to each other that way; with this
slug function (myst_heading_slug_func in conf.py) the same links work on the
site. A module of its own so that Sphinx can pickle the setting.
"""


def slug(title):
    return title.strip().replace(" ", "-")
