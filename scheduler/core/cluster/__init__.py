"""The cluster scheduler's pure core: which nodes each job trains on (several jobs, one
cluster of unequal nodes). No Ray, no torch, no clock: nodes and jobs in, one
:class:`~.values.ClusterDecision` out (:func:`.decision.decide`). See docs/cluster.md."""
