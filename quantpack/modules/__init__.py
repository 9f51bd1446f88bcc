"""The torch modules a packed checkpoint loads into: :mod:`.linear` (``QuantLinear``), :mod:`.merged` (sibling
projections run as one GEMV), :mod:`.experts` (``QuantExperts``), :mod:`.w8a8` (``W8A8Linear``) and :mod:`.fused`
(fused RMSNorm and rotary on a loaded model)."""
