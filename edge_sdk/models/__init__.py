"""Models on the device: the shipped artifacts, the models it is sent, the model it keeps, and its use.

:mod:`~edge_sdk.models.artifacts` finds the shipped ONNX files and checks their hashes;
:mod:`~edge_sdk.models.portable_init` builds a federation's initial weights without torch;
:mod:`~edge_sdk.models.held_models` holds what the server sent (whole or as compressed changes);
:mod:`~edge_sdk.models.model_checks` checks weights against an architecture;
:mod:`~edge_sdk.models.keep_offer` reads a ``keep`` command's offer, :mod:`~edge_sdk.models.keeping`
swaps the kept model in its folder (:mod:`~edge_sdk.models.model_folder`, the one format);
:mod:`~edge_sdk.models.local_model` and :mod:`~edge_sdk.models.predict_cli` run it
(``LocalModel``, ``fedsketch predict``).
"""
