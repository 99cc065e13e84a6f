"""A malformed claim (sinklab.config.claims) is one line naming the key; the presets' own claims are checked against
their sweeps with the other preset tests (tests/config/test_experiments.py, which composes each preset once)."""
import pytest

from sinklab.config.claims import parse_claims
from sinklab.errors import UserError
from tests.helpers import assert_one_line_error

CLAIM = {"id": "a", "setting": {"model/gate": "elementwise"}, "metric": "sink/sink1", "direction": "lower"}


@pytest.mark.parametrize("exp, message", [
    ({"claims": [CLAIM]}, "experiment.claims[0] (a) has no baseline; allowed: experiment.baseline or the claim's own"),
    ({"baseline": {"model/gate": "none"}, "claims": [CLAIM, CLAIM]}, "the id 'a' is taken by an earlier claim"),
    ({"baseline": {"model/gate": "none"}, "claims": [{**CLAIM, "requires": {"metric": "sink/sink1"}}]},
     "experiment.claims[0] (a).requires has neither above nor below"),
    ({"baseline": {"model/gate": "none"}, "claims": [{**CLAIM, "requires": {"abov": 3}}]},
     "experiment.claims[0] (a).requires.abov is not an option of experiment.claims[0] (a).requires (did you mean"),
    ({"baseline": {"model/gate": "none"}, "claims": [{**CLAIM, "requires": {"above": 3, "of": "treated"}}]},
     "experiment.claims[0] (a).requires.of='treated' is not allowed; allowed: baseline, setting, both"),
    ({"baseline": "none", "claims": [CLAIM]}, "experiment.baseline='none' is not allowed; allowed: a mapping"),
    ({"baseline": {"model/gate": "none"}, "claims": {"a": CLAIM}}, "experiment.claims={'a': "),
])
def test_malformed_claims_are_one_line(exp, message):
    with pytest.raises(UserError) as err:
        parse_claims(exp)
    assert_one_line_error(err, message)
