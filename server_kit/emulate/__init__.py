"""A fleet of real devices in a few processes: the emulator of ``benchmarks/fleet.py`` and the fleet tests.

Every emulated device is what a Raspberry Pi runs: a real
:class:`~edge_sdk.client.EdgeClient` with its own
:class:`~edge_sdk.worker.LocalWorker` (its data, its sketch, its local
training) and its own :class:`~edge_sdk.transport.MqttTransport`, one TCP
connection to the broker each, with its user name, password, last will and
persistent session. What is shared, so that thousands fit in a process and
the emulation costs less than the server it loads:

* the network: a few :class:`~edge_sdk.transport.netloop.NetworkLoop` threads (epoll)
  run every connection of the process, and their pools run the handlers;
* the commands: a small :class:`~edge_sdk.transport.pool.OrderedPool` calls
  :meth:`EdgeClient.step` for a device when its transport delivered
  something (``on_delivered``) or when its jittered hello falls due, in
  order per device; no thread waits on any one device;
* the ONNX encoder session (one per encoder and process, thread-safe).

:class:`EmulatedFleet` runs the devices in this process (``processes=0``) or
spreads them over child processes (``multiprocessing`` spawn): each gets its
devices' data as numpy arrays in its process arguments, and reports counts
to the parent as JSON over a pipe (nothing a broker peer sent is ever
unpickled).

>>> clients = fleet_partition(1000, seed=0)            # doctest: +SKIP
>>> with EmulatedFleet(broker.url, clients, federation="fleet", processes=1) as fleet:
...     fleet.wait_connected(60)
...     # start the server; fleet.snapshot() counts what the devices did

One module per job: :mod:`~server_kit.emulate.partition` (the devices'
data), :mod:`~server_kit.emulate.shard` (the devices of one process) and
:mod:`~server_kit.emulate.fleet` (the processes).
"""

from .fleet import EmulatedFleet
from .partition import fleet_partition
from .shard import FleetSettings

__all__ = ["EmulatedFleet", "FleetSettings", "fleet_partition"]
