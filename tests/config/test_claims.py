"""The claims of the experiment presets (sinklab.config.claims): well formed, and naming settings their sweeps run."""
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from sinklab.config import CONF_DIR, compose
from sinklab.config.claims import parse_claims
from sinklab.errors import UserError
from sinklab.report.paper import values_match

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
# the presets of other papers' claims state them (issue 28)
WITH_CLAIMS = {"gate_positions", "outliers_quant", "residual_sinks", "sink_uses", "value_gates", "diff_attention",
               "muon", "qk_norm", "layer_patterns"}


def preset(name):
    cfg = compose([f"experiment={name}"], return_hydra_config=True)
    exp = OmegaConf.to_container(OmegaConf.masked_copy(cfg.experiment, [k for k in ("baseline", "claims")
                                                                         if k in cfg.experiment]))
    params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=False) or {}
    parser = OverridesParser.create()
    values = {k: list(parser.parse_override(f"{k}={v}").sweep_iterator()) for k, v in params.items()}
    return exp, values


@pytest.mark.parametrize("name", PRESETS)
def test_claims_name_settings_of_the_preset_sweep(name):
    exp, values = preset(name)
    baseline, claims = parse_claims(exp)
    assert bool(claims) == (name in WITH_CLAIMS)
    for claim in claims:
        assert claim.text, claim.id
        for setting in (claim.treated, claim.partner):
            for key, value in setting.items():
                assert key in values, f"{name}: claim {claim.id} names {key}, which the preset does not sweep"
                assert any(values_match(value, v) for v in values[key]), \
                    f"{name}: claim {claim.id}: {key}={value} is not one of the sweep's values {values[key]}"


CLAIM = {"id": "a", "setting": {"model/gate": "elementwise"}, "metric": "sink/sink1", "direction": "lower"}


@pytest.mark.parametrize("exp, message", [
    ({"claims": [CLAIM]}, "experiment.claims[0] (a) has no baseline; allowed: experiment.baseline or the claim's own"),
    ({"baseline": {"model/gate": "none"}, "claims": [CLAIM, CLAIM]}, "the id 'a' is taken by an earlier claim"),
    ({"baseline": {"model/gate": "none"}, "claims": [{**CLAIM, "requires": {"metric": "sink/sink1"}}]},
     "experiment.claims[0] (a).requires has neither above nor below"),
    ({"baseline": {"model/gate": "none"}, "claims": [{**CLAIM, "requires": {"abov": 3}}]},
     "experiment.claims[0] (a).requires.abov is not an option of experiment.claims[0] (a).requires (did you mean"),
    ({"baseline": "none", "claims": [CLAIM]}, "experiment.baseline='none' is not allowed; allowed: a mapping"),
    ({"baseline": {"model/gate": "none"}, "claims": {"a": CLAIM}}, "experiment.claims={'a': "),
])
def test_malformed_claims_are_one_line(exp, message):
    with pytest.raises(UserError) as err:
        parse_claims(exp)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
