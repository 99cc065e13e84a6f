#!/usr/bin/env python
"""A screenshot of an atlas page (sinklab atlas ... --out PAGE.html) in headless Chromium, as the docs show it.

    python scripts/atlas_screenshot.py PAGE.html OUT.png [--width 1400] [--head LAYER-HEAD]

Needs the `browser` extra (playwright) and Debian's chromium (the browser test's setup); the page draws itself from
its inline data (body[data-ready='1']) before the picture is taken; --head opens that head's map first.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page")
    ap.add_argument("out")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--head", default=None, help="LAYER-HEAD to open, e.g. 11-3")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": args.width, "height": 1000})
        page.goto(Path(args.page).resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        if args.head:
            page.click(f"#cell-{args.head}")
            page.wait_for_function(f"document.getElementById('big').dataset.head === '{args.head}'")
        page.screenshot(path=args.out, full_page=True)
        browser.close()
    print(args.out)


if __name__ == "__main__":
    main()
