"""The models a run trained, in use: exported as files, kept by its devices, served to new ones.

- :mod:`~server_kit.serving.offers`: each model's figures (cluster, members, sha256, accuracy), one definition.
- :mod:`~server_kit.serving.onnx_model`: a model as one standalone ONNX file.
- :mod:`~server_kit.serving.export`: ``REPORT_DIR/models/`` (and a checkpoint's ``models/``), written atomically.
- :mod:`~server_kit.serving.handover`: the ``keep`` commands at the end of a run, and a model handed to a
  device that arrives while the server serves (cold start).
"""
