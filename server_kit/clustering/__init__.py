"""Server-side clustering of clients from their bit sketches.

``SketchClustering`` is a scikit-learn style estimator::

    from server_kit.clustering import SketchClustering
    model = SketchClustering(min_cluster_size=10, random_state=0).fit(packed, n_bits)
    model.labels_, model.n_clusters_, model.predict(late_joiners)
"""

from .sketch import (
    CutProfile,
    SketchClustering,
    calinski_harabasz_bits,
    cut_profile,
    plot_search,
    ward_linkage,
)

__all__ = [
    "CutProfile",
    "SketchClustering",
    "calinski_harabasz_bits",
    "cut_profile",
    "plot_search",
    "ward_linkage",
]
