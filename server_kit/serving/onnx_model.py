"""A trained classifier as one standalone ONNX file: the shipped template with the run's weights in it.

The architecture's classifier template (the manifest entry with role
``classifier``) is the graph the devices run; its initializers named in the
entry's ``initializer_names`` are replaced by the trained weights, and the
file's metadata says what an application needs to call it without FedSketch:
the input and output names, the input shape, the number of classes, the
architecture, the run and the model's key. ONNX Runtime runs the result with
no torch and no other file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edge_sdk.models.model_checks import check_weights
from edge_sdk.models.model_folder import ModelEntry
from edge_sdk.training.evaluation import classifier_template

__all__ = ["standalone_onnx"]


def standalone_onnx(entry: ModelEntry, weights: Mapping[str, np.ndarray], info: Any) -> bytes:
    """The bytes of ``entry``'s classifier with ``weights`` inside (checked against ``info``, a ModelInfo).

    Raises
    ------
    ValueError
        No template for the architecture, or weights that do not fit it.
    """
    import onnx
    from onnx import numpy_helper

    w = check_weights(info, weights)
    tpl = classifier_template(entry.architecture)  # the shipped template, its sha256 checked
    path, names = tpl.path, tpl.initializers
    model = onnx.load(str(path))
    by_init = {init: key for key, init in names.items()}
    found = set()
    for i, init in enumerate(model.graph.initializer):
        key = by_init.get(init.name)
        if key is None:
            continue
        arr = np.asarray(w[key], dtype=numpy_helper.to_array(init).dtype)
        model.graph.initializer[i].CopyFrom(numpy_helper.from_array(arr, init.name))
        found.add(key)
    missing = sorted(set(names) - found)
    if missing:
        raise ValueError(f"template of {entry.architecture} lacks the initializers of {missing[:5]}")
    meta = {"fedsketch.format": entry.format, "fedsketch.architecture": entry.architecture,
            "fedsketch.key": entry.key, "fedsketch.run": entry.run or "",
            "fedsketch.input_name": entry.input_name, "fedsketch.output_name": entry.output_name,
            "fedsketch.input_shape": ",".join(map(str, entry.input_shape)),
            "fedsketch.num_classes": str(entry.num_classes), "fedsketch.input_range": "0,1"}
    del model.metadata_props[:]
    for k, v in meta.items():
        prop = model.metadata_props.add()
        prop.key, prop.value = k, v
    model.doc_string = (f"FedSketch model {entry.key} of run {entry.run}: {entry.architecture}, input "
                        f"{entry.input_name} float32 (n, {', '.join(map(str, entry.input_shape))}) in [0, 1], "
                        f"output {entry.output_name} (n, {entry.num_classes}) logits")
    onnx.checker.check_model(model)
    return model.SerializeToString()
