"""A simulated round's training: every task trained as its device would, one by one or batched, on one device.

:class:`RoundTraining` is what the simulator's
:class:`~server_kit.drivers.sim_round.SimulatedPort` calls for a round's tasks.
Each device first makes its choices as it would alone
(:meth:`edge_sdk.worker.LocalWorker.plan_fit`: the model it picks, its
evaluation, its seed); given a :class:`~server_kit.drivers.sim_eval.DeviceEvaluation`
(the simulator's on a GPU), the batched devices' choices and evaluations are
made there instead, for the whole round at once
(:meth:`~server_kit.drivers.sim_eval.DeviceEvaluation.plans`). Then, batched, the tasks that share an architecture and
settings train together (:func:`edge_sdk.training.batched_train.train_local_batched`,
in chunks of ``chunk`` clients) and each device makes its update from its part
(:meth:`~edge_sdk.worker.LocalWorker.fitted`); one by one, each device trains
alone (:meth:`~edge_sdk.worker.LocalWorker.fit`). Devices of another kind (the
benchmarks' hostile, stalling or surviving workers override ``fit``) and
architectures that cannot be batched (BatchNorm, dropout) always train alone.
Both give the same models within float tolerance.

On a GPU the round is batched by default: its clients run as a few large
kernels instead of thousands of small ones, and each client's data stays on
the card for the whole run. On the CPU the devices train one
by one by default: there, ``vmap``'s grouped convolutions (their backward
above all) cost more than they save. On 2 cores a LeNet-5 round trained in
batches took 1.3 times as long as one by one (the digits CNN: the same time);
``benchmarks/gpu.py`` measures both orders (``round_s_cpu_batched`` against
``round_s_cpu_sequential``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from edge_sdk.tasks import Task, TrainSettings, Update
from edge_sdk.worker import FitAsk, FitPlan, LocalWorker

if TYPE_CHECKING:
    from .sim_eval import DeviceEvaluation

__all__ = ["CPU_CHUNK", "GPU_CHUNK", "RoundTraining"]

log = logging.getLogger(__name__)

#: Clients trained in one batch on the CPU (larger batches make larger, slower grouped convolutions there).
CPU_CHUNK = 8
#: Clients trained in one batch on a GPU (a round's 50 LeNet-5 clients fit many times over).
GPU_CHUNK = 256


class RoundTraining:
    """Trains a round's tasks on ``device`` (``auto``, ``cpu``, ``cuda``); ``batched`` None: the default above.

    Parameters
    ----------
    workers : mapping of str to LocalWorker
        The simulated devices by id.
    device : {"auto", "cpu", "cuda"}
        Where the training runs (``auto``: CUDA when torch sees it).
    batched : bool, optional
        Train tasks that share an architecture and settings together, in
        chunks of ``chunk`` clients; None (default): on a GPU only.
    chunk : int, optional
        Clients per batch (default by device, as above).
    resident : bool, optional
        Keep each batched client's data on the device for the whole run
        (:class:`~edge_sdk.training.batched_train.ResidentData`) instead of
        copying a round's data there every round; None (default): on a GPU.
    evaluation : DeviceEvaluation, optional
        Where the batched devices' choices (IFCA) and first evaluations are
        made, all of a round's at once (its architecture's devices); None:
        each device makes its own.
    step : {"eager", "compile", "graphs"}
        How the batched steps run (:class:`edge_sdk.training.batched_train.Step`).
    """

    def __init__(self, workers: Mapping[str, LocalWorker], *, device: str = "auto", batched: bool | None = None,
                 chunk: int | None = None, resident: bool | None = None,
                 evaluation: DeviceEvaluation | None = None, step: str = "eager") -> None:
        from edge_sdk.training.batched_train import check_step
        from edge_sdk.training.torch_support import resolve_device
        from edge_sdk.validation import check_positive_int

        self.workers = workers
        self.device = resolve_device(device)
        self.batched = self.device == "cuda" if batched is None else bool(batched)
        default = GPU_CHUNK if self.device == "cuda" else CPU_CHUNK
        self.chunk = default if chunk is None else check_positive_int(chunk, "chunk")
        self.evaluation = evaluation
        self.step = check_step(step)
        self._resident = None
        if self.batched and (self.device == "cuda" if resident is None else resident):
            from edge_sdk.training.batched_train import ResidentData

            self._resident = ResidentData(self.device)

    def _alone(self, worker: LocalWorker) -> bool:
        from edge_sdk.training.batched_train import architecture_batchable

        return (not self.batched or type(worker).fit is not LocalWorker.fit
                or not architecture_batchable(worker.architecture))

    def train(self, tasks: Sequence[Task]) -> list[Update]:
        """Each task's update, in the order of ``tasks``."""
        out: list[Update | None] = [None] * len(tasks)
        groups: dict[tuple[str, TrainSettings], list[tuple[int, FitAsk]]] = {}
        for i, t in enumerate(tasks):
            w = self.workers[t.cid]
            if self._alone(w):
                out[i] = w.fit(t, device=self.device)
            else:
                groups.setdefault((w.architecture, t.settings), []).append((i, w.ask_fit(t)))
        for (architecture, settings), asked in groups.items():
            members = list(zip([i for i, _ in asked], self._plans(tasks, architecture, asked)))
            for start in range(0, len(members), self.chunk):
                self._batch(tasks, architecture, settings, members[start : start + self.chunk], out)
        return [u for u in out if u is not None]

    def _plans(self, tasks: Sequence[Task], architecture: str, asked: Sequence[tuple[int, FitAsk]]) -> list[FitPlan]:
        """The plans of one architecture's batched tasks: answered by ``evaluation`` if it serves it, else each alone."""
        if self.evaluation is not None and self.evaluation.architecture == architecture:
            return self.evaluation.plans([(tasks[i], a) for i, a in asked], self._resident)
        return [self.workers[tasks[i].cid].plan_asked(tasks[i], a) for i, a in asked]

    def _batch(self, tasks: Sequence[Task], architecture: str, settings: TrainSettings,
               members: Sequence[tuple[int, FitPlan]], out: list[Update | None]) -> None:
        from edge_sdk.training.batched_train import ClientJob, train_local_batched

        jobs = []
        for i, plan in members:
            w = self.workers[tasks[i].cid]
            jobs.append(ClientJob(tasks[i].models[plan.key], w.x, w.y, plan.seed, key=tasks[i].cid))
        results = train_local_batched(architecture, jobs, epochs=settings.epochs, lr=settings.lr,
                                      batch_size=settings.batch_size, optimizer=settings.optimizer,
                                      device=self.device, resident=self._resident, step=self.step)
        for (i, plan), res in zip(members, results):
            out[i] = self.workers[tasks[i].cid].fitted(tasks[i], plan, res)
        log.debug("%s: %d clients trained in one batch on %s", architecture, len(members), self.device)
