"""Server-side clustering of clients from their bit sketches.

``SketchClustering`` is a scikit-learn style estimator::

    from server_kit.clustering import SketchClustering
    model = SketchClustering(min_cluster_size=10, random_state=0).fit(packed, n_bits)
    model.labels_, model.n_clusters_, model.predict(late_joiners)

The estimator (:mod:`.sketch`) runs the steps of the method, each in its own
module: the exact method's dendrogram and the choice of its cut, in order
(:mod:`.exact`), the fitted attributes (:mod:`.fitted`), the dendrogram, its cuts and their CH (:mod:`.dendrogram`), the
threshold search (:mod:`.threshold`), the permutation test
(:mod:`.permutation`), the separation check (:mod:`.separation`), refinement
and consolidation (:mod:`.refine`), the late-joiner rule (:mod:`.centroids`),
the distances and that rule in torch on a GPU, same results (:mod:`.on_device`),
large fleets (:mod:`.sampled`), the settings' checks (:mod:`.params`) and the
report figure (:mod:`.plot`). :mod:`.updates` and :mod:`.hierarchy` serve the
methods that cluster from model updates.
:mod:`.migration` keeps, moves or pools a device from a fresh sketch (drift).
"""

from .dendrogram import CutProfile, calinski_harabasz_bits, cut_profile, ward_linkage
from .plot import plot_search
from .sketch import SketchClustering

__all__ = [
    "CutProfile",
    "SketchClustering",
    "calinski_harabasz_bits",
    "cut_profile",
    "plot_search",
    "ward_linkage",
]
