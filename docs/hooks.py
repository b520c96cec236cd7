"""MkDocs hooks of the docs site (``hooks:`` in ``mkdocs.yml``): they add to the site what lives
elsewhere in the repository, and write the generated pages.

* the reference pages of ``docs/generate.py`` (flags and ``%config``, the API, the event
  contract), generated from the code at every build;
* the notebooks, ``notebooks/*.ipynb``, with the outputs stored in them (rendered by
  mkdocs-jupyter, never executed here), and their list, ``notebooks/README.md``, as the
  notebooks' index page;
* the benchmarks' results, ``benchmarks/results/*.json``, next to the page that cites them;
* the notebooks' relative links (to each other, to ``docs/`` pages and pictures) rewritten for
  the site's layout: a link to something the site does not have fails the strict build.
"""

from __future__ import annotations

import glob
import logging
import os
import posixpath
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# the package of this checkout (not another installed copy) and docs/generate.py
for _path in (HERE, ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import generate  # noqa: E402  (after the path above)

log = logging.getLogger("mkdocs.hooks.torchdist")
#: href="..." or src="..." in a rendered notebook
_LINK = re.compile(r'(href|src)="([^"#:]+)(#[^"]*)?"')


def on_files(files, config):
    """Add the generated pages, the notebooks and the benchmark results to the site's files
    (first, before mkdocs-jupyter picks the notebooks up)."""
    from mkdocs.structure.files import File

    for uri, make in generate.PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    # files of the repository itself (src_dir the repository's root, not a generated file's copy:
    # mkdocs-jupyter reads a notebook by the path it derives from src_dir)
    site = {"src_dir": ROOT, "dest_dir": config["site_dir"], "use_directory_urls": config["use_directory_urls"]}
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        files.append(File(f"notebooks/{os.path.basename(path)}", **site))
    with open(os.path.join(ROOT, "notebooks", "README.md"), encoding="utf-8") as fh:
        files.append(File.generated(config, "notebooks/index.md", content=fh.read()))
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json"))):
        files.append(File(f"benchmarks/results/{os.path.basename(path)}", **site))
    return files


on_files.mkdocs_priority = 100  # what mkdocs.plugins.event_priority(100) sets: run before the plugins


def _site_uri(target: str) -> str:
    """The site's ``src_uri`` of a file a notebook links to (relative to ``notebooks/``)."""
    repo_path = posixpath.normpath(posixpath.join("notebooks", target))
    if repo_path == "notebooks/README.md":
        return "notebooks/index.md"
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    return repo_path


def on_page_content(html, page, config, files):
    """A notebook's links, written for the repository, pointed at the same files in the site."""
    from mkdocs.utils import get_relative_url

    if not page.file.src_uri.startswith("notebooks/") or not page.file.src_uri.endswith(".ipynb"):
        return html

    def relink(match):
        attr, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        if target.startswith(("/", "data")):
            return match.group(0)
        found = files.get_file_from_path(_site_uri(target))
        if found is None:
            log.warning("%s links to %s, which the site does not have", page.file.src_uri, target)
            return match.group(0)
        return f'{attr}="{get_relative_url(found.url, page.url)}{anchor}"'

    return _LINK.sub(relink, html)
