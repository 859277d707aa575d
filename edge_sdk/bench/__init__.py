"""``fedsketch bench``: what FedSketch costs this device, measured on the device after ``pip install``.

It needs no source checkout and no torch: the encoders are the shipped
artifacts (:func:`edge_sdk.models.artifacts.load_manifest`). The rooms:

- :mod:`.stages`: the sketch path stage by stage, per shipped encoder (ONNX
  encoder per image and per batch, class means, quantise + pack on the
  Cython kernel and its numpy twin, the whole sketch).
- :mod:`.training`: one ``train_local`` epoch of LeNet-5, DigitsCNN and
  ResNet-18 (torch imported there only); :mod:`.ratios`: epoch over sketch,
  the paper's Figure 6.
- :mod:`.sizes`: a sketch, an update and a model in their envelopes.
- :mod:`.machine`: CPU, memory, peak RSS, versions, temperature, throttling.
- :mod:`.broker`: the MQTT round trip (PUBACK) and upload rate to the real
  broker, with the device's credentials.
- :mod:`.report`, :mod:`.plot`: the table, the JSON line, the PNG
  (matplotlib imported there only); :mod:`.command` runs it all,
  :mod:`.options` holds its options.
- :mod:`.results`: the dataclasses (:class:`StageTiming`,
  :class:`BenchResult`...); :mod:`.summary`: the figures a device may send
  with its hello (:func:`summary_for_hello`, :func:`load_bench_summary`).
"""

from __future__ import annotations

from .errors import BenchError
from .results import (
    BenchResult,
    BenchSettings,
    BrokerTiming,
    MachineInfo,
    MessageSize,
    Ratio,
    StageTiming,
    ThermalZone,
    Throttled,
    TrainTiming,
)
from .summary import HELLO_KEYS, load_bench_summary, summary_for_hello

__all__ = [
    "HELLO_KEYS",
    "BenchError",
    "BenchResult",
    "BenchSettings",
    "BrokerTiming",
    "MachineInfo",
    "MessageSize",
    "Ratio",
    "StageTiming",
    "ThermalZone",
    "Throttled",
    "TrainTiming",
    "load_bench_summary",
    "summary_for_hello",
]
