"""The contract every registered metric passes, as plain checks (an AssertionError says what broke).

tests/metrics/test_metric_contracts.py runs them over every registered metric, and `sinklab check-component MODULE` over
the metrics of a user's module: every value it logs has physical bounds and lies within them on the random models of
SWITCHES (one per component that changes what a metric is given, and per mask); the hooked, streamed value (batches
of 2 sequences, maps in chunks of 7 query rows, one layer at a time) equals the direct computation (every sequence at
once, every layer's whole explicit map from one forward); it records only what it declares, and its JSON part is
strict JSON under its own key.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable, Iterator, Optional, Sequence

import torch

from sinklab.metrics.base import bounds
from sinklab.metrics import METRICS, SinklabRecorder, attention_maps, measure_all
from sinklab.metrics.record import feed_maps

from sinklab.model import FAMILIES, ModelConfig

from .component_checks import MASK_FAMILIES, MASKS, case_id, component_cases, small_model, token_ids

# the families whose components change what a metric is given, beyond the values: the map (positions' logit biases,
# operations' normalisation and sign, the bias slot) and the records (a gate's scores, the extra keys' values);
# norms, FFNs, block layouts and QK norms change the values only
METRIC_FAMILIES = (*MASK_FAMILIES, "gate")


def switches() -> dict[str, dict]:
    """The random models (overrides of component_checks.SMALL, by name) every metric's contract runs on, derived from
    the registries: the default model, the default model under each mask but the causal one (a prefix, a window,
    learned sink tokens), and one model per registered sinklab component of METRIC_FAMILIES other than the default,
    with its knobs' defaults (sigmoid's unnormalised rows, differential attention's negative entries, a K/V bias
    slot, a gate's scores, ...). A plugin's components are left out: a metric is checked on the same models wherever
    it is checked, and a component by its own contract."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    out = {"default": {}, **{name: mask for name, mask in MASKS.items() if mask}}
    for family in FAMILIES:
        if family.key not in METRIC_FAMILIES:
            continue
        for cls in family:
            if cls.__module__.startswith("sinklab."):
                case = {k: v for k, v in component_cases([cls])[0].items() if k == family.key or v != defaults[k]}
                if case[family.key] != defaults[family.key]:
                    out[case_id(case)] = case
    return out


SWITCHES = switches()


def logged(model, tokens, names=None, batch_size=2, chunk=7, target_cls=SinklabRecorder) -> dict[str, dict]:
    """Each metric's logged values (metrics `names`, default every registered one that applies)."""
    target = target_cls(model, chunk)
    metrics = METRICS.build(target.context(eps=[0.3, 0.5], k=3), names)
    measure_all(target, tokens, metrics, batch_size=batch_size)
    return {m.name: m.log(m.result()) for m in metrics}


class DirectTarget(SinklabRecorder):
    """Every recorded tensor of the whole input at once, and each layer's whole map from `attention_maps` (one
    forward through the explicit maps): what the streamed route must equal."""

    def run(self, idx, metrics):
        S, n_slots = self.model.cfg.n_sink_tokens, self.model.cfg.n_slots
        layers: dict[int, dict] = {}
        names = set().union(*(m.records for m in metrics)) - {"maps"}
        with self.hooks(names, lambda i, rec: layers.__setitem__(i, rec)):
            self.model(idx)
        maps = attention_maps(self.model, idx)
        for i in sorted(layers):
            for m in metrics:
                m.update(i, {n: layers[i][n] for n in m.records if n in layers[i]})
            rows = torch.arange(idx.shape[1])
            whole = maps[i][:, :, S:]  # (B, H, T, n_slots + S + T): the real queries, every key
            assert whole.shape[-1] == n_slots + S + idx.shape[1]
            feed_maps(metrics, i, lambda whole=whole: [(rows, whole)])


def assert_within_bounds(values: dict[str, float], where: str) -> None:
    for name, value in values.items():
        limits = bounds(name)
        assert limits is not None, f"{where}: {name} has no bounds (declare them in its metric's `bounds`)"
        assert math.isfinite(value) and limits[0] - 1e-9 <= value <= limits[1] + 1e-9, \
            f"{where}: {name}={value} is outside its bounds {limits}"


def applicable(switch: str, names: Optional[Sequence[str]] = None) -> set[str]:
    ctx = SinklabRecorder(small_model(**SWITCHES[switch])).context()
    return {n for n in (names or METRICS.names()) if METRICS.get(n).applies(ctx)}


def within_bounds_on_a_random_model(switch: str, names: Optional[Sequence[str]] = None) -> None:
    values = logged(small_model(**SWITCHES[switch]), token_ids(B=5, T=24, seed=2), names)
    assert set(values) == applicable(switch, names), f"metrics measured: {sorted(values)}"
    for name, logs in values.items():
        assert_within_bounds(logs, f"{name} on {switch}")
        assert logs or name == "gates" and SWITCHES[switch].get("gate", "none") == "none", \
            f"{name} logged nothing on {switch}"


def streamed_equals_direct(switch: str, names: Optional[Sequence[str]] = None) -> None:
    m = small_model(**SWITCHES[switch])
    tokens = token_ids(B=5, T=24, seed=3)
    streamed = logged(m, tokens, names, batch_size=2, chunk=7)
    direct = logged(m, tokens, names, batch_size=5, target_cls=DirectTarget)
    assert streamed.keys() == direct.keys()
    for name in streamed:
        assert streamed[name].keys() == direct[name].keys(), f"{name} logs other keys when streamed"
        for key, value in direct[name].items():
            assert math.isclose(streamed[name][key], value, rel_tol=1e-5, abs_tol=1e-6), \
                f"{key}: streamed {streamed[name][key]} != direct {value}"


# the models a metric's records and JSON are checked on: the first it applies to (a gate's scores and a bias slot's
# values recorded; the window for a metric of sparse attention only, a Gated DeltaNet layer for one of recurrent layers)
RECORDS_CASES = ({"gate": "elementwise", "attn_bias": "k"}, {"gate": "elementwise", "attn_bias": "k", "window": 5},
                 {"gate": "elementwise", "layer_pattern": "GK", "pattern_ops": "K:gated_deltanet"})


def records_only_what_it_declares_and_writes_strict_json(name: str) -> None:
    cls = METRICS.get(name)
    models = (small_model(**case) for case in RECORDS_CASES)
    m = next((m for m in models if cls.applies(SinklabRecorder(m).context())), None)
    assert m is not None, f"{name} applies to none of the models {RECORDS_CASES}"
    target = SinklabRecorder(m)
    (metric,) = METRICS.build(target.context(), [name])
    seen: list[set] = []
    update = metric.update
    metric.update = lambda layer, rec: (seen.append(set(rec)), update(layer, rec))[1]
    measure_all(target, token_ids(B=3, T=24), [metric], batch_size=2)
    assert all(s <= set(cls.records) - {"maps"} for s in seen), f"{name} was given more than its records"
    json.dumps(metric.json(metric.result()), allow_nan=False)
    assert cls.json_key not in ("target", "source", "model", "input", "seconds"), f"json_key {cls.json_key!r}"


def runs(cls: type) -> Iterator[tuple[str, Callable[[], None]]]:
    """(what, a call running one check) for every contract check of one registered metric class."""
    for switch in SWITCHES:
        if cls.name in applicable(switch, [cls.name]):
            yield f"within its bounds on a random model: metric {cls.name} [{switch}]", \
                (lambda s=switch: within_bounds_on_a_random_model(s, [cls.name]))
            yield f"streamed value equals the direct computation: metric {cls.name} [{switch}]", \
                (lambda s=switch: streamed_equals_direct(s, [cls.name]))
    yield f"records only what it declares, strict JSON: metric {cls.name}", \
        lambda: records_only_what_it_declares_and_writes_strict_json(cls.name)
