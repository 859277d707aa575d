"""FedSketch server kit: torch architectures, the export recipe and the server side.

This package builds on :mod:`edge_sdk`. Importing it stays cheap: torch and
the other heavy dependencies are imported only by the submodules that need
them (:mod:`server_kit.nets`, :mod:`server_kit.export`).
"""
