"""Gluon kernels for Hopper (sm_90): warpgroup MMA, TMA, mbarriers and warp specialisation written out by hand,
below what the Triton language exposes. `gdn_fwd.gated_delta_rule_fwd` is the Gated DeltaNet forward (no autograd)
that `hybridlm.ops.gated_delta_rule` runs as impl="gluon", and impl="auto" where no gradient is needed and
`gdn_fwd.unsupported_reason` finds nothing against the inputs.
"""
