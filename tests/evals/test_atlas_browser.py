"""The attention atlas in a real headless browser: Debian's Chromium driven by playwright (`pip install
sinklab[browser]`, `apt-get install chromium`; playwright's own browser download is not needed). The page of a short
training run's kept checkpoints opens from a file:// URL with no console error; a click on a thumbnail opens that
head, the slider changes the checkpoint drawn, the dropdown recolours the grid; a screenshot is taken. Marked
`browser` (and `slow`): `.ci/run` runs `pytest -m browser` and fails if it is skipped."""
from __future__ import annotations

import shutil

import pytest

from sinklab.analysis.atlas import read_page_data
from tests.helpers import run_cli

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def browser():
    """Chromium from the system (Debian's package), launched by playwright."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install "
                                                                 "'sinklab[browser]'")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH: apt-get install chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        yield browser
        browser.close()


def test_the_atlas_opens_and_answers_clicks_and_the_slider(trained_run, browser, tmp_path):
    page_path = tmp_path / "atlas.html"
    run_cli("sinklab", "atlas", str(trained_run), "--out", str(page_path), "--num-seqs", "20", check=True)
    data = read_page_data(page_path.read_text(encoding="utf-8"))
    labels = [f["label"] for f in data["frames"]]
    assert len(labels) == 7 and labels[0] == "step 16 (16,384 tokens)" and labels[-1].startswith("step 120 ")

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.on("request", lambda r: problems.append(f"request {r.url}") if not r.url.startswith(("file:", "data:"))
            else None)
    page.goto(page_path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=20_000)

    def title() -> str:
        return page.inner_text("#detail-title")

    def big_map() -> str:
        return page.evaluate("document.getElementById('big').toDataURL()")

    # opened at the last checkpoint, head (0, 0); one thumbnail per head, each with its alpha_1
    assert title() == f"layer 0, head 0 · {labels[-1]}"
    assert page.locator("td.cell").count() == data["n_layer"] * data["n_head"] == 2 * 8
    alpha = data["frames"][-1]["values"]["sink/alpha"]
    assert float(page.inner_text("#cell-1-5 span")) == pytest.approx(alpha[1][5], rel=5e-3)
    first = big_map()

    page.click("#cell-1-5")  # a click opens that head
    page.wait_for_function("document.getElementById('big').dataset.head === '1-5'")
    assert title() == f"layer 1, head 5 · {labels[-1]}"
    assert page.get_attribute("#cell-1-5", "class") == "cell selected"
    at_last = big_map()
    assert at_last != first

    page.fill("#ckpt", "0")  # the slider to the first kept checkpoint: the same head, another map
    page.wait_for_function("document.getElementById('big').dataset.frame === '0'")
    assert title() == f"layer 1, head 5 · {labels[0]}"
    assert page.inner_text("#ckpt-label") == f"{labels[0]} (1 of 7)"
    assert big_map() != at_last
    alpha0 = data["frames"][0]["values"]["sink/alpha"]
    assert float(page.inner_text("#cell-1-5 span")) == pytest.approx(alpha0[1][5], rel=5e-3)

    page.select_option("#metric", "entropy")  # the dropdown recolours the grid by another per-head value
    page.wait_for_function("document.querySelector('#values tr.shown td').textContent === 'entropy'")
    entropy = data["frames"][0]["values"]["entropy"]
    assert float(page.inner_text("#cell-0-0 span")) == pytest.approx(entropy[0][0], rel=5e-3)

    shot = tmp_path / "atlas.png"
    page.screenshot(path=str(shot), full_page=True)
    from PIL import Image

    with Image.open(shot) as img:
        assert img.width >= 1000 and len(img.convert("RGB").getcolors(1 << 20) or []) > 100  # drawn, not blank
    page.close()
    assert not problems, problems


def test_text_that_could_end_the_script_stays_data(trained_run, browser, tmp_path):
    """A run whose path holds `<!--<script>`, `</script>`, `&`, U+2028 and U+2029, and its export read with a text
    holding them (so its tokens' texts do): each page still draws every head, its title shows the path as written,
    and the token texts come back whole (the inline JSON escapes `<`, `>`, `&`, U+2028 and U+2029)."""
    import shutil

    nasty = "<!--<script>x</script>&\u2028\u2029"
    run = tmp_path / nasty / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("kept", "*.html", "*.png", "wandb"))
    run_cli("sinklab", "export-hf", str(run), str(tmp_path / nasty / "hf"), "--no-check", check=True)
    text = tmp_path / "nasty.txt"
    text.write_text(f"ROMEO: {nasty} <!-- a comment? --> & </script> more words\n" * 20, encoding="utf-8")
    pages = {"run": ["atlas", str(run), "--last", "--num-seqs", "2"],
             "hf": ["atlas", "--hf-model", str(tmp_path / nasty / "hf"), "--text", str(text), "--seq-len", "24",
                    "--num-seqs", "2"]}
    for name, args in pages.items():
        page_path = tmp_path / f"{name}.html"
        run_cli("sinklab", *args, "--out", str(page_path), check=True)
        html = page_path.read_text(encoding="utf-8")
        start = html.index('<script id="atlas-data"')
        inline = html[html.index(">", start) + 1:html.index("</script>", start)]
        assert not any(c in inline for c in "<>&\u2028\u2029"), name
        data = read_page_data(html)
        assert nasty in data["title"] or any(nasty in str(f["where"]) for f in data["frames"]), name
        if name == "hf":
            assert any("<" in k for k in data["keys"]) and any(">" in k for k in data["keys"])

        page = browser.new_page(viewport={"width": 1200, "height": 900})
        problems: list[str] = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
                else None)
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        page.goto(page_path.as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=20_000)
        assert page.locator("td.cell").count() == data["n_layer"] * data["n_head"], name
        assert page.inner_text("#title") == "attention atlas: " + data["title"], name
        assert page.evaluate("DATA.keys") == data["keys"], name
        page.close()
        assert not problems, (name, problems)
