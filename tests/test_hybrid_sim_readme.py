"""The README's hybrid preset table is the one bench/routines/hybrid_sim.py makes from the
result JSON the README cites (re-run the routine and paste its table when it changes), and the
targets it states are the JSON's."""

import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CITED = re.compile(r"bench/results/(2\d{3}-\d{2}-\d{2}_[0-9a-f]+_[A-Za-z0-9-]+)/hybrid_sim\.json")


def _routine():
    spec = importlib.util.spec_from_file_location(
        "hybrid_sim_routine", REPO / "bench" / "routines" / "hybrid_sim.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cited_result() -> dict:
    folders = set(CITED.findall(README))
    assert len(folders) == 1, f"the README should cite one hybrid_sim.json, found {folders}"
    return json.loads((REPO / "bench" / "results" / folders.pop() / "hybrid_sim.json").read_text())


def test_the_readme_table_is_generated_from_the_cited_json():
    table = _routine().readme_table(_cited_result())
    assert table in README, "README.md's hybrid table differs from the cited JSON's:\n" + table


def test_the_readme_prefix_scheme_table_is_generated_from_the_cited_json():
    table = _routine().prefix_scheme_table(_cited_result())
    assert table in README, "README.md's prefix-caching scheme table differs:\n" + table


def test_the_readme_states_each_target_as_the_json_judged_it():
    data = _cited_result()
    text = " ".join(README.split())  # the README wraps its sentences
    for name, target in data["targets"].items():
        if target["met"] is None:
            assert "not run" in text
        else:
            verdict = "met" if target["met"] else "missed"
            assert f"{name}: {verdict}" in text, f"README should say '{name}: {verdict}'"
