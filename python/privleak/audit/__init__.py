"""Privacy auditing: statistical lower bounds on epsilon from attacks on real releases.

An audit runs a mechanism, attacks its outputs, and turns the attack's measured error rates into
an epsilon that the mechanism must have with high confidence: if the lower bound exceeds what the
accountant claims, the implementation (or the accounting) is wrong; if it comes close, the claim
is tight.

- :mod:`privleak.audit.release`: multi-run auditing of one release of the Gaussian, Laplace or
  VMF mechanism in isolation (thousands to millions of releases on a worst-case neighbouring
  pair, a threshold test on the privacy-loss statistic, Clopper-Pearson bounds on its error
  rates), where an audit can be tight. CLI: ``privleak audit release``.
"""
from privleak.audit.release import (
    MECHANISMS,
    ReleaseAudit,
    audit_release,
    clopper_pearson_upper,
    epsilon_lower_bound,
    laplace_segment_log_capacity,
)

__all__ = [
    "MECHANISMS",
    "ReleaseAudit",
    "audit_release",
    "clopper_pearson_upper",
    "epsilon_lower_bound",
    "laplace_segment_log_capacity",
]

# --- one-run auditing (privleak.audit.one_run) ------------------------------------------------
# Steinke, Nasr and Jagielski (NeurIPS 2023): m canaries in one run, an exact binomial bound.
from privleak.audit.one_run import (  # noqa: E402
    OneRunAudit,
    audit_dpsgd,
    audit_one_run,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)

__all__ += ["OneRunAudit", "audit_dpsgd", "audit_one_run", "one_run_epsilon_lower_bound", "one_run_p_value"]
