"""Training on the device with torch (imported lazily): the nets, the epoch loop, evaluation.

:mod:`~edge_sdk.training.nets` names the architectures (:mod:`~edge_sdk.training._torch_nets`
defines them, with torch); :mod:`~edge_sdk.training.torch_support` imports torch and sizes
its threads; :mod:`~edge_sdk.training.trainer` trains received weights through the one
epoch loop of :mod:`~edge_sdk.training.train_loop`, or many clients at once
(:mod:`~edge_sdk.training.batched_train`); :mod:`~edge_sdk.training.evaluation` scores
weights on local data; :mod:`~edge_sdk.training.sampling` says who belongs to a seeded sample.
Importing this package never imports torch.
"""
