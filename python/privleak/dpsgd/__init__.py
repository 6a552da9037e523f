"""DP-SGD: fused per-sample clipping and the private update, with one class per mechanism.

Layout:

- :mod:`~privleak.dpsgd.clip`: the fused clip-sum-noise kernel (:func:`clip_and_accumulate`);
- :mod:`~privleak.dpsgd.mechanism`: what a mechanism is (:class:`DPSGDMechanism`) and the
  registry that finds one by name; one file per mechanism: :mod:`~privleak.dpsgd.gaussian`
  (Alg. 1), :mod:`~privleak.dpsgd.vmf` (Alg. 2), :mod:`~privleak.dpsgd.laplace`;
- :mod:`~privleak.dpsgd.config`: :class:`DPSGDConfig`, clipping plus a mechanism, checked once;
- :mod:`~privleak.dpsgd.training`: per-sample gradients, batch sampling, :func:`privatize`,
  :class:`DPOptimizer` and :func:`privacy_report`;
- :mod:`~privleak.dpsgd.bookkeeping`: :class:`BookKeeping`, the same step without per-sample
  gradients (ghost norms and book-keeping), its per-layer rules in :mod:`~privleak.dpsgd.layers`;
  :mod:`~privleak.dpsgd.graphed`: :class:`GraphedStep`, that step replayed from a CUDA graph
  (:meth:`BookKeeping.graphed`); :mod:`~privleak.dpsgd.distributed`: that step across the
  processes of a DistributedDataParallel model.
"""
from privleak.dpsgd import mechanism
from privleak.dpsgd.bookkeeping import BookKeeping
from privleak.dpsgd.clip import GRAD_DTYPES, ClippedSum, clip_and_accumulate, clip_factors
from privleak.dpsgd.config import DPSGDConfig
from privleak.dpsgd.gaussian import Gaussian
from privleak.dpsgd.graphed import GraphedStep
from privleak.dpsgd.laplace import Laplace
from privleak.dpsgd.mechanism import ClipOnly, Clipping, DPSGDMechanism, Sampling
from privleak.dpsgd.training import (
    DPOptimizer,
    PrivacyReport,
    per_sample_gradients,
    privacy_report,
    privatize,
    sample_batch,
)
from privleak.dpsgd.vmf import VMF, vmf_release

__all__ = [
    "GRAD_DTYPES", "VMF", "BookKeeping", "ClipOnly", "ClippedSum", "Clipping", "DPOptimizer", "DPSGDConfig",
    "DPSGDMechanism", "Gaussian", "GraphedStep", "Laplace", "PrivacyReport", "Sampling", "clip_and_accumulate",
    "clip_factors", "mechanism", "per_sample_gradients", "privacy_report", "privatize", "sample_batch", "vmf_release",
]
