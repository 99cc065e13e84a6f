"""The mkdocs hook of sinklab's documentation site (mkdocs.yml `hooks:`): when the site is built it adds
- the reference pages generated from sinklab's registries (docs/hooks/reference.py) under reference/;
- the results, kept beside the experiments that produce them (experiments/README.md: the presets and the verdict
  rule; experiments/cpu/RESULTS.md and every report, plot and table under experiments/cpu/), under results/ with the
  same tree, so that their relative links hold;
- CHANGELOG.md and CONTRIBUTING.md from the repository root.
A link of those copied pages to another file of the repository is pointed at its page on the site where it has one
(docs/X.md -> X.md, a directory -> its README.md, or an index page listing it), else written as the file's path in
code, so that `mkdocs build --strict` checks every link that remains.
"""
from __future__ import annotations

import os
import posixpath
import re
import sys
from pathlib import Path
from typing import Optional

from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import reference  # noqa: E402  (docs/hooks/reference.py: the generator)

COPIED = {"experiments": "results"}  # a repository folder -> where its files go on the site
ROOT_PAGES = {"CHANGELOG.md": "changelog.md", "CONTRIBUTING.md": "contributing.md", "README.md": "index.md"}
LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")


def site_path(repo_path: str) -> Optional[str]:
    """The site path of a repository file (posix, relative to the repository), None where it has no page."""
    if repo_path in ROOT_PAGES:
        return ROOT_PAGES[repo_path]
    if repo_path.startswith("docs/") and not repo_path.startswith("docs/hooks/"):
        return repo_path[len("docs/"):]
    for folder, target in COPIED.items():
        if repo_path == folder or repo_path.startswith(folder + "/"):
            return target + repo_path[len(folder):]
    return None


def rewrite_links(text: str, repo_file: str, listings: dict[str, list[str]]) -> str:
    """The Markdown of `repo_file` (posix, relative to the repository) with each relative link pointed at the site
    page of its target; a directory without README.md gets a listing page (`listings`: its site path -> entries)."""
    here = posixpath.dirname(repo_file)
    at = posixpath.dirname(site_path(repo_file) or repo_file)

    def one(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, hash_, fragment = target.partition("#")
        repo_target = posixpath.normpath(posixpath.join(here, path)) if path else repo_file
        full = REPO / repo_target
        if not full.exists():  # left as it is: the build reports it
            return match.group(0)
        if full.is_dir():
            if (full / "README.md").is_file():
                repo_target = f"{repo_target}/README.md"
            elif (full / "report.md").is_file():  # a sweep's report
                repo_target = f"{repo_target}/report.md"
            elif site_path(repo_target) is not None:
                listing = f"{site_path(repo_target)}/index.md"
                listings[listing] = sorted(p.name + ("/" if p.is_dir() else "") for p in full.iterdir())
                return f"{label}({posixpath.relpath(listing, at)}{hash_}{fragment})"
        page = site_path(repo_target)
        if page is None:  # a file with no page on the site (code, a config): its path, as code
            shown = label[1:-1]
            return shown if f"`{repo_target}`" in shown else f"{shown} (`{repo_target}`)"
        return f"{label}({posixpath.relpath(page, at)}{hash_}{fragment})"

    return LINK.sub(one, text)


def listing_page(site_dir: str, entries: list[str]) -> str:
    """A page listing a copied folder that has no README.md of its own: its files linked, its folders named."""
    folder = REPO / "experiments" / site_dir[len("results/"):]
    items = []
    for entry in entries:
        if not entry.endswith("/"):
            items.append(f"- [{entry}]({entry})")
        elif (folder / entry / "README.md").is_file():
            items.append(f"- [{entry}]({entry}README.md)")
        elif (folder / entry / "report.md").is_file():
            items.append(f"- [{entry}]({entry}report.md)")
        else:
            items.append(f"- `{entry}`")
    return "\n".join([f"# {site_dir}/", "", "The files of this folder:", "", *items, ""])


def on_page_markdown(markdown: str, page, config, files) -> str:
    """The pages written in docs/ may link to any file of the repository, as they read on GitHub; on the site such a
    link goes to the file's page (the results) or becomes its path."""
    if page.file.generated_by is not None:  # copied or generated here, its links already rewritten
        return markdown
    listings: dict[str, list[str]] = {}
    text = rewrite_links(markdown, f"docs/{page.file.src_uri}", listings)
    if listings:
        raise ValueError(f"docs/{page.file.src_uri} links to a folder with no README.md or report.md: "
                         f"{', '.join(listings)}; link a file")
    return text


def on_files(files: Files, config) -> Files:
    listings: dict[str, list[str]] = {}
    for uri, text in reference.pages().items():
        files.append(File.generated(config, uri, content=text))
    for repo_file, uri in ROOT_PAGES.items():
        if repo_file != "README.md" and (REPO / repo_file).is_file():
            text = rewrite_links((REPO / repo_file).read_text(), repo_file, listings)
            files.append(File.generated(config, uri, content=text))
    for folder in COPIED:
        for path in sorted((REPO / folder).rglob("*")):
            if not path.is_file():
                continue
            repo_file = path.relative_to(REPO).as_posix()
            uri = site_path(repo_file)
            if path.suffix == ".md":
                text = rewrite_links(path.read_text(), repo_file, listings)
                files.append(File.generated(config, uri, content=text))
            else:
                files.append(File.generated(config, uri, abs_src_path=os.fspath(path)))
    for site_dir_index, entries in listings.items():
        if files.get_file_from_path(site_dir_index) is None:
            files.append(File.generated(config, site_dir_index,
                                        content=listing_page(posixpath.dirname(site_dir_index), entries)))
    return files
