"""Watching a running federation: Prometheus metrics, the live page, what they read.

:mod:`~.names` (every metric: one catalogue), :mod:`~.view` (a run at one
moment), :mod:`~.watch` (views taken on the driver's thread at a pace),
:mod:`~.collector` (the metrics from the last view), :mod:`~.live` (the
live page), :mod:`~.http` (the endpoint), :mod:`~.options` (the server's
options), :mod:`~.aggregator` (an aggregator's metrics).
"""
