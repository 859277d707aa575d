"""FedSketch edge SDK: turn a device's local data into a few bytes that describe it.

Runs with numpy, ONNX Runtime and a compiled bit kernel; torch is only needed
for local training. The public API::

    from edge_sdk import OnnxEncoder, Sketcher
    sketcher = Sketcher(OnnxEncoder("digits_encoder"), num_classes=10, flip_prob=0.1)
    sketch = sketcher.sketch(x, y)      # Sketch: .bits (bytes), .n_bits, .unpack()

    from edge_sdk import LocalModel
    model = LocalModel.load("/var/lib/fedsketch/model")   # the model this device keeps after a run
    labels = model.predict(x)
"""

from ._version import __version__
from .bits import (
    BACKEND,
    available_backends,
    hamming_cdist,
    hamming_pdist,
    pack_bits,
    quantize_pack,
    unpack_bits,
)
from .client import EdgeClient
from .encoder import OnnxEncoder
from .info import info
from .models.artifacts import ArtifactHashError, artifact_path, load_manifest, models_dir
from .models.local_model import LocalModel
from .models.model_folder import ModelFolderError
from .protocol import SERVER_ID, Kind, Message, ProtocolError, Topics
from .sketch import Sketch, Sketcher, pairwise_hamming, stack_sketches
from .tasks import Task, TrainSettings, Update
from .transport import BrokerConfig, MemoryBroker, MemoryTransport, MqttTransport, NetworkLoop
from .worker import LocalWorker

__all__ = [
    "ArtifactHashError",
    "BACKEND",
    "BrokerConfig",
    "EdgeClient",
    "Kind",
    "LocalModel",
    "LocalWorker",
    "MemoryBroker",
    "MemoryTransport",
    "Message",
    "ModelFolderError",
    "MqttTransport",
    "NetworkLoop",
    "OnnxEncoder",
    "ProtocolError",
    "SERVER_ID",
    "Sketch",
    "Sketcher",
    "Task",
    "Topics",
    "TrainSettings",
    "Update",
    "__version__",
    "artifact_path",
    "available_backends",
    "hamming_cdist",
    "hamming_pdist",
    "info",
    "load_manifest",
    "models_dir",
    "pack_bits",
    "pairwise_hamming",
    "quantize_pack",
    "stack_sketches",
    "unpack_bits",
]
