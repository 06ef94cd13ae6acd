"""taps: the driver package (models, selection policies, decode loop, training, CLI).

The heavy lifting is in :mod:`taps_kernels`; this package wires a target model,
a DFlash drafter and the tree ops into a lossless speculative decoding loop.
"""
__version__ = "0.1.0"
