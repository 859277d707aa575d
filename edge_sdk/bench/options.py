"""The options of ``fedsketch bench`` (added to its subparser by :mod:`edge_sdk.cli`)."""

from __future__ import annotations

import argparse

from ..transport import BrokerConfig
from .training import ARCHITECTURES

__all__ = ["DESCRIPTION", "add_arguments"]

DESCRIPTION = """\
Time what this device does for FedSketch: each stage of the sketch path for each shipped encoder,
one local training epoch of LeNet-5, DigitsCNN and ResNet-18 (with torch), their ratio (the paper's
Figure 6), the message sizes, the machine (CPU, memory, temperature, throttling) and, with --broker,
the MQTT round trip and upload rate with the device's own credentials. Defaults keep a Raspberry Pi
run under a minute. The last line of stdout is JSON."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add every option of ``fedsketch bench`` to ``p``."""
    p.add_argument("--encoder", action="append", default=[], metavar="NAME",
                   help="a shipped encoder to time (repeatable); default: all of them, or those --data fits")
    p.add_argument("--data", default=None, metavar="FILE.npz",
                   help="the device's own data (arrays x and y, read without pickle; integer pixels / 255); "
                        "default: generated uniform [0, 1] samples of each encoder's shape")
    p.add_argument("--samples", type=int, default=600, metavar="N",
                   help="generated samples per encoder, and training samples (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, metavar="N",
                   help="repeats of each stage; the median is reported (default: %(default)s)")
    p.add_argument("--classes", type=int, default=10, help="classes of the federation (default: %(default)s)")
    p.add_argument("--flip-prob", type=float, default=0.1, help="bit flip probability P (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="samples per ONNX Runtime call, as the client (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated data and weights (default: 0)")
    t = p.add_argument_group("training (needs torch)")
    t.add_argument("--no-train", action="store_true", help="skip the training epochs")
    t.add_argument("--threads", type=int, default=1,
                   help="torch threads, as fedsketch-client --threads (default: %(default)s; 1 anyway on a CPU "
                        "without LSE atomics, such as a Raspberry Pi 4); ONNX Runtime keeps its own default, as "
                        "the client does")
    t.add_argument("--arch", action="append", default=[], choices=ARCHITECTURES, metavar="ARCH",
                   help=f"an architecture to train (repeatable; default: all of {', '.join(ARCHITECTURES)})")
    t.add_argument("--resnet-samples", type=int, default=16, metavar="N",
                   help="ResNet-18 trains on this many samples only, its epoch scaled to --samples "
                        "(default: %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="FILE", help="write the whole result as JSON")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    b = p.add_argument_group("broker (the MQTT round trip and upload rate; stop fedsketch-client first: the "
                             "broker keeps one connection per client id)")
    b.add_argument("--broker", default=None, metavar="URL", help="mqtt://host:port or mqtts://host:port")
    b.add_argument("--client-id", default=None, help="this device's id (default: --username)")
    b.add_argument("--federation", default="default", help="the federation's id (default: %(default)s)")
    b.add_argument("--root", default="fedsketch", help="topic root (default: %(default)s)")
    BrokerConfig.add_arguments(b, defaults_in_help=True)
    b.add_argument("--rtt-messages", type=int, default=20, metavar="N",
                   help="small messages for the round trip (default: %(default)s)")
    b.add_argument("--upload-mb", type=float, default=1.0, metavar="MB",
                   help="size of each large message (default: %(default)s)")
    b.add_argument("--upload-messages", type=int, default=3, metavar="N",
                   help="large messages for the upload rate (default: %(default)s)")
    b.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the broker (default: %(default)s)")
