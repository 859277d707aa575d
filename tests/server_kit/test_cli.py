"""The server's command line and run config: bad settings fail early with a clear message."""

from __future__ import annotations

import pytest

from server_kit.cli import load_config, main

from helpers import ari_against


def test_config_file_is_read_and_validated(tmp_path):
    good = tmp_path / "run.toml"
    good.write_text('federation = "lab"\nrounds = 5\nmin_clients = 4\n[strategy]\nname = "fedavg"\nepochs = 2\n')
    conf, strat = load_config(good)
    assert conf == {"federation": "lab", "rounds": 5, "min_clients": 4}
    assert strat == {"name": "fedavg", "epochs": 2}
    bad = tmp_path / "bad.toml"
    bad.write_text("federation = 'lab'\nroundz = 5\n")
    with pytest.raises(ValueError, match=r"unknown keys \['roundz'\]"):
        load_config(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("rounds = = 5")
    with pytest.raises(ValueError, match="cannot read config"):
        load_config(broken)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "rounds must be a positive integer, got 0"),
        (["--strategy", "nope"], "unknown strategy 'nope'"),
        (["--flip-prob", "0.7"], r"flip_prob must be in [0, 0.5], got 0.7"),
        (["--broker", "http://x:1"], "scheme"),
        (["--strategy", "fedavg", "--shared-base"], "--shared-base applies to clustered strategies"),
        (["--report-goal", "0"], "report_goal must be in (0, 1], got 0.0"),
        (["--over-select", "-0.5"], "over_select must be in [0, 10], got -0.5"),
        (["--bench-after", "-1"], "bench_after must be an integer >= 0, got -1"),
        (["--straggler-grace", "20"], "straggler_grace must be in [0, 10], got 20.0"),
        (["--resume"], "--resume needs --checkpoint-dir: the folder the interrupted run wrote its checkpoints to"),
    ],
)
def test_bad_settings_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "fedsketch-server: error:" in err and message in err, err


def test_resume_without_checkpoint_says_so(tmp_path, capsys):
    from server_kit.broker import MosquittoBroker, find_mosquitto

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with MosquittoBroker() as broker:
        code = main(["--broker", broker.url, "--resume", "--checkpoint-dir", str(tmp_path / "none")])
    assert code == 3
    assert "no checkpoint in" in capsys.readouterr().err


def test_set_reads_strategy_parameters_as_toml():
    from server_kit.cli import parse_params

    assert parse_params(["eps1=0.4", "algorithm=hdbscan", 'linkage="average"', "sizes=[1, 2]", "refine=false"]) == {
        "eps1": 0.4, "algorithm": "hdbscan", "linkage": "average", "sizes": [1, 2], "refine": False}
    with pytest.raises(ValueError, match="--set expects KEY=VALUE"):
        parse_params(["eps1"])
    with pytest.raises(ValueError, match=r"--set k: cannot read '\[1' as a TOML value"):
        parse_params(["k=[1"])


def test_set_passes_parameters_to_the_strategy_which_refuses_unknown_ones(capsys):
    assert main(["--strategy", "ladd", "--set", "k=0"]) == 2
    assert "k must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["--strategy", "fedavg", "--set", "nope=1"]) == 2
    assert "nope" in capsys.readouterr().err


# -- issue 12: --help, names refused before connecting, an unreachable broker, the report ---------------------


def _free_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_shows_every_default_and_the_names_to_choose_from(capsys, monkeypatch):
    from server_kit.cli import build_parser, known_architectures, known_encoders, known_strategies
    from server_kit.drivers import ServerConfig

    monkeypatch.setenv("COLUMNS", "200")
    for action in build_parser()._actions:
        if action.dest != "help":
            assert "(default: " in (action.help or ""), action.dest
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "fedcref" in known_strategies() and "fedsketch-fedae" in known_strategies()
    assert known_architectures() == ["digits_cnn_1x8x8_10", "lenet5_1x28x28_10", "resnet18_3x32x32_10"]
    assert "digits_encoder" in known_encoders() and "digits_ae" not in known_encoders()
    assert f"one of: {', '.join(known_strategies())}." in out
    assert f"one of: {', '.join(known_architectures())} (default: chosen from the fleet)" in out
    assert f"one of: {', '.join(known_encoders())} (default: chosen from the fleet)" in out
    cfg = ServerConfig()
    for text in (f"training rounds (default: {cfg.rounds})", f"(default: {cfg.min_clients})",
                 f"(default: {cfg.round_timeout_s})", "(default: fedsketch)", "(default: mqtt://127.0.0.1:1883)",
                 "local epochs per round (default: 1)", "local learning rate (default: 0.001)",
                 "(default: 32)", "(default: 0.8)", "(default: 3.1.1)", "(default: 1000000)"):
        assert text in out, text


@pytest.mark.parametrize(
    ("argv", "what", "name"),
    [
        (["--architecture", "lenet5"], "architecture", "lenet5"),
        (["--encoder", "digits_ae"], "encoder", "digits_ae"),
        (["--strategy", "fedsketchy"], "strategy", "fedsketchy"),
    ],
)
def test_unknown_names_are_refused_before_connecting(argv, what, name, capsys, monkeypatch):
    import server_kit.cli as cli

    def no_connection(*a, **k):
        raise AssertionError("the server tried to connect")

    monkeypatch.setattr(cli, "_with_broker", no_connection)
    known = {"architecture": cli.known_architectures, "encoder": cli.known_encoders,
             "strategy": cli.known_strategies}[what]()
    assert main(["--broker", f"mqtt://127.0.0.1:{_free_port()}", *argv]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"fedsketch-server: error: unknown {what} {name!r}; known: {known}"]


def test_unknown_architecture_in_the_config_file_is_refused_too(tmp_path, capsys):
    from server_kit.cli import known_architectures

    conf = tmp_path / "run.toml"
    conf.write_text('architecture = "lenet5"\n')
    assert main(["--config", str(conf), "--broker", f"mqtt://127.0.0.1:{_free_port()}"]) == 2
    assert capsys.readouterr().err == (f"fedsketch-server: error: unknown architecture 'lenet5'; "
                                       f"known: {known_architectures()}\n")


def test_unreachable_broker_is_one_line_and_exit_3():
    import re
    import subprocess
    import sys
    from pathlib import Path

    port = _free_port()
    proc = subprocess.run([sys.executable, "-m", "server_kit.cli", "--broker", f"mqtt://127.0.0.1:{port}",
                           "--rounds", "1"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(rf"fedsketch-server: cannot reach the broker at mqtt://127\.0\.0\.1:{port}: .+", lines[0])
    assert "Traceback" not in proc.stderr and "Client is not connected" not in proc.stderr


def test_paho_not_connected_line_is_debug_only(caplog):
    import logging

    from server_kit.cli import PAHO_LOGGER, _configure_logging, _PahoNotConnected

    paho = logging.getLogger(PAHO_LOGGER)
    level = paho.level
    paho.setLevel(logging.NOTSET)  # whatever an earlier in-process CLI run set (the client's main sets it)
    try:
        with caplog.at_level(logging.DEBUG):
            _configure_logging(0)
            paho.error("Client is not connected. Socket: None). Last known Connection State: MQTT_CS_CONNECTING")
            paho.error("something else")
            assert [r.getMessage() for r in caplog.records if r.name == PAHO_LOGGER] == ["something else"]
            caplog.clear()
            _configure_logging(1)  # -v: kept, as DEBUG
            paho.error("Client is not connected. Socket: None).")
            [rec] = [r for r in caplog.records if r.name == PAHO_LOGGER]
            assert rec.levelno == logging.DEBUG
            assert sum(isinstance(f, _PahoNotConnected) for f in paho.filters) == 1
    finally:
        paho.setLevel(level)
        for f in [f for f in paho.filters if isinstance(f, _PahoNotConnected)]:
            paho.removeFilter(f)


def _synthetic_result():
    """What Orchestrator.run returns for 2 rounds of 2 clusters (tests/server_kit/test_report.py has more)."""
    from server_kit.drivers.result import RunResult

    return RunResult(
        strategy="fedavg", assignment={"a": 0, "b": 0, "c": 1, "d": 1},
        history=[{"round": 1, "acc_before": 0.1, "acc_before_per_model": {"global": 0.1}},
                 {"round": 2, "acc_before": 0.7, "acc_before_per_model": {"global": 0.7}}],
        final={"accuracy": 0.85, "per_client": {}, "per_model": {"global": 0.85}},
        timings={}, rejected={},
        transport={"sent": {"CMD": {"messages": 4, "bytes": 400}}, "received": {"UPDATE": {"messages": 4,
                                                                                         "bytes": 4000}}},
        delivered={"MODEL": 3000}, pretrain=[], encoder="digits_encoder", architecture=None,
        refused={"e": "wrong sample shape"},
    )


def test_report_dir_run_prints_the_page_and_the_summary_with_ari(tmp_path, capsys, monkeypatch):
    import json

    import server_kit.cli as cli
    import server_kit.drivers.orchestrator as orchestrator

    class Ran:  # the orchestrator of a run that returned the synthetic result and exports nothing
        def __init__(self, strategy, transport, config, **kw):
            self.strategy = strategy

        def run(self, resume=False):
            return _synthetic_result()

        def export_models(self, folder):
            return None

    monkeypatch.setattr(orchestrator, "Orchestrator", Ran)
    monkeypatch.setattr(cli, "_with_broker", lambda args, config, bcfg, run: run(None))
    truth = tmp_path / "truth.json"
    truth_groups = {"a": 0, "b": 0, "c": 1, "d": 2}
    truth.write_text(json.dumps(truth_groups))
    report = tmp_path / "report"
    assert main(["--strategy", "fedavg", "--report-dir", str(report), "--truth", str(truth),
                 "--target-accuracy", "0.8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == f"report: {report / 'report.html'}"
    summary = json.loads(out[-1])
    # accuracy after round 1 = what round 2 measured before training (0.7), after round 2 = the final evaluation
    # the ARI of the assignment {a, b: 0; c, d: 1} against the truth {a, b: 0; c: 1; d: 2} is 4/7, rounded to 4 places
    ari = ari_against(truth_groups, _synthetic_result().assignment)
    assert ari == pytest.approx(4 / 7)
    assert summary == {"strategy": "fedavg", "final_accuracy": 0.775, "final_evaluation": 0.85, "clusters": 2,
                       "rounds": 2, "ari": round(ari, 4)}
    for name in ("results.json", "accuracy.png", "bytes.png", "report.html"):
        assert (report / name).stat().st_size > 0, name
    results = json.loads((report / "results.json").read_text())
    assert results["accuracy_per_round"] == [0.7, 0.85] and results["rounds_to_target"] == 2
    assert results["refused"] == {"e": "wrong sample shape"}
    assert results["clustering"]["ari"] == pytest.approx(ari)
    # without a report folder the summary still scores the clustering
    assert main(["--strategy", "fedavg", "--truth", str(truth)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["ari"] == summary["ari"]


def test_bad_truth_file_is_refused_before_connecting(tmp_path, capsys):
    assert main(["--truth", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedsketch-server: error: --truth {tmp_path / 'none.json'}: cannot read it: "), err
    assert main(["--target-accuracy", "1.5"]) == 2
    assert capsys.readouterr().err == "fedsketch-server: error: --target-accuracy must be in (0, 1], got 1.5\n"


def test_server_and_client_take_the_same_broker_options(tmp_path):
    """One definition (BrokerConfig.add_arguments / from_args): the server had no --certfile / --keyfile."""
    from edge_sdk.client.cli import _broker_config as client_config
    from edge_sdk.client.cli import build_parser as client_parser
    from server_kit.cli import _broker_config as server_config
    from server_kit.cli import build_parser as server_parser

    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    common = ["--username", "u1", "--password-file", str(pw), "--ca-certs", "ca.pem", "--certfile", "c.pem",
              "--keyfile", "k.pem", "--protocol", "5", "--max-payload", "500000"]
    client_args = client_parser().parse_args(["--client-id", "u1", "--data", "d.npz",
                                              "--broker", "mqtts://h:8883", *common])
    server_args = server_parser().parse_args(common)
    c, s = client_config(client_args), server_config(server_args, "mqtts://h:8883")
    assert c == s
    assert (s.username, s.password, s.certfile, s.keyfile, s.protocol, s.max_payload) == (
        "u1", "s3cret", "c.pem", "k.pem", "5", 500000)
