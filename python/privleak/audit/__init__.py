"""Privacy auditing: statistical lower bounds on epsilon from attacks on real releases.

An audit runs a mechanism, attacks its outputs, and turns the attack's measured error rates into
an epsilon that the mechanism must have with high confidence: if the lower bound exceeds what the
accountant claims, the implementation (or the accounting) is wrong; if it comes close, the claim
is tight.

- :mod:`privleak.audit.release`: multi-run auditing of one release of the Gaussian, Laplace or
  VMF mechanism in isolation (thousands to millions of releases on a worst-case neighbouring
  pair, a threshold test on the privacy-loss statistic, Clopper-Pearson bounds on its error
  rates), where an audit can be tight. CLI: ``privleak audit release``.
- :mod:`privleak.audit.one_run`: one-run auditing of a DP-SGD run (Steinke, Nasr and Jagielski,
  NeurIPS 2023): m gradient canaries, each included with probability 1/2, guesses on the top and
  bottom scores, and the paper's exact binomial bound. CLI: ``privleak audit run``.
- :mod:`privleak.audit.black_box`: the same audit with black-box input canaries (mislabelled or
  out-of-distribution examples, score = loss drop from the initial to the final model).
- :mod:`privleak.audit.federated`: the white-box gradient-canary audit of one client of the
  federated loop (:mod:`privleak.fl`), scored on the updates the server sees.
"""
from privleak.audit.black_box import audit_dpsgd_black_box
from privleak.audit.federated import audit_fl
from privleak.audit.one_run import (
    OneRunAudit,
    audit_digits,
    audit_dpsgd,
    audit_one_run,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
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
    "OneRunAudit",
    "ReleaseAudit",
    "audit_digits",
    "audit_dpsgd",
    "audit_dpsgd_black_box",
    "audit_fl",
    "audit_one_run",
    "audit_release",
    "clopper_pearson_upper",
    "epsilon_lower_bound",
    "laplace_segment_log_capacity",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
]
