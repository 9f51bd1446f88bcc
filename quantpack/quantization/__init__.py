"""Quantization methods: how a weight's codes, scales and zeros are chosen before the format packs them.

* :mod:`.groupwise`: group-wise asymmetric quantization, ``rtn``, ``hqq`` (the default) and ``refit``;
  :func:`~quantpack.quantization.groupwise.quantize` is ``quantpack.quantize``.
* :mod:`.sinq`: Sinkhorn column scales absorbed into the neighbouring norms and rows, then ``hqq`` (``--method sinq``).
* :mod:`.gptq`: GPTQ's error-compensating rounding on ``hqq``'s group parameters, calibrated (``--calibration``).
* :mod:`.calibration`: the calibration text (a file, the built-in passage, or what the model writes itself).
* :mod:`.w8a8`: int8 weights and per-token int8 activations, and their pure-torch reference.
"""
