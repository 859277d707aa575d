"""What ``fedsketch bench`` measured, as frozen dataclasses, and :class:`BenchResult.to_dict` (its ``--json``).

Times are seconds (``None`` where a row was not measured: its ``note`` says
why); sizes are bytes. The JSON file is ``BenchResult.to_dict()``, marked
``"format": "fedsketch-bench"`` so that :func:`edge_sdk.bench.load_bench_summary`
can tell it from other JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
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
]

#: The ``format`` field of a bench result file.
FORMAT = "fedsketch-bench"
#: Its ``format_version``: raised when a field changes meaning.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class StageTiming:
    """One stage of the sketch path for one encoder.

    Attributes
    ----------
    encoder : str
        The shipped encoder (manifest name).
    stage : str
        ``load``, ``encode_one``, ``encode_batch``, ``class_means``,
        ``quantise_pack_cython``, ``quantise_pack_numpy`` or ``sketch``.
    label : str
        What was timed, for people ("encode 1 image (batch 1)").
    seconds : float or None
        Median seconds per call over the repeats; None when not measured.
    best : float or None
        The fastest repeat.
    samples : int
        Samples the call handles (1 for ``encode_one``).
    repeats : int
        Repeats the median is taken over.
    note : str
        Why a row was not measured ("not compiled"), or what else to know.
    """

    encoder: str
    stage: str
    label: str
    seconds: Optional[float]
    best: Optional[float]
    samples: int
    repeats: int
    note: str = ""


@dataclass(frozen=True)
class TrainTiming:
    """One local training epoch of one architecture (batch 32, Adam, lr 1e-3: ``train_local``).

    Attributes
    ----------
    architecture : str
        Key of :data:`edge_sdk.training.nets.ARCHITECTURES`.
    label : str
        Its usual name ("LeNet-5").
    seconds : float or None
        Seconds of one epoch over ``samples`` samples (scaled from
        ``measured_samples`` when they differ); None when not measured.
    samples : int
        Samples the epoch figure is for.
    measured_seconds : float or None
        Seconds of the epoch actually run, over ``measured_samples``.
    measured_samples : int
        Samples actually trained on.
    threads : int or None
        torch intra-op threads (None: torch's default).
    note : str
        Scaling, or why not measured (with what to install).
    """

    architecture: str
    label: str
    seconds: Optional[float]
    samples: int
    measured_seconds: Optional[float] = None
    measured_samples: int = 0
    threads: Optional[int] = None
    note: str = ""


@dataclass(frozen=True)
class Ratio:
    """One epoch over one sketch (the paper's Figure 6: 4x for LeNet-5, 115x for ResNet-18 on a Pi 4).

    Attributes
    ----------
    architecture, encoder : str
        The pair compared (LeNet-5 with the 28x28 encoder, ResNet-18 with the
        32x32x3 one, DigitsCNN with the digits one).
    epoch_seconds : float
        One epoch, over as many samples as the sketch.
    sketch_seconds : float
        The whole sketch (:meth:`edge_sdk.Sketcher.sketch`).
    ratio : float
        ``epoch_seconds / sketch_seconds``.
    paper : float or None
        The paper's figure on a Raspberry Pi 4, where it gives one.
    samples : int
        Samples of both.
    """

    architecture: str
    encoder: str
    epoch_seconds: float
    sketch_seconds: float
    ratio: float
    paper: Optional[float]
    samples: int


@dataclass(frozen=True)
class MessageSize:
    """Bytes of one message on the wire.

    Attributes
    ----------
    kind : str
        ``sketch``, ``update`` or ``model``.
    name : str
        The encoder (sketch) or architecture (update, model).
    body_bytes : int or None
        The body: packed sketch bits, or the safetensors of the float32 weights.
    envelope_bytes : int or None
        The whole encoded envelope (header, ids, meta, body; a model's
        signature trailer included).
    wire_bytes : int or None
        What the transport sends: the envelope, or its chunks above ``--max-payload``.
    compressed_bytes : int or None
        The update's compressed body, when the bench was given a compressor (None otherwise).
    note : str
        Where the weights came from, or why not measured.
    """

    kind: str
    name: str
    body_bytes: Optional[int]
    envelope_bytes: Optional[int]
    wire_bytes: Optional[int]
    compressed_bytes: Optional[int] = None
    note: str = ""


@dataclass(frozen=True)
class ThermalZone:
    """One ``/sys/class/thermal/thermal_zone*``: its name, its ``type`` and its temperature."""

    zone: str
    type: str
    celsius: float


@dataclass(frozen=True)
class Throttled:
    """``vcgencmd get_throttled``: the raw bits and the flags they set (empty: never throttled)."""

    raw: int
    flags: tuple[str, ...]


@dataclass(frozen=True)
class MachineInfo:
    """The machine the figures were taken on.

    ``cpu`` is the board or CPU model ("Raspberry Pi 4 Model B Rev 1.1", or
    x86's model name), ``cpu_part`` the ARM core when known ("Cortex-A72,
    Raspberry Pi 4"). Peak RSS is this process's (``VmHWM``): after the
    sketch stages (what a device without torch needs) and at the end.
    Temperatures and throttling are read before and after the run;
    ``thermal_note`` says "not exposed" where the board has neither.
    """

    cpu: str
    cpu_part: str
    cores: Optional[int]
    mem_mb: Optional[int]
    kernel: str
    kernels_available: tuple[str, ...]
    onnxruntime: Optional[str]
    providers: tuple[str, ...]
    torch: Optional[str]
    python: str
    platform: str
    fedsketch: str
    sketch_peak_rss_mib: Optional[float] = None
    peak_rss_mib: Optional[float] = None
    temp_before: tuple[ThermalZone, ...] = ()
    temp_after: tuple[ThermalZone, ...] = ()
    throttled_before: Optional[Throttled] = None
    throttled_after: Optional[Throttled] = None
    thermal_note: str = ""


@dataclass(frozen=True)
class BrokerTiming:
    """The MQTT round trip and upload rate to the real broker, on the device's own status topic.

    Attributes
    ----------
    url, client_id, topic : str
        Where, as whom, on which topic.
    method : str
        ``puback``: a QoS 1 publish until the broker's acknowledgement (the
        ACL lets a device read none of the topics it may write, so there is
        no echo to wait for).
    messages : int
        Small messages timed.
    rtt_median_s, rtt_p90_s : float
        Their acknowledgement times.
    upload_bytes : int
        Bytes of the large messages, chunks included.
    upload_seconds : float
        Until the broker acknowledged their last chunk.
    upload_mb_s : float
        ``upload_bytes / upload_seconds / 1e6``.
    note : str
        How to read the figures.
    """

    url: str
    client_id: str
    topic: str
    method: str
    messages: int
    rtt_median_s: float
    rtt_p90_s: float
    upload_bytes: int
    upload_seconds: float
    upload_mb_s: float
    note: str = ""


@dataclass(frozen=True)
class BenchSettings:
    """The options a run used (``--samples``, ``--repeats``...; ``threads``: torch's, ``--threads``)."""

    encoders: tuple[str, ...]
    architectures: tuple[str, ...]
    samples: int
    resnet_samples: int
    repeats: int
    classes: int
    flip_prob: float
    batch_size: int
    threads: Optional[int]
    seed: int
    data: Optional[str]
    train: bool


@dataclass(frozen=True)
class BenchResult:
    """Everything one ``fedsketch bench`` run measured."""

    settings: BenchSettings
    machine: MachineInfo
    stages: tuple[StageTiming, ...] = ()
    training: tuple[TrainTiming, ...] = ()
    ratios: tuple[Ratio, ...] = ()
    sizes: tuple[MessageSize, ...] = ()
    broker: Optional[BrokerTiming] = None
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The whole result as JSON-ready values (what ``--json`` writes)."""
        out = {"format": FORMAT, "format_version": FORMAT_VERSION}
        out.update(asdict(self))
        return out
