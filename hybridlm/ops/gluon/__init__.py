"""Gluon kernels for Hopper (sm_90): warpgroup MMA, TMA and mbarriers written out by hand, below what the Triton
language exposes. Not registered with any dispatch yet (faster than our Triton forward at some shapes, slower at
others: gdn_fwd's docstring); call them directly: `gdn_fwd.gated_delta_rule_fwd` (the Gated DeltaNet forward, no
autograd) and `gdn_fwd.gluon_available()` (whether the installed Triton has the Gluon API they are written against).
"""
