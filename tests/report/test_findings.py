"""The committed reports of experiments/cpu/findings regenerate: where a report's sweeps are archived beside it (its
`runs/`, without their weights: findings/issue38/README.md), `sinklab report` on them, several sweep dirs as one, gives
the jobs and the claims' verdicts its committed report_claims.csv holds."""
import pandas as pd
import pytest

from sinklab import report
from tests.helpers import REPO

FINDINGS = REPO / "experiments" / "cpu" / "findings"
ARCHIVED = sorted(p.parent for p in FINDINGS.glob("*/*/runs") if (p.parent / "report_claims.csv").is_file())


def test_there_are_archived_reports():
    assert {p.name for p in ARCHIVED} >= {"retrieval_128", "retrieval_warm"}


@pytest.mark.parametrize("folder", ARCHIVED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_committed_report_regenerates_from_its_archived_sweeps(folder, tmp_path):
    sweeps = sorted(p for p in (folder / "runs").iterdir() if (p / "multirun.yaml").is_file())
    res = report.build_report(sweeps, tmp_path)
    committed = pd.read_csv(folder / "report_claims.csv", dtype=str, keep_default_na=False)
    again = pd.read_csv(res["claims_csv"], dtype=str, keep_default_na=False)
    assert again[["claim", "verdict", "pairs", "claimed_sign"]].equals(
        committed[["claim", "verdict", "pairs", "claimed_sign"]])
    for was, now in zip(committed["diff_mean"], again["diff_mean"]):
        assert (was == now == "") or float(now) == pytest.approx(float(was), rel=1e-9, abs=1e-12)
    jobs = pd.read_csv(folder / "report.csv", dtype=str, keep_default_na=False)
    assert sorted(jobs["job"]) == sorted(r["job"] for r in res["rows"]) and set(jobs["status"]) == {"completed"}
