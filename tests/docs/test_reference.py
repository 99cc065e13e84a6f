"""The documentation site's reference pages (docs/hooks/reference.py, generated from the registries when the site is
built): every entry of every registry has its entry there, with its knobs, its logged names or its options, so that a
component, metric, evaluation, cache policy, model source, config key, config group option or command without a
reference entry fails here."""
from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest

from tests.helpers import REPO

HOOKS = REPO / "docs" / "hooks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"sinklab_docs_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return load("reference")


@pytest.fixture(scope="module")
def pages(reference):
    return reference.pages()


def section(page: str, heading: str) -> str:
    """The text of `page` from the line starting with `heading` to the next heading of the same level or above."""
    start = page.index("\n" + heading) + 1
    level = len(heading) - len(heading.lstrip("#"))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(page, start + len(heading))
    return page[start:end.start() if end else len(page)]


def missing_entries(pages: dict[str, str], reference) -> list[str]:
    """What the registries hold that the pages do not: one line per missing entry."""
    from sinklab.cli import commands
    from sinklab.config import CONF_DIR
    from sinklab.evals import EVALUATIONS
    from sinklab.metrics import METRICS
    from sinklab.model import FAMILIES
    from sinklab.model.cache_policies import CACHE_POLICIES, knob_defaults
    from sinklab.model.config import KNOBS, BaseModelConfig
    from sinklab.targets import SOURCES

    missing = []
    components = pages["reference/components.md"]
    for registry in FAMILIES:
        for cls in registry:
            heading = f"### `{cls.name}` {{#{reference.anchor(registry.key, cls.name)}}}"
            if "\n" + heading not in components:
                missing.append(f"component model.{registry.key}={cls.name}")
                continue
            text = section(components, heading)
            missing += [f"knob model.{knob} of model.{registry.key}={cls.name}"
                        for knob, (_, owners) in KNOBS.items() if cls in owners and f"`model.{knob}`" not in text]
    config = pages["reference/configuration.md"]
    missing += [f"model.{f.name}" for f in dataclasses.fields(BaseModelConfig) if f"`model.{f.name}`" not in config]
    for group, name, node in reference._stored_schemas():
        if isinstance(node, type) and getattr(node, "KEY", ""):
            missing += [f"{node.KEY}.{f.name} ({group}/{name})" for f in dataclasses.fields(node)
                        if not f.name.startswith("_") and f"`{node.KEY}.{f.name}`" not in config]
    for path in CONF_DIR.rglob("*.yaml"):
        option = f"{path.parent.relative_to(CONF_DIR).as_posix()}={path.stem}"
        if path.parent != CONF_DIR and f"| `{option}` |" not in config:
            missing.append(f"config group option {option}")
    # the metrics with the names they log, the cache policies with their knobs, the sources with their classes:
    # each under a heading of its name
    named = (("metric", pages["reference/metrics.md"],
              {cls.name: [f"`{pattern}`" for pattern, _ in cls.bounds] for cls in METRICS}),
             ("cache policy", pages["reference/cache-policies.md"],
              {cls.name: [f"`{p}`" for p in knob_defaults(cls)] for cls in CACHE_POLICIES}),
             ("model source", pages["reference/sources.md"],
              {cls.source: [f"`{cls.__name__}`"] for cls in SOURCES}))
    for what, page, entries in named:
        for name, needles in entries.items():
            heading = f"## `{name}`"
            if "\n" + heading not in page:
                missing.append(f"{what} {name}")
                continue
            text = section(page, heading)
            missing += [f"{what} {name}: {needle}" for needle in needles if needle not in text]
    evaluations, cli = pages["reference/evaluations.md"], pages["reference/cli.md"]
    for evaluation in EVALUATIONS:
        if f"\n## `sinklab eval {evaluation.name}`" not in evaluations:
            missing.append(f"evaluation {evaluation.name}")
        heading = f"### `sinklab eval {evaluation.name}`"
        if "\n" + heading not in cli or "usage: " not in section(cli, heading):
            missing.append(f"sinklab eval {evaluation.name} --help")
    missing += [f"sinklab {name} --help" for name in commands() if f"\n## `sinklab {name}`" not in cli
                or f"usage: sinklab {name}" not in section(cli, f"## `sinklab {name}`")]
    return missing


def test_every_registry_entry_has_its_reference_entry(pages, reference):
    assert set(pages) == set(reference.PAGES)
    assert missing_entries(pages, reference) == []


def test_an_entry_registered_after_the_pages_were_made_is_missing_until_they_are_made_again(pages, reference):
    """The check fails on an entry the pages lack (here a cache policy registered after they were generated), and a
    new build lists it: the pages come from the registry, not from a list kept by hand."""
    from sinklab.model.cache_policies import CACHE_POLICIES, CachePolicy

    @CACHE_POLICIES.register("docs_probe")
    class DocsProbe(CachePolicy):
        """Keeps the keys a documentation test names."""

        def __init__(self, budget: int, probe_knob: float = 0.25):
            super().__init__(budget)

    try:
        assert missing_entries(pages, reference) == ["cache policy docs_probe"]
        again = dict(pages, **{"reference/cache-policies.md": reference.cache_policies_page()})
        assert missing_entries(again, reference) == []
        assert "`probe_knob` = `0.25`" in section(again["reference/cache-policies.md"], "## `docs_probe`")
    finally:
        CACHE_POLICIES._classes.pop("docs_probe")


def test_a_source_registered_after_the_pages_were_made_is_missing_until_they_are_made_again(pages, reference):
    from sinklab.targets import SOURCES, SinklabTarget

    @SOURCES.register("docs_probe")
    class DocsProbeTarget(SinklabTarget):
        """Loads the models a documentation test names."""

    try:
        assert missing_entries(pages, reference) == ["model source docs_probe"]
        again = dict(pages, **{"reference/sources.md": reference.sources_page()})
        assert missing_entries(again, reference) == []
        assert "Loads the models a documentation test names." in section(again["reference/sources.md"],
                                                                         "## `docs_probe`")
    finally:
        SOURCES._classes.pop("docs_probe")


def test_a_knob_is_listed_with_its_default_and_the_comment_beside_it(reference):
    @dataclasses.dataclass
    class Knobs:
        # sizes
        width: int = 4  # the width
        depth: int = 2
        # the share kept, a long comment
        # on two lines
        share: float = 0.5

        alpha: float = dataclasses.field(default=1.0, metadata={"why": "(a reason)"})

    rows = reference.fields_table(Knobs, "model.")
    assert rows[2:] == ["| **sizes** | | |", "| `model.width` | `4` | the width |", "| `model.depth` | `2` |  |",
                        "| `model.share` | `0.5` | the share kept, a long comment on two lines |",
                        "| `model.alpha` | `1.0` | (a reason) |"]

