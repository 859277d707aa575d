"""The run report (server_kit.report) on a synthetic orchestrator result: fields, values, files, page."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from server_kit.report import (
    DEFINITIONS,
    accuracy_per_cluster_per_round,
    accuracy_per_round,
    build_results,
    clustering_against_truth,
    load_truth,
    plot_threshold_search,
    write_report,
)

PNG = b"\x89PNG\r\n\x1a\n"


def _round(rnd, acc, per_model):
    return {"round": rnd, "tasked": 4, "updates": 4, "missing": [], "acc_before": acc,
            "acc_before_per_model": per_model, "loss": 1.0 / rnd, "model_bytes_delivered": 1000 * rnd,
            "clipped": 0, "refused_norm": 0, "summary": {"updates": 4}, "seconds": 0.5}


def synthetic_result(*, refusals=True):
    """What Orchestrator.run returns for 3 rounds of 2 clusters (c0: a, b; c1: c, d, h)."""
    result = {
        "strategy": "fedsketch",
        "assignment": {"a": 0, "b": 0, "c": 1, "d": 1, "h": 1},
        "history": [_round(1, 0.1, {"c0": 0.1, "c1": 0.1}),
                    _round(2, 0.6, {"c0": 0.5, "c1": 0.7}),
                    _round(3, 0.85, {"c0": 0.8, "c1": 0.9})],
        "final": {"accuracy": 0.9, "per_client": {"a": 0.85, "b": 0.85, "c": 0.95, "d": 0.95},
                  "per_model": {"c0": 0.85, "c1": 0.95},
                  "model_per_client": {"a": "c0", "b": "c0", "c": "c1", "d": "c1"}},
        "timings": {"register_s": 1.0, "training_s": 5.0, "total_s": 7.5},
        "rejected": {"stale-update": 2},
        "transport": {"sent": {"CMD": {"messages": 20, "bytes": 4000, "chunks": 0},
                               "MODEL": {"messages": 10, "bytes": 60000, "chunks": 0}},
                      "received": {"HELLO": {"messages": 5, "bytes": 900, "chunks": 0},
                                   "UPDATE": {"messages": 12, "bytes": 70000, "chunks": 0}},
                      "rejected": {}, "errors": {}, "chunks": {}},
        "delivered": {"MODEL": 55000},
        "pretrain": [],
        "encoder": "digits_encoder",
    }
    if refusals:
        result["refused"] = {"e": "its samples hold 784 values; the run's models take 64 <b>"}
        result["dropped"] = {"f": "offline for 3 rounds"}
    return result


def test_accuracy_series_follow_the_demo_definition():
    result = synthetic_result()
    # after round r = what round r+1 measured before training; the last from the final evaluation
    assert accuracy_per_round(result) == [0.6, 0.85, 0.9]
    assert accuracy_per_cluster_per_round(result) == {"c0": [0.5, 0.8, 0.85], "c1": [0.7, 0.9, 0.95]}
    # a round without per-model numbers (a checkpoint of an older server) gives None there
    del result["history"][1]["acc_before_per_model"]
    assert accuracy_per_cluster_per_round(result) == {"c0": [None, 0.8, 0.85], "c1": [None, 0.9, 0.95]}
    result["final"]["accuracy"] = None
    assert accuracy_per_round(result)[-1] is None


def test_results_hold_the_derived_measures_and_their_definitions():
    result = synthetic_result()
    out = build_results(result, target_accuracy=0.8)
    for key, value in result.items():
        assert out[key] == value, key
    assert out["clients"] == 5 and out["rounds"] == 3
    assert out["accuracy_per_round"] == [0.6, 0.85, 0.9]
    assert out["accuracy_per_cluster_per_round"] == {"c0": [0.5, 0.8, 0.85], "c1": [0.7, 0.9, 0.95]}
    assert out["final_accuracy"] == pytest.approx((0.6 + 0.85 + 0.9) / 3)
    assert out["final_evaluation"] == {"mean": 0.9, "per_cluster": {"c0": 0.85, "c1": 0.95}}
    assert out["target_accuracy"] == 0.8 and out["rounds_to_target"] == 2
    assert out["bytes"] == {"sent_by_server": result["transport"]["sent"],
                            "received_by_server": result["transport"]["received"],
                            "downloaded_by_devices": {"MODEL": 55000}}
    assert out["refused"] == result["refused"] and out["dropped"] == result["dropped"]
    assert "clustering" not in out
    assert out["definitions"] == {k: DEFINITIONS[k] for k in (
        "accuracy_per_round", "accuracy_per_cluster_per_round", "final_accuracy", "final_evaluation",
        "rounds_to_target", "bytes", "refused", "dropped")}
    assert build_results(result, target_accuracy=0.95)["rounds_to_target"] is None
    bare = build_results(synthetic_result(refusals=False))
    assert "refused" not in bare and "dropped" not in bare
    assert "refused" not in bare["definitions"]


def test_final_accuracy_is_the_mean_of_the_last_five_rounds():
    result = synthetic_result()
    result["history"] = [_round(r, a, {}) for r, a in enumerate([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], start=1)]
    out = build_results(result)
    assert out["accuracy_per_round"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.9]
    assert out["final_accuracy"] == pytest.approx((0.3 + 0.4 + 0.5 + 0.6 + 0.9) / 5)


def test_clustering_against_truth_scores_the_common_clients_and_lists_the_rest():
    from sklearn.metrics import adjusted_mutual_info_score, adjusted_rand_score

    truth = {"a": "x", "b": "x", "c": "y", "d": "z", "g": "y"}
    scores = clustering_against_truth({"a": 0, "b": 0, "c": 1, "d": 1, "h": 1}, truth)
    t, p = ["x", "x", "y", "z"], [0, 0, 1, 1]
    assert scores["ari"] == pytest.approx(adjusted_rand_score(t, p))
    assert scores["ami"] == pytest.approx(adjusted_mutual_info_score(t, p))
    assert scores["completeness"] == pytest.approx(1.0)  # each true group lies in one cluster
    assert scores["homogeneity"] < 1.0  # cluster 1 mixes y and z
    assert scores["clients_scored"] == 4
    assert scores["missing_from_truth"] == ["h"] and scores["missing_from_assignment"] == ["g"]
    perfect = clustering_against_truth({"a": 0, "b": 0, "c": 1}, {"a": 7, "b": 7, "c": 3})
    assert perfect["ari"] == pytest.approx(1.0) and perfect["homogeneity"] == pytest.approx(1.0)
    none = clustering_against_truth({"a": 0}, {"b": 1})
    assert none["ari"] is None and none["clients_scored"] == 0


def test_load_truth_refuses_what_is_not_an_object_of_groups(tmp_path):
    good = tmp_path / "truth.json"
    good.write_text(json.dumps({"c000": 0, "c001": "rot90"}))
    assert load_truth(good) == {"c000": 0, "c001": "rot90"}
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"expected a JSON object client id -> group, got list$"):
        load_truth(listed)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"c000": [1], "c001": True, "c002": 1}))
    with pytest.raises(ValueError, match=r"groups must be strings or integers; not so for \['c000', 'c001'\]$"):
        load_truth(odd)
    with pytest.raises(ValueError, match=r"^--truth .*missing\.json: cannot read it: "):
        load_truth(tmp_path / "missing.json")


def _referenced(page: str) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]*)"', page)


def test_report_folder_has_every_file_and_the_page_names_only_existing_ones(tmp_path):
    (tmp_path / "threshold_search.png").write_bytes(PNG)  # left over from another run: not this run's
    results = build_results(synthetic_result(), truth={"a": 0, "b": 0, "c": 1, "d": 1})
    files = write_report(tmp_path, results)
    assert sorted(files) == ["accuracy.png", "bytes.png", "report.html", "results.json"]
    for name, path in files.items():
        assert path == tmp_path / name and path.stat().st_size > 0, name
    for name in ("accuracy.png", "bytes.png"):
        assert files[name].read_bytes()[:8] == PNG
    saved = json.loads(files["results.json"].read_text())
    assert saved["accuracy_per_round"] == [0.6, 0.85, 0.9] and saved["rounds_to_target"] == 2
    assert saved["clustering"]["ari"] == pytest.approx(1.0)
    assert saved["clustering"]["missing_from_truth"] == ["h"]
    assert "clustering" in saved["definitions"]

    page = files["report.html"].read_text()
    refs = _referenced(page)
    assert sorted(refs) == ["accuracy.png", "bytes.png", "results.json"]
    assert all((tmp_path / r).is_file() for r in refs)
    assert "<script" not in page and "<link" not in page and "http" not in page
    # the summary, each table, the escaped reasons
    assert "fedsketch" in page and "0.7833" in page and "ARI against the true groups" in page
    for heading in ("Per round", "Per cluster", "Bytes", "Refused and dropped clients"):
        assert f"<h2>{heading}</h2>" in page
    assert "take 64 &lt;b&gt;" in page and "offline for 3 rounds" in page
    assert "<td>55,000</td>" in page  # what the devices downloaded
    per_round = page.split("<h2>Per round</h2>")[1].split("<h2>")[0]
    assert per_round.count("<tr>") == 1 + 3  # the header, one row per round


def test_threshold_search_is_drawn_only_for_strategies_that_have_one(tmp_path):
    from server_kit.clustering import SketchClustering

    class NoSearch:
        model_ = None

    assert plot_threshold_search(NoSearch(), tmp_path / "t.png") is None
    assert plot_threshold_search(object(), tmp_path / "t.png") is None
    assert not (tmp_path / "t.png").exists()

    rng = np.random.default_rng(0)
    protos = rng.integers(0, 2, size=(2, 64), dtype=np.uint8)
    bits = np.repeat(protos, 6, axis=0) ^ (rng.random((12, 64)) < 0.05).astype(np.uint8)

    class WithSearch:
        model_ = SketchClustering(min_cluster_size=3, n_calls=6, n_initial_points=5, n_null=0, refine=False,
                                  random_state=0).fit(np.packbits(bits, axis=1), 64)

    files = write_report(tmp_path, build_results(synthetic_result(refusals=False)), strategy=WithSearch())
    assert files["threshold_search.png"].read_bytes()[:8] == PNG
    page = files["report.html"].read_text()
    assert 'src="threshold_search.png"' in page
    assert "does not record refused or dropped clients" in page
    assert all((tmp_path / r).is_file() for r in _referenced(page))


def test_write_report_takes_built_results(tmp_path):
    with pytest.raises(ValueError, match=r"^write_report takes what build_results returns \(it has no "
                                         r"'definitions'\)$"):
        write_report(tmp_path, synthetic_result())
