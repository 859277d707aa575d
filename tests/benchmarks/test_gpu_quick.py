"""benchmarks/gpu.py --quick: every key of its JSON line, the CPU parts measured, the GPU parts named or null."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
KEYS = {"agg_ms_resnet18_gpu", "agg_ms_resnet18_cpu", "agg_ms_lenet5_gpu", "agg_ms_lenet5_cpu",
        "pinned_transfer_ms_resnet18", "round_s_gpu_batched", "round_s_cpu_sequential", "round_s_cpu_batched",
        "batched_over_sequential_cpu", "assign_1m_s_gpu", "assign_1m_s_cpu", "gpu", "agg_ms_resnet18_int4_gpu",
        "agg_ms_resnet18_int4_cpu_staged", "agg_ms_resnet18_int4_cpu_host_decode", "threshold_gpu_min_bytes",
        "threshold_auto_min_pdist_rows", "threshold_auto_min_rows"}


def test_quick_run_reports_every_key_and_says_what_it_could_not_measure():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--repeats", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert KEYS <= set(out)
    assert out["round_clients"] == 4 and out["assign_rows"] == 20_000 and 44e6 < out["update_mb_resnet18"] * 1e6 < 46e6
    for key in ("agg_ms_resnet18_cpu", "agg_ms_lenet5_cpu", "agg_ms_resnet18_cpu_staged", "round_s_cpu_sequential",
                "round_s_cpu_batched", "assign_1m_s_cpu", "agg_ms_resnet18_int4_cpu_staged",
                "agg_ms_lenet5_int4_cpu_host_decode"):
        assert out[key] > 0, key
    # an int4 ResNet-18 body is about an eighth of its float32 weights (a scale per 256 entries besides)
    assert 0.125 < out["int4_body_mb_resnet18"] / out["update_mb_resnet18"] < 0.13
    for key in ("gpu_min_bytes", "auto_min_pdist_rows", "auto_min_rows"):  # each path timed at two sizes both ways
        timings = out[f"threshold_{key}_timings"]
        assert len(timings["sizes"]) == len(timings["cpu_s"]) == len(timings["card_s"]) == 2
        assert min(timings["cpu_s"] + timings["card_s"]) > 0
    # the two orders train the same models: the same accuracy, well above chance (10 classes)
    assert out["round_acc_cpu_batched"] == pytest.approx(out["round_acc_cpu_sequential"], abs=0.02)
    # measured 0.360-0.432 over seeds 0-3 (this machine and FPALT: AVX2, 2 threads), batched == sequential on each
    assert out["round_acc_cpu_batched"] > 0.2
    if torch.cuda.is_available():
        assert out["gpu"] == torch.cuda.get_device_name(0) and out["assign_same_labels"] is True
        assert out["agg_ms_resnet18_gpu"] > 0 and out["round_s_gpu_batched"] > 0
    else:
        assert lines[0] == "no GPU: torch sees no CUDA device, so only the CPU parts run"
        assert out["gpu"] is None
        assert [out[k] for k in ("agg_ms_resnet18_gpu", "pinned_transfer_ms_resnet18", "round_s_gpu_batched",
                                 "assign_1m_s_gpu", "agg_ms_resnet18_int4_gpu", "threshold_gpu_min_bytes",
                                 "threshold_auto_min_pdist_rows", "threshold_auto_min_rows")] == [None] * 8


def test_the_threshold_is_where_the_card_pays_at_every_larger_size():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _gpu_thresholds import crossover

    sizes = [1, 2, 3, 4]
    assert crossover(sizes, [1, 1, 1, 1], [2, 0.5, 2, 0.5]) == 4  # a win at 2 that does not last is no threshold
    assert crossover(sizes, [1, 1, 1, 1], [2, 0.5, 0.5, 0.5]) == 2
    assert crossover(sizes, [1, 1, 1, 1], [0.5, 0.5, 0.5, 0.5]) == 1
    assert crossover(sizes, [1, 1, 1, 1], [1, 1, 1, 1]) is None  # a tie is not a win
